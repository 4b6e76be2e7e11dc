"""The pipeline flow, run for real (Prefect with a temporary PREFECT_HOME) on a made-up text."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import prewarmed
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName
from prefect.client.schemas.sorting import TaskRunSort
from textdata import make_text

from flows.pipeline import pipeline
from mllm.data.vocab import Vocab
from mllm.resolve import Overrides

pytestmark = pytest.mark.integration

FAST = [
    "train.max_steps=12",
    "train.eval_interval=6",
    "train.checkpoint_interval=6",
    "train.log_interval=3",
    "sample.max_new_tokens=20",
]


def _run(source: Path, root: Path, extra: list[str] = ()):
    return pipeline(recipe="smoke", source=str(source), storage_url=str(root), overrides=FAST + list(extra))


def test_flows_take_overrides_space_and_grid_typed_and_prefect_records_them_as_json() -> None:
    # What a deployment's form, a script or a test gives (texts) is validated into the types the
    # flows use; what Prefect stores of a run is JSON that validates back to the same.
    from prefect.exceptions import ParameterTypeError

    from flows.search.flow import search
    from flows.search.space import parse_space
    from flows.sweep.flow import sweep

    texts = ["train.lr=3e-4", "sample.methods=[greedy]"]
    params = pipeline.validate_parameters({"recipe": "smoke", "overrides": texts})
    assert params["overrides"] == Overrides.parse(texts)
    assert pipeline.serialize_parameters(params)["overrides"] == texts
    with pytest.raises(ParameterTypeError, match="malformed override 'train.lr'"):
        pipeline.validate_parameters({"overrides": ["train.lr"]})
    # A deployment's form (the UI's Run, a schedule's runs): the server checks its parameters
    # against the flow's schema with this function before any worker sees them.
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools.validation import ValidationError, validate

    schema = parameter_schema(pipeline).model_dump_for_openapi()
    validate({"recipe": "smoke", "overrides": texts}, schema, raise_on_error=True)
    with pytest.raises(ValidationError, match="overrides"):
        validate({"recipe": "smoke", "overrides": [{"field": "train.lr"}]}, schema, raise_on_error=True)
    space = ["train.lr=log:1e-4..1e-2", "model.n_layer=1,2"]
    for flow, given, typed in (
        (search, {"space": space}, {"space": parse_space(space)}),
        (sweep, {"grid": ["train.lr=1e-3, 3e-3"]}, {"grid": {"train.lr": ["1e-3", "3e-3"]}}),
    ):
        params = flow.validate_parameters({**given, "overrides": texts})
        assert {k: params[k] for k in typed} == typed and params["overrides"] == Overrides.parse(texts)
        recorded = json.loads(json.dumps(flow.serialize_parameters(params)))
        assert flow.validate_parameters(recorded) == params


def _task_states(name: str) -> list[str]:
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=name)),
            sort=TaskRunSort.EXPECTED_START_TIME_DESC,
            limit=50,
        )
    return [r.state.name for r in runs if r.state]


def test_pipeline_writes_every_stage_and_a_usable_checkpoint(corpus: Path, tmp_path: Path) -> None:
    root = tmp_path / "storage"
    r = _run(corpus, root)

    raw = root / "raw" / f"{r.data.raw_sha256}.txt"
    assert raw.read_bytes() == corpus.read_bytes()
    assert json.loads((root / "raw" / f"{r.data.raw_sha256}.json").read_text())["bytes"] == corpus.stat().st_size

    table = pq.read_table(Path(r.data.tokens.url) / "part-0.parquet")
    assert table.schema.field("tokens").type == pa.list_(pa.string())
    tokens = [t for row in table.column("tokens").to_pylist() for t in row]
    assert len(tokens) == r.data.tokens.n_tokens
    text = "".join(tokens)
    assert "License" not in text and "Gutenberg" not in text  # header and footer stripped
    assert "\n" not in text and "  " not in text  # reference normalisation

    vocab = Vocab.load(r.data.vocab.url)
    assert vocab.itos[0] == "<unk>" and set(vocab.itos[1:]) == set(tokens)

    s = r.data.splits
    train, val = np.load(s.train.ids), np.load(s.val.ids)
    assert len(train) + len(val) == r.data.tokens.n_tokens
    assert len(val) == int(r.data.tokens.n_tokens * 0.1)
    assert s.test is None
    # Contiguous: the train split is the start of the text, val the rest, in order.
    assert vocab.decode(train[:50].tolist()) == tokens[:50]
    assert vocab.decode(val[-50:].tolist()) == tokens[-50:]
    assert pq.read_table(s.val.parquet).column("token_id").to_numpy().tolist() == val.tolist()

    assert r.trained.steps == 12
    assert Path(r.trained.checkpoint).is_file()
    assert 0 < r.evaluation.loss < np.log(len(vocab)) + 0.5
    assert r.evaluation.tokens == len(val) - 1 or r.evaluation.tokens == len(val)
    assert (Path(r.trained.run_dir) / "samples" / "greedy.txt").is_file()

    out = prewarmed.run(
        "mllm.sample",
        ["--checkpoint", r.trained.checkpoint, "--prompt", "The ", "--max-new-tokens", "30", "--method", "top-p"],
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout.removesuffix("\n")
    assert text.startswith("The ") and len(text) == 4 + 30  # one character per new token


def test_second_run_reuses_every_data_stage_and_skips_training(corpus: Path, tmp_path: Path) -> None:
    root = tmp_path / "storage"
    first = _run(corpus, root)
    assert first.decision == "promoted" and first.reason == "no champion yet"
    parquet = Path(first.data.tokens.url) / "part-0.parquet"
    mtime = parquet.stat().st_mtime_ns
    second = _run(corpus, root)
    assert second.data == first.data
    assert parquet.stat().st_mtime_ns == mtime  # not tokenized again
    for stage in ("tokenize", "build-vocabulary", "split"):
        assert _task_states(stage)[0] == "Cached", stage
    # The champion was trained on the same data, config and code: nothing to train.
    assert second.decision == "skipped" and second.trained is None
    assert f"since champion v{first.champion.version}" in second.reason
    # Forced, training finds its finished checkpoint and does not train again, as the skip's
    # reason says (and `--force`'s help); the model is the champion's equal, so the champion stays.
    assert second.reason.endswith(
        "--force evaluates, registers and judges it again, reusing that training (another --storage trains anew)"
    )
    third = pipeline(recipe="smoke", source=str(corpus), storage_url=str(root), overrides=FAST, force=True)
    assert third.trained.resumed_from_step == first.trained.steps
    assert third.decision == "kept" and _task_states("evaluate")[0] == "Cached"


def test_runs_with_other_inputs_never_share_outputs(corpus: Path, tmp_path: Path) -> None:
    root = tmp_path / "storage"
    other = tmp_path / "other.txt"
    other.write_text(make_text(seed=1), encoding="utf-8")
    a = _run(corpus, root)
    b = _run(other, root)
    c = _run(corpus, root, ["data.tokenizer.normalize=false"])
    assert len({a.data.tokens.url, b.data.tokens.url, c.data.tokens.url}) == 3
    assert len({a.data.splits.url, b.data.splits.url, c.data.splits.url}) == 3
    assert len({a.trained.run_dir, b.trained.run_dir, c.trained.run_dir}) == 3
    # A raw-mode vocabulary keeps the newlines the reference normalisation removes.
    assert "\n" in Vocab.load(c.data.vocab.url).stoi and "\n" not in Vocab.load(a.data.vocab.url).stoi


def test_test_split_and_word_tokenizer(corpus: Path, tmp_path: Path) -> None:
    r = _run(
        corpus,
        tmp_path / "storage",
        [
            "data.tokenizer.kind=word",
            "data.split.test_fraction=0.1",
            "data.split.contiguous=false",
            "data.split.shuffle_chunk=64",
        ],
    )
    s = r.data.splits
    n = r.data.tokens.n_tokens
    assert s.test is not None
    assert s.train.n_tokens + s.val.n_tokens + s.test.n_tokens == n
    assert abs(s.val.n_tokens - 0.1 * n) <= 64 and abs(s.test.n_tokens - 0.1 * n) <= 64
    assert s.val.n_bytes > s.val.n_tokens  # a word stands for several bytes
    m = r.evaluation.metrics
    assert r.evaluation.headline == "val_bits_per_byte" and m["val_bits_per_byte"] < m["val_bits_per_token"]


def test_nproc_per_node_trains_under_torchrun_and_logs_its_metrics(corpus: Path, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    r = _run(corpus, tmp_path / "storage", ["train.nproc_per_node=2"])
    assert r.trained.steps == 12 and Path(r.trained.checkpoint).is_file()
    # The two ranks' metrics came back through the event file into the MLflow run.
    history = MlflowClient().get_metric_history(r.mlflow_run_id, "train_loss")
    assert sorted(m.step for m in history) == [3, 6, 9, 12]
    assert json.loads((Path(r.trained.run_dir) / "trained.json").read_text())["steps"] == 12


def test_changed_data_trains_a_challenger_judged_on_the_same_split(corpus: Path, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    root = tmp_path / "storage"
    first = _run(corpus, root)
    corpus.write_text(make_text(5000, seed=7), encoding="utf-8")  # new text at the same source
    second = _run(corpus, root)
    assert second.data.raw_sha256 != first.data.raw_sha256 and second.decision in ("promoted", "kept")
    # The champion was scored on the challenger's validation split, and bits per byte decided.
    score = second.champion.champion_score
    assert score.splits_key == second.data.splits.key
    assert score.headline == "val_bits_per_byte"
    assert (second.decision == "promoted") == (second.evaluation.score < score.value)
    client = MlflowClient()
    champion = client.get_model_version_by_alias("smoke", "champion")
    assert str(champion.version) == (
        second.champion.version if second.decision == "promoted" else first.champion.version
    )
    tags = client.get_run(second.mlflow_run_id).data.tags
    assert tags["decision"] == second.decision and "both on this run's validation split" in tags["decision.reason"]
    # Once more on the same text: that model exists, champion or not; nothing to train.
    third = _run(corpus, root)
    assert third.decision == "skipped"
    assert ("did not beat" in third.reason) == (second.decision == "kept")
