"""The sequence-to-sequence family through the same pipeline: seq2seq-smoke run for real (Prefect
with a temporary PREFECT_HOME, MLflow in a temporary store) on the numbers corpus it makes
itself, and on a TSV file of pairs."""

from __future__ import annotations

import os
from pathlib import Path

import mlflow
import prewarmed
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from flows.pipeline import pipeline
from mllm.runtime.checkpoint import load_checkpoint
from mllm.seq2seq.translate import translate_texts

pytestmark = pytest.mark.integration

PNG = b"\x89PNG\r\n\x1a\n"


def test_seq2seq_smoke_trains_scores_draws_attention_and_registers_a_translator(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    r = pipeline(recipe="seq2seq-smoke", storage_url=str(storage))

    # The numbers corpus was made under the storage root and went through the download stage;
    # held-out numbers never occur in training.
    assert r.data.source.startswith(str(storage / "numbers"))
    train, val = (pq.read_table(getattr(r.data.splits, s).parquet) for s in ("train", "val"))
    assert val.num_rows == 30 and train.num_rows == 270
    assert not set(train["source"].to_pylist()) & set(val["source"].to_pylist())

    e = r.evaluation
    assert e.headline == "chrf" and e.higher_is_better and 0 <= e.score <= 100
    assert set(e.metrics) == {"val_loss", "exact_match", "bleu", "chrf"} and e.loss == e.metrics["val_loss"]
    assert r.decision == "promoted" and r.champion.reason == "no champion yet"
    assert [s.split(" -> ")[0] for s in r.samples["greedy"]] == ["twenty-one"]
    assert set(r.samples) == {"greedy", "beam"}

    client = MlflowClient()
    run = client.get_run(r.mlflow_run_id)
    assert run.data.metrics["final_chrf"] == pytest.approx(e.score)
    assert run.data.metrics["final_exact_match"] == pytest.approx(e.metrics["exact_match"])
    assert [m.step for m in client.get_metric_history(r.mlflow_run_id, "val_loss")] == [20, 40]
    assert {"vocab.json", "src_vocab.json"} <= {a.path for a in client.list_artifacts(r.mlflow_run_id)}
    pictures = {a.path for a in client.list_artifacts(r.mlflow_run_id, "attention")}
    assert pictures == {f"attention/attention-{i}.png" for i in (1, 2, 3)}
    png = mlflow.artifacts.download_artifacts(
        run_id=r.mlflow_run_id, artifact_path="attention/attention-1.png", dst_path=str(tmp_path / "a")
    )
    assert Path(png).read_bytes()[:8] == PNG
    version = client.get_model_version_by_alias("seq2seq-smoke", "champion")
    assert version.tags["headline"] == "chrf" and float(version.tags["headline.value"]) == pytest.approx(e.score)

    # The registered model translates as the checkpoint does, greedy and with a beam.
    loaded = load_checkpoint(r.trained.best_checkpoint)
    model = mlflow.pyfunc.load_model("models:/seq2seq-smoke@champion", dst_path=str(tmp_path))
    texts = ["twenty-one", "three hundred and five"]
    assert model.predict(texts) == translate_texts(loaded, texts, "greedy")
    assert model.predict(texts, params={"method": "beam", "beam_width": 2}) == translate_texts(
        loaded, texts, "beam", beam_width=2
    )

    # The CLI translates a file of lines, and names a word outside the source vocabulary.
    lines = tmp_path / "lines.txt"
    lines.write_text("twenty-one\n\nthree hundred and five\n")
    env = dict(os.environ, MLFLOW_TRACKING_URI=mlflow.get_tracking_uri())
    out = prewarmed.run(
        "flows.cli", ["sample", "--model", "seq2seq-smoke@champion", "--prompt-file", str(lines)], env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    first, third = model.predict(texts)
    assert out.stdout.splitlines() == [first, "", third]  # a line an answer: the blank line stays blank
    # A line with a word the source vocabulary lacks is named; the other lines are translated.
    lines.write_text("twenty-one\neleventy one\nthree hundred and five\n")
    out = prewarmed.run(
        "flows.cli", ["sample", "--model", "seq2seq-smoke@champion", "--prompt-file", str(lines)], env=env, timeout=300
    )
    assert out.returncode == 2 and out.stdout.splitlines() == [first, "", third], out.stderr[-2000:]
    assert [line for line in out.stderr.splitlines() if line.startswith("error:")] == [
        f"error: 1 of 3 lines of {lines} were not answered (left blank): line 2: the input has tokens the source "
        "vocabulary lacks: 'eleventy'; leave them out or rephrase"
    ]
    out = prewarmed.run(
        "flows.cli",
        ["sample", "--checkpoint", r.trained.best_checkpoint, "--prompt", "eleventy one"],
        env=env,
        timeout=300,
    )
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "error: the input has tokens the source vocabulary lacks: 'eleventy'; leave them out or rephrase"
    ]

    # Nothing changed: the next run trains nothing.
    again = pipeline(recipe="seq2seq-smoke", storage_url=str(storage))
    assert again.decision == "skipped" and "unchanged since champion v1" in again.reason


def test_a_tsv_of_pairs_trains_and_a_file_without_pairs_is_one_line(tmp_path: Path) -> None:
    """Any TSV source: a third column is ignored, bad lines are left out, identical sources stay
    on one side of the split; a file with no valid pair stops the CLI with one line."""
    words = "red green blue black white pink grey gold".split()
    rows = [f"{a} {b}\t{b} {a}\tCC-BY 2.0 (France) Attribution: tatoeba.org" for a in words for b in words]
    rows += [f"{a} {a}\t{a}!\tsecond translation" for a in words]  # a source seen twice ("x x" above)
    (tmp_path / "pairs.tsv").write_text("\n".join(rows + ["one column only", "\tempty source"]) + "\n")
    r = pipeline(
        recipe="seq2seq-smoke",
        source=str(tmp_path / "pairs.tsv"),
        storage_url=str(tmp_path / "s"),
        overrides=[
            "data.pairs.target_tokenizer.kind=word",
            "data.split.val_fraction=0.2",
            "train.max_steps=20",
            "data.pairs.bleu_tokenize=13a",
        ],
    )
    train, val = (pq.read_table(getattr(r.data.splits, s).parquet) for s in ("train", "val"))
    assert train.num_rows + val.num_rows == 72 and train.column_names[:2] == ["source", "target"]
    assert not set(train["source"].to_pylist()) & set(val["source"].to_pylist())
    assert r.data.source_side.vocab.size == 4 + 8 and r.data.vocab.size >= 4 + 8
    assert r.samples["greedy"] == []  # "twenty-one" is not a colour: left out, with a warning

    # Another split: the champion is scored on this run's held-out pairs before chrF decides.
    again = pipeline(
        recipe="seq2seq-smoke",
        source=str(tmp_path / "pairs.tsv"),
        storage_url=str(tmp_path / "s"),
        overrides=[
            "data.pairs.target_tokenizer.kind=word",
            "data.split.val_fraction=0.2",
            "train.max_steps=20",
            "data.pairs.bleu_tokenize=13a",
            "data.split.seed=7",
        ],
    )
    cs = again.champion.champion_score
    assert cs.headline == "chrf" and cs.splits_key == again.data.splits.key != r.data.splits.key
    assert again.champion.reason.endswith("for champion v1, both on this run's validation split")

    bad = tmp_path / "bad.tsv"
    bad.write_text("no tab here\n\t\n")
    out = prewarmed.run(
        "flows.cli",
        ["run", "--recipe", "seq2seq-smoke", "--source", str(bad), "--storage", str(tmp_path / "s2")],
        timeout=300,
    )
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() + out.stdout.splitlines() if "no valid pair" in line]
    assert errors == [
        f"error: {bad} has no valid pair in 2 lines: give lines of 'source<TAB>target' (a TSV of parallel text)"
    ]
    assert "Traceback" not in out.stderr
