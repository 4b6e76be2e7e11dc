"""The word-embedding family through the same pipeline: cbow-smoke run for real (Prefect with a
temporary PREFECT_HOME, MLflow in a temporary store) on a made-up text of paragraphs."""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

import mlflow
import numpy as np
import prewarmed
import pytest
from mlflow.tracking import MlflowClient
from textdata import make_text

from flows.pipeline import pipeline

pytestmark = pytest.mark.integration

FAST = [
    "train.max_steps=60",
    "train.eval_interval=30",
    "train.checkpoint_interval=30",
    "train.batch_size=256",
    "data.vocab.min_freq=1",
    "model.n_embd=16",
    "sample.probes=[war, prince, nosuchword]",
    "sample.neighbours=3",
]


def _paragraphs(n: int, seed: int = 3) -> str:
    """Made-up paragraphs of English-like words and the words of WordSim-353's first pairs, so
    that the headline metric has pairs to score."""
    from mllm.embeddings.wordsim import load_pairs

    rng = random.Random(seed)
    words = sorted({w for a, b, _ in load_pairs("wordsim353")[:40] for w in (a, b)})
    text = make_text(n, seed=seed, gutenberg=False).split("\r\n\r\n")
    return "\r\n\r\n".join(f"{p} {' '.join(rng.choice(words) for _ in range(12))}." for p in text) + "\r\n"


def test_cbow_smoke_trains_evaluates_exports_and_registers_a_model_that_answers(tmp_path: Path) -> None:
    corpus = tmp_path / "paragraphs.txt"
    corpus.write_text(_paragraphs(6000))
    r = pipeline(recipe="cbow-smoke", source=str(corpus), storage_url=str(tmp_path / "storage"), overrides=FAST)

    # Paragraphs on disk: the validation split's contexts never cross one.
    offsets = np.load(r.data.splits.val.offsets)
    assert offsets[0] == 0 and offsets[-1] == r.data.splits.val.n_tokens and len(offsets) > 2

    e = r.evaluation
    assert e.headline == "wordsim353_spearman" and e.higher_is_better and math.isfinite(e.score)
    assert {"wordsim353_coverage", "simlex999_spearman", "analogy_accuracy", "val_loss"} <= set(e.metrics)
    assert r.decision == "promoted" and r.champion.reason == "no champion yet"
    [table] = r.samples["neighbours"][:1]
    assert table.startswith("war: ") and len(table.split(", ")) == 3

    client = MlflowClient()
    run = client.get_run(r.mlflow_run_id)
    assert run.data.metrics["final_wordsim353_spearman"] == pytest.approx(e.score)
    assert [m.step for m in client.get_metric_history(r.mlflow_run_id, "val_loss")] == [30, 60]
    artifacts = {a.path for a in client.list_artifacts(r.mlflow_run_id, "embeddings")}
    assert artifacts == {"embeddings/vectors.parquet", "embeddings/vectors.w2v.txt", "embeddings/pca.png"}
    version = client.get_model_version_by_alias("cbow-smoke", "champion")
    assert version.tags["headline"] == "wordsim353_spearman"

    # gensim reads the exported vectors; the served model answers with the same neighbours.
    from gensim.models import KeyedVectors

    w2v = mlflow.artifacts.download_artifacts(
        run_id=r.mlflow_run_id, artifact_path="embeddings/vectors.w2v.txt", dst_path=str(tmp_path / "a")
    )
    kv = KeyedVectors.load_word2vec_format(w2v)
    assert kv.vector_size == 16 and "war" in kv.key_to_index
    model = mlflow.pyfunc.load_model("models:/cbow-smoke@champion", dst_path=str(tmp_path))
    [answer] = model.predict(["war"], params={"neighbours": 3})
    assert answer == table  # "war: at 0.83, andrew 0.80, ...": words and cosines, as the samples show

    # The CLI prints neighbours, and names the nearest spelling of a word the vocabulary lacks.
    env = dict(os.environ, MLFLOW_TRACKING_URI=mlflow.get_tracking_uri())
    out = prewarmed.run(
        "flows.cli",
        ["sample", "--model", "cbow-smoke@champion", "--prompt", "war prince", "--neighbours", "3"],
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[0] == answer
    out = prewarmed.run(
        "flows.cli", ["sample", "--checkpoint", r.trained.best_checkpoint, "--prompt", "prinse"], env=env, timeout=300
    )
    assert out.returncode == 2 and "'prinse' is not in the vocabulary; did you mean 'prince'?" in out.stderr
    # A prompt is tokenized as the corpus was (basic_english: lower case, ':' dropped).
    out = prewarmed.run(
        "flows.cli",
        ["sample", "--checkpoint", r.trained.best_checkpoint, "--prompt", "War: PRINCE", "--neighbours", "3"],
        env=env,
        timeout=300,
    )
    assert out.returncode == 0 and out.stdout.splitlines()[0] == answer, out.stderr[-2000:]
    # Sampling options of a language model do not apply to neighbours: refused, not ignored.
    out = prewarmed.run(
        "flows.cli",
        ["sample", "--checkpoint", r.trained.best_checkpoint, "--prompt", "war", "--method", "top-p", "--top-p", "0.9"],
        env=env,
        timeout=300,
    )
    assert (
        out.returncode == 2
        and ("model answers with nearest neighbours: --method, --top-p do not apply (--neighbours sets how many)")
        in out.stderr
    ), out.stderr[-2000:]
