"""`mllm-pipeline lineage` through the real CLI: two smoke trainings on two made-up corpora (one
behind a password), then the chain from the registry back to the corpus bytes, the other
direction from a corpus to its runs, and what the chain says once storage is damaged. The same
graph is read back from the Prefect server's asset events."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import time
import uuid
from pathlib import Path

import commands
import pytest
from commands import PASSWORD, TOKEN, cli, files_holding
from textdata import make_text

pytestmark = pytest.mark.integration

MATERIALIZED = "prefect.asset.materialization.succeeded"


def _chain(out) -> dict:
    return {link["link"]: link for link in json.loads(out.stdout)["links"]}


@pytest.fixture
def prefect_api(prefect_server) -> str:
    """The URL of the tests' Prefect server, for the CLI processes a test starts."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def _events(since: datetime.datetime, until: set[str] = frozenset(), deadline_s: float = 120) -> list:
    """Every event the Prefect server holds since `since`, read through its API
    (POST /api/events/filter, page by page); waits until assets `until` have each been
    materialized: the server stores the events a run sends a little after it ends."""
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventOccurredFilter

    deadline = time.monotonic() + deadline_s
    with get_client(sync_client=True) as client:
        while True:
            page = client.read_events(EventFilter(occurred=EventOccurredFilter(since=since)), limit=50)
            events = list(page.events)
            while page.next_page:
                page = client.read_events_page(str(page.next_page))
                events += page.events
            if until <= {e.resource.id for e in events if e.event == MATERIALIZED} or time.monotonic() > deadline:
                return events
            time.sleep(1)


def _upstream(events: list) -> dict[str, set[str]]:
    """{asset key: the keys of its upstream assets} from the materialization events."""
    return {e.resource.id: {r.id for r in e.related if r.role == "asset"} for e in events if e.event == MATERIALIZED}


def test_lineage_follows_a_model_to_its_corpus_and_reports_broken_links(
    basic_auth_server,
    own_stores,
    prefect_api,
    tmp_path,
):
    folder, port = basic_auth_server
    (folder / "corpus.txt").write_text(make_text(3000, seed=1))
    other = tmp_path / "other.txt"
    other.write_text(make_text(3000, seed=2))
    env, prefect, mlflow, storage = own_stores
    # The runs and `lineage` report to the tests' Prefect server, which keeps their events.
    env = {**env, "PREFECT_API_URL": prefect_api}
    since = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=5)
    # The first corpus is downloaded with a password in its URL and the run has a secret tag:
    # neither may reach the terminal, storage, MLflow or Prefect (checked below).
    secret_source = f"http://reader:{PASSWORD}@127.0.0.1:{port}/corpus.txt"
    runs = [
        cli("run", "--recipe", "smoke", "--source", source, "--set", "train.max_steps=10", *tag, env=env)
        for source, tag in ((secret_source, ("--tag", f"token={TOKEN}")), (str(other), ()))
    ]
    for out in runs:
        assert out.returncode == 0, out.stderr[-3000:]
        assert "val loss" in out.stdout
    # A bad URL with credentials: the error line names the URL, not the password.
    bad = cli(
        "prepare", "--recipe", "smoke", "--source", f"https://reader:{PASSWORD}@127.0.0.1:{port}/nope.txt", env=env
    )
    assert bad.returncode == 2 and "error:" in bad.stderr

    out = cli("lineage", "smoke/1", env=env)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    text = out.stdout
    first = cli("lineage", "smoke/1", "--json", env=env)
    chain = _chain(first)
    assert json.loads(first.stdout)["ok"] is True
    assert list(chain) == ["model", "run", "prefect", "code", "training", "split", "vocabulary", "tokens", "corpus"]
    assert all(link["status"] == "ok" for link in chain.values()), chain
    # The flow run that ran the pipeline, looked up on the Prefect server it ran on.
    assert chain["prefect"]["state"] == "Completed" and chain["prefect"]["ui"].endswith(chain["prefect"]["flow_run_id"])
    corpus = chain["corpus"]
    # The corpus as downloaded: its sha256 is the stored copy's name, its source without the password.
    assert (storage / "raw" / f"{corpus['sha256']}.txt").is_file()
    assert corpus["source"] == f"http://127.0.0.1:{port}/corpus.txt"
    assert corpus["bytes"] == len((folder / "corpus.txt").read_bytes())
    for needle in (
        corpus["sha256"],
        corpus["source"],
        chain["run"]["run_id"],
        chain["split"]["key"],
        chain["training"]["key"],
        chain["training"]["config_digest"],
        chain["training"]["code_digest"],
        chain["vocabulary"]["digest"],
        chain["tokens"]["key"],
    ):
        assert needle in text, needle
    # The training key is shown in clear (a digest, not a secret) and names the run's folder.
    assert (storage / "runs" / chain["training"]["key"]).is_dir()
    assert chain["model"]["name"] == "smoke" and chain["model"]["version"] == "1"

    second = _chain(cli("lineage", "smoke/2", "--json", env=env))
    assert second["corpus"]["sha256"] != corpus["sha256"]
    assert second["corpus"]["source"] == str(other)
    assert second["run"]["run_id"] != chain["run"]["run_id"]
    champion = _chain(cli("lineage", "smoke@champion", "--json", env=env))
    assert champion["model"]["aliases"] == ["champion"]

    # The other direction: each corpus finds its own run and model only.
    found = cli("lineage", "--corpus", corpus["sha256"][:10], "--json", env=env)
    assert found.returncode == 0, found.stderr[-2000:]
    rows = json.loads(found.stdout)
    assert [(r["run_id"], r["model_version"]) for r in rows] == [(chain["run"]["run_id"], "smoke/1")]
    assert rows[0]["headline"] and rows[0]["headline_value"] is not None
    listed = cli("lineage", "--corpus", second["corpus"]["sha256"][:8], env=env)
    assert second["run"]["run_id"] in listed.stdout and chain["run"]["run_id"] not in listed.stdout
    assert "no run was trained" in cli("lineage", "--corpus", "ffffffffffff", env=env).stdout

    # Nothing secret in any of it.
    for said in (*runs, bad, out, first, found, listed):
        assert PASSWORD not in said.stdout + said.stderr and TOKEN not in said.stdout + said.stderr

    # Prefect's events hold the same graph, each asset keyed by the storage URI the run wrote
    # (the corpus source by its URL without the password): source -> stored copy -> token
    # chunks -> vocabulary and split -> checkpoint -> evaluation report and samples.
    def key(path: str) -> str:
        return f"file://{path}"

    copy, tokens, vocab, split = (key(chain[k]["uri"]) for k in ("corpus", "tokens", "vocabulary", "split"))
    best = key(chain["model"]["checkpoint"])
    run_dir = storage / "runs" / chain["training"]["key"]
    report, samples = key(str(run_dir / "eval-val.md")), key(str(run_dir / "samples" / "greedy.txt"))
    events = _events(since, until={copy, tokens, vocab, split, best, report, samples, key(second["corpus"]["uri"])})
    graph = _upstream(events)
    assert graph[copy] == {corpus["source"]}
    assert graph[tokens] == {copy}
    assert graph[vocab] == {tokens}
    assert graph[split] == {tokens, vocab}
    assert best.endswith("/checkpoints/best.pt") and graph[best] == {split, vocab, tokens}
    assert graph[key(str(run_dir / "checkpoints" / "last.pt"))] == {split, vocab, tokens}
    assert graph[report] == {best, split} and graph[samples] == {best}
    assert graph[key(second["corpus"]["uri"])] == {key(str(other))}
    referenced = {e.resource.id for e in events if e.event == "prefect.asset.referenced"}
    assert {corpus["source"], copy, tokens, vocab, split, best} <= referenced
    # Each materialization names its task run; the metadata holds digests and counts.
    payload = {e.resource.id: e.payload for e in events if e.event == MATERIALIZED}
    assert payload[copy]["sha256"] == corpus["sha256"] and payload[copy]["bytes"] == corpus["bytes"]
    assert payload[vocab]["digest"] == chain["vocabulary"]["digest"]
    assert payload[tokens]["n_tokens"] == chain["tokens"]["n_tokens"]
    assert payload[split]["train_tokens"] == chain["split"]["tokens"]["train"]
    assert all(any(r.role == "task-run" for r in e.related) for e in events if e.event == MATERIALIZED)
    # No credential in any event the runs sent, nor in any file of storage, the MLflow store, or the
    # Prefect server's folder (its database with the runs' parameters, logs and events; its log).
    assert not [e.event for e in events if PASSWORD in e.model_dump_json()]
    (server_folder,) = commands.SESSION_PREFECT_SERVER
    assert list(server_folder.rglob("*.db"))  # the database is there to be searched
    for secret in (PASSWORD, TOKEN):
        assert files_holding(secret, storage, mlflow, server_folder) == []

    # A flow run recorded on another Prefect server, with no Prefect API, or with one that does
    # not answer, is unchecked: not a break.
    from flows.history.lineage import _flow_run

    status, _, detail = _flow_run(chain["prefect"]["flow_run_id"], "http://elsewhere:4200/runs/flow-run/1")
    assert status == "unchecked" and "another Prefect server" in detail
    with socket.socket() as s:  # bound, not listening: a port where nothing answers while the test holds it
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/api"
        for api, needle in (("", "no Prefect API configured"), (dead, "does not answer")):
            out = cli("lineage", "smoke/1", env={**env, "PREFECT_API_URL": api})
            assert out.returncode == 0, out.stdout + out.stderr[-2000:]
            assert "[UNCHECKED]" in out.stdout and needle in out.stdout and "Traceback" not in out.stderr, out.stdout

    # A deleted split folder and a corpus copy that no longer has its digest are reported, and
    # the rest of the chain is still printed.
    shutil.rmtree(chain["split"]["uri"])
    raw = Path(second["corpus"]["uri"])
    raw.write_bytes(raw.read_bytes() + b"edited")
    broken = cli("lineage", "smoke/1", env=env)
    assert broken.returncode == 1, broken.stderr[-2000:]
    assert "[MISSING]" in broken.stdout and "the split folder is gone" in broken.stdout
    assert "broken links: split" in broken.stdout and corpus["sha256"] in broken.stdout
    # ... and so is a flow run gone from the Prefect server the run was recorded on.
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.delete_flow_run(uuid.UUID(second["prefect"]["flow_run_id"]))
    # One token of a split's array changed in place (its length and header intact): its digest says so.
    val = Path(second["split"]["uri"]) / "val.npy"
    ids = bytearray(val.read_bytes())
    ids[-1] ^= 1
    val.write_bytes(bytes(ids))
    changed = _chain(cli("lineage", chain_run := second["run"]["run_id"], "--json", env=env))
    assert changed["corpus"]["status"] == "changed" and changed["run"]["run_id"] == chain_run
    assert changed["split"]["status"] == "changed" and "val.npy now has sha256" in changed["split"]["detail"]
    assert changed["prefect"]["status"] == "missing"


def test_lineage_refuses_what_names_no_model_in_one_line(own_stores):
    env = own_stores[0]
    from mlflow.tracking import MlflowClient

    MlflowClient(env["MLFLOW_TRACKING_URI"]).search_experiments()  # a store, with no model in it
    for args, needle in (
        (["lineage", "smoke@champion"], "no model 'smoke' with alias 'champion'"),
        (["lineage", "not-a-run"], "neither MODEL@ALIAS"),
        (["lineage", "--corpus", "xyz"], "no sha256 prefix"),
        (["lineage"], "give a model"),
    ):
        out = cli(*args, env=env, timeout=120)
        assert out.returncode == 2, (args, out.stdout, out.stderr[-2000:])
        assert "Traceback" not in out.stderr
        errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and needle in errors[0], (args, out.stderr)


def test_an_asset_key_is_the_storage_uri_without_secrets():
    from prefect.assets import Asset

    from tasks.assets import asset_key

    keys = {
        "/tmp/s/raw/ab.txt": "file:///tmp/s/raw/ab.txt",
        "file:///tmp/s/tokens/k": "file:///tmp/s/tokens/k",
        "relative/x": f"file://{os.path.abspath('relative/x')}",
        "s3://bucket/root/vocab/k/vocab.json": "s3://bucket/root/vocab/k/vocab.json",
        f"https://reader:{PASSWORD}@host/c.txt?X-Amz-Signature=abc#part": "https://host/c.txt",
        "HTTP://host/c.txt": "http://host/c.txt",
    }
    for url, key in keys.items():
        assert asset_key(url) == key == Asset(key=key).key
    # Prefect refuses a space (and %, so it cannot be quoted): such a path is no asset.
    assert asset_key("/tmp/a folder/x") is None and asset_key("/tmp/" + "x" * 600) is None


def test_parallel_text_and_made_data_are_assets_and_a_cached_stage_adds_none(tmp_path):
    from flows.launch import with_results
    from flows.pipeline import prepare
    from mllm.resolve import resolve

    root = str(tmp_path / "storage")
    since = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=5)
    pairs = with_results(prepare, root)(resolve("seq2seq-smoke"), root)
    with_results(prepare, root)(resolve("seq2seq-smoke"), root)  # every stage Cached
    made = with_results(prepare, root)(resolve("sequences-smoke"), root)

    def key(url: str) -> str:
        return f"file://{url}"

    copy, folder = key(pairs.raw_url), key(pairs.splits.url)
    events = _events(since, until={copy, folder, key(made.splits.url), key(made.vocab.url)})
    graph = _upstream(events)
    # The numbers corpus is made, then downloaded like any source; the pairs folder and both
    # vocabularies (what training reads) come from the stored copy.
    [numbers] = graph[copy]
    assert numbers.startswith(key(root + "/numbers/")) and graph[numbers] == set()
    assert graph[folder] == graph[key(pairs.vocab.url)] == graph[key(pairs.source_side.vocab.url)] == {copy}
    assert graph[key(made.splits.url)] == graph[key(made.vocab.url)] == set()
    # The second preparation was Cached: the first one's materializations stand alone (its
    # events were sent before those of the made data, which are in).
    assert [e.resource.id for e in events if e.event == MATERIALIZED].count(folder) == 1
