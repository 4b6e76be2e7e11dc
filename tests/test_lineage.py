"""`mllm-pipeline lineage` through the real CLI: two smoke trainings on two made-up corpora (one
behind a password), then the chain from the registry back to the corpus bytes, the other
direction from a corpus to its runs, and what the chain says once storage is damaged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from conftest import make_text
from test_faults import PASSWORD, basic_auth_server, cli, own_stores  # noqa: F401 (fixtures)


def _chain(out) -> dict:
    return {link["link"]: link for link in json.loads(out.stdout)["links"]}


def test_lineage_follows_a_model_to_its_corpus_and_reports_broken_links(basic_auth_server, own_stores, tmp_path):  # noqa: F811
    folder, port = basic_auth_server
    (folder / "corpus.txt").write_text(make_text(3000, seed=1))
    other = tmp_path / "other.txt"
    other.write_text(make_text(3000, seed=2))
    env, prefect, mlflow, storage = own_stores
    secret_source = f"http://reader:{PASSWORD}@127.0.0.1:{port}/corpus.txt"
    for source in (secret_source, str(other)):
        out = cli("run", "--recipe", "smoke", "--source", source, "--set", "train.max_steps=10", env=env)
        assert out.returncode == 0, out.stderr[-3000:]

    out = cli("lineage", "smoke/1", env=env)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    text = out.stdout
    first = cli("lineage", "smoke/1", "--json", env=env)
    chain = _chain(first)
    assert json.loads(first.stdout)["ok"] is True
    assert list(chain) == ["model", "run", "code", "training", "split", "vocabulary", "tokens", "corpus"]
    assert all(link["status"] == "ok" for link in chain.values()), chain
    corpus = chain["corpus"]
    # The corpus as downloaded: its sha256 is the stored copy's name, its source without the password.
    assert (storage / "raw" / f"{corpus['sha256']}.txt").is_file()
    assert corpus["source"] == f"http://127.0.0.1:{port}/corpus.txt"
    assert corpus["bytes"] == len((folder / "corpus.txt").read_bytes())
    for needle in (corpus["sha256"], corpus["source"], chain["run"]["run_id"], chain["split"]["key"],
                   chain["training"]["key"], chain["training"]["config_digest"], chain["training"]["code_digest"],
                   chain["vocabulary"]["digest"], chain["tokens"]["key"]):
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
    for out in (out, first, found, listed):
        assert PASSWORD not in out.stdout + out.stderr

    # A deleted split folder and a corpus copy that no longer has its digest are reported, and
    # the rest of the chain is still printed.
    shutil.rmtree(chain["split"]["uri"])
    raw = Path(second["corpus"]["uri"])
    raw.write_bytes(raw.read_bytes() + b"edited")
    broken = cli("lineage", "smoke/1", env=env)
    assert broken.returncode == 1, broken.stderr[-2000:]
    assert "[MISSING]" in broken.stdout and "the split folder is gone" in broken.stdout
    assert "broken links: split" in broken.stdout and corpus["sha256"] in broken.stdout
    changed = _chain(cli("lineage", chain_run := second["run"]["run_id"], "--json", env=env))
    assert changed["corpus"]["status"] == "changed" and changed["run"]["run_id"] == chain_run
    assert changed["split"]["status"] == "ok"


def test_lineage_refuses_what_names_no_model_in_one_line(own_stores):  # noqa: F811
    env = own_stores[0]
    for args, needle in ((["lineage", "smoke@champion"], "no model 'smoke' with alias 'champion'"),
                         (["lineage", "not-a-run"], "neither MODEL@ALIAS"),
                         (["lineage", "--corpus", "xyz"], "no sha256 prefix"),
                         (["lineage"], "give a model")):
        out = cli(*args, env=env, timeout=120)
        assert out.returncode == 2, (args, out.stdout, out.stderr[-2000:])
        assert "Traceback" not in out.stderr
        errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and needle in errors[0], (args, out.stderr)
