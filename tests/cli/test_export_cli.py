"""`mllm-pipeline export` end to end: a GPT with the default recipe's pieces trained by the
pipeline against a real MLflow server, exported by its registered name, kept with the model in
MLflow, loaded by transformers, and followed back to its corpus by `lineage`."""

from __future__ import annotations

import json

import pytest
from commands import cli
from textdata import make_text

pytestmark = pytest.mark.integration
pytest.importorskip("transformers")

TINY = [
    "--set",
    "train.max_steps=6",
    "--set",
    "train.max_minutes=null",
    "--set",
    "train.eval_interval=3",
    "--set",
    "train.eval_batches=1",
    "--set",
    "train.checkpoint_interval=3",
    "--set",
    "train.batch_size=2",
    "--set",
    "train.window=32",
    "--set",
    "model.n_layer=1",
    "--set",
    "model.n_embd=32",
    "--set",
    "model.n_head=2",
    "--set",
    "sample.max_new_tokens=5",
]


def test_export_a_registered_model_records_it_and_lineage_follows_it(mlflow_server, own_stores, tmp_path):
    import torch
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM

    env, _, _, storage = own_stores
    env = {**env, "MLFLOW_TRACKING_URI": mlflow_server.url}
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(make_text(3000, seed=3))
    trained = cli("run", "--recipe", "default", "--source", str(corpus), *TINY, env=env)
    assert trained.returncode == 0, trained.stderr[-3000:]

    out = tmp_path / "hf"
    done = cli("export", "default@champion", "--format", "hf", "--out", str(out), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "recorded on run" in done.stdout and "default/1" in done.stdout
    manifest = json.loads((out / "mllm-export.json").read_text())
    assert manifest["format"] == "hf" and manifest["model"] == "default/1" and manifest["libraries"]["transformers"]
    card = (out / "README.md").read_text()
    assert manifest["corpus_sha256"] and manifest["corpus_sha256"] in card and manifest["mlflow_run"] in card
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert hf.config.model_type == "gpt_neox" and hf(torch.tensor([[1, 2, 3]])).logits.shape[-1] > 3

    # Kept with the model: the run's artifacts, and tags on the run and the version.
    client = MlflowClient(mlflow_server.url)
    version = client.get_model_version("default", "1")
    assert version.tags["export.hf.uri"] == str(out)
    assert "transformers==" in version.tags["export.hf.libraries"]
    listed = {a.path for a in client.list_artifacts(manifest["mlflow_run"], "exports/hf")}
    assert {"exports/hf/model.safetensors", "exports/hf/config.json", "exports/hf/tokenizer.json"} <= listed

    # lineage from the export's folder: the export, then the model's chain down to the corpus.
    chain = cli("lineage", str(out), "--json", env=env)
    assert chain.returncode == 0, chain.stdout + chain.stderr[-2000:]
    links = {link["link"]: link for link in json.loads(chain.stdout)["links"]}
    assert list(links)[:2] == ["export", "model"] and links["export"]["status"] == "ok"
    assert links["corpus"]["sha256"] == manifest["corpus_sha256"]
    text = cli("lineage", str(out), env=env).stdout
    assert text.startswith("export      hf  of default/1") and "corpus" in text

    # Another format of the same version; a folder that holds files already is refused in one line.
    onnx = cli("export", "default/1", "--format", "onnx", "--out", str(tmp_path / "onnx"), env=env)
    assert onnx.returncode == 0 and (tmp_path / "onnx" / "model.onnx").is_file(), onnx.stderr[-2000:]
    assert "onnx" in client.get_model_version("default", "1").tags["export.onnx.libraries"]
    taken = cli("export", "default/1", "--format", "hf", "--out", str(out), env=env)
    assert taken.returncode == 2 and taken.stderr.strip().count("\n") == 0 and "already holds files" in taken.stderr
