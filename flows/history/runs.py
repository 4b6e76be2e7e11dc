"""Finding runs in MLflow, loading their models, and reproducing a run from its git commit."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from mllm import UserError, layout
from mllm.resolve import flat_fields
from mllm.settings import environment
from tasks.tracking import store as tracking
from tasks.tracking.provenance import PROCESS_TAG, process_gone, version_changes
from tasks.tracking.served_model import DROP
from tasks.tracking.store import tracking_uri

# The metrics a reproduction is compared on, in the order they are printed.
COMPARED = ("final_val_loss", "final_val_bits_per_token", "final_val_bits_per_byte", "train_loss")


def client(root: str) -> MlflowClient:
    return tracking.client(root)


def list_runs(root: str, limit: int = 20, recipe: str | None = None) -> list[dict[str, Any]]:
    c = client(root)
    experiments = c.search_experiments()
    if recipe:
        experiments = [e for e in experiments if e.name == recipe]
    if not experiments:
        return []
    runs = c.search_runs(
        [e.experiment_id for e in experiments], order_by=["attributes.start_time DESC"], max_results=limit
    )
    names = {e.experiment_id: e.name for e in experiments}
    return [
        {
            "run_id": r.info.run_id,
            "recipe": names.get(r.info.experiment_id, "?"),
            "commit": (r.data.tags.get("git.commit") or "")[:10]
            + ("+dirty" if r.data.tags.get("git.dirty") == "true" else ""),
            "val_loss": r.data.metrics.get("final_val_loss", r.data.metrics.get("val_loss")),
            "mfu": r.data.metrics.get("final_mfu", r.data.metrics.get("mfu")),
            "dtype": r.data.params.get("train.dtype_used"),
            # A run whose process died without a word (kill -9, a machine that went down) is RUNNING
            # in MLflow for ever: it is shown as what it is.
            "status": "KILLED"
            if r.info.status == "RUNNING" and process_gone(r.data.tags.get(PROCESS_TAG))
            else r.info.status,
            "started": time.strftime("%Y-%m-%d %H:%M", time.localtime(r.info.start_time / 1000)),
            "reproduces": r.data.tags.get("reproduces"),
            "decision": r.data.tags.get("decision"),
            "decision_reason": r.data.tags.get("decision.reason"),
            "model_id": r.data.tags.get("model_id"),  # the best checkpoint's LoggedModel
            "last_model_id": r.data.tags.get("model_id.last"),
        }
        for r in runs
    ]


def get_run(root: str, run_id: str):
    try:
        return client(root).get_run(run_id)
    except MlflowException:
        raise UserError(f"no MLflow run {run_id} in {tracking_uri(root)}: see `mllm-pipeline runs`") from None


def model_uri(root: str, run_id: str | None = None, model: str | None = None) -> str:
    """The pyfunc model of a run, or of a registered model (`NAME@alias` or `NAME/version`)."""
    if model:
        return model if model.startswith("models:/") else f"models:/{model}"
    run = get_run(root, run_id)
    uri = run.data.tags.get("model_uri")
    if not uri:
        raise UserError(f"run {run_id} logged no model (it failed or is still running): pick a finished run")
    return uri


def served(root: str, uri: str, device: str | None = None) -> Any:
    """The registered model at `uri`, loaded as MLflow serves it (on a GPU when there is one),
    moved to `device` when one is named. MLflow's copy of the model's files, which it would leave
    in the temporary folder, goes when this process ends (its code stays importable until then)."""
    import mlflow.pyfunc

    tracking_uri(root)
    copy = tempfile.mkdtemp(prefix="mllm-served-")
    atexit.register(shutil.rmtree, copy, ignore_errors=True)
    try:
        model = mlflow.pyfunc.load_model(uri, dst_path=copy)
    except MlflowException as e:
        raise UserError(f"cannot load model {uri}: {str(e).splitlines()[0]}") from None
    loaded = getattr(model.unwrap_python_model(), "loaded", None)
    if device is not None and loaded is not None:
        from mllm.runtime.devices import resolve_device

        loaded.model.to(resolve_device(device))
    return model


def generate(model: Any, prompts: list[str] | None, options: dict[str, Any]) -> list[str]:
    """The served model's answers to `prompts` (None: the run's own prompts), with the options
    its signature takes."""
    schema = model.metadata.get_params_schema()
    names = {p.name for p in schema.params} if schema is not None else set()
    params = {k: v for k, v in options.items() if v is not None and k in names}
    loaded = getattr(model.unwrap_python_model(), "loaded", None)
    if prompts is None:
        prompts = list(loaded.config.sample.prompts) if loaded is not None else ["The "]
    if loaded is not None:  # the terminal has room for a warning: say it, and sample from what is left
        from mllm.sample import prompt_losses

        for line in prompt_losses(loaded, prompts):
            print(f"warning: {line}", file=sys.stderr)
    if DROP in names:
        params[DROP] = True
    try:
        return list(model.predict(prompts, params=params or None))
    except MlflowException as e:  # the served model's refusal of a parameter, as a server would answer it
        if e.error_code != "INVALID_PARAMETER_VALUE":
            raise
        raise UserError(e.message) from None


# --- reproduce ----------------------------------------------------------------------------


def reproduce(root: str, run_id: str, repo: str | None = None) -> dict[str, Any]:
    """Re-run `run_id` at its recorded commit, with its recorded config and data digest.

    The commit is checked out in a temporary git worktree and the pipeline runs there (its
    code, this interpreter) into a fresh storage folder, so nothing from the original run is
    reused: the data is downloaded and tokenized again and the model trained from scratch. The
    new MLflow run carries the tag `reproduces=<run_id>`.
    """
    run = get_run(root, run_id)
    tags = run.data.tags
    commit = tags.get("git.commit")
    if not commit:
        raise UserError(f"run {run_id} recorded no git commit (it was not started from a git checkout)")
    changed = _warn_of_differences(run_id, tags)
    repo = repo or _repo_root()
    if subprocess.run(["git", "-C", repo, "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True).returncode:
        raise UserError(
            f"commit {commit[:12]} of run {run_id} is not in {repo}: fetch it (git fetch) "
            "or run reproduce from a clone that has it"
        )
    recipe, overrides, baseline = _reproduction_config(root, run)
    storage = _reproduction_storage(root, run_id)
    old_code = _run_at_commit(repo, commit, root, run_id, ["--recipe", recipe, "--storage", storage], overrides)
    new = _latest_reproduction(root, run_id)
    if old_code:  # what it says about a registration happened in the throwaway registry
        c = client(root)
        for tag in ("model_version", "champion.decision"):
            if tag in new.data.tags:
                c.delete_tag(new.info.run_id, tag)
        c.set_tag(new.info.run_id, "decision", "reproduction")
        c.set_tag(new.info.run_id, "decision.reason", f"reproduces run {run_id}: registered nothing, no alias moved")
    return {
        "original": run_id,
        "reproduction": new.info.run_id,
        "commit": commit,
        "storage": storage,
        "versions": changed,
        "compared_with": baseline.info.run_id,
        "metrics": {m: (baseline.data.metrics.get(m), new.data.metrics.get(m)) for m in COMPARED},
    }


def _warn_of_differences(run_id: str, tags: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Warn of what the reproduction cannot repeat (uncommitted changes, other package versions);
    the versions that differ, by package."""
    if tags.get("git.dirty") == "true":
        print(
            f"warning: run {run_id} was made with uncommitted changes (see its git.diff artifact); "
            "reproducing the commit without them",
            file=sys.stderr,
        )
    changed = version_changes(tags)
    if changed:
        print(
            f"warning: run {run_id} was made with other package versions than these (recorded -> "
            f"running): {', '.join(f'{p} {a} -> {b}' for p, (a, b) in changed.items())}; its metrics may "
            "differ for that reason alone",
            file=sys.stderr,
        )
    return changed


def _reproduction_config(root: str, run: Any) -> tuple[str, list[str], Any]:
    """(recipe, --set overrides, the run that trained): the recorded config again, on the recorded
    data, in the precision and compile choice that training made."""
    run_id, tags = run.info.run_id, run.data.tags
    cfg = _recorded_config(root, run_id)
    recorded_source(cfg, tags, run_id)
    sha = tags.get("data.raw_sha256")
    if sha:
        cfg.setdefault("data", {})["sha256"] = sha  # a changed source is an error, not a new result
    # A run that skipped its training records no precision or compile choice: the training it
    # reused does.
    baseline = _trained_by(root, run)
    if used := baseline.data.params.get("train.dtype_used"):
        # The precision the run trained in, not what a probe picks today: `auto` may decide
        # otherwise on another machine or load, and bf16 rounds differently from float32.
        cfg.setdefault("train", {})["dtype"] = used
    if baseline.data.params.get("train.compile_used") == "False":
        # Eager as it ran: `auto` might compile today, and compiled steps round differently. (A
        # run that `auto` compiled is left to decide again: it compiled after timing its first steps.)
        cfg.setdefault("train", {})["compile"] = False
    recipe = cfg.pop("recipe", None) or run.data.params.get("recipe", "default")
    # JSON values: YAML reads them back exactly (a quoted prompt keeps its trailing space).
    return recipe, [f"{k}={json.dumps(v)}" for k, v in flat_fields(cfg).items()], baseline


def _run_at_commit(repo: str, commit: str, root: str, run_id: str, options: list[str], overrides: list[str]) -> bool:
    """`mllm-pipeline run` with `options` and `overrides` in a temporary worktree of `commit`,
    tracked as a reproduction of `run_id`; whether that code predates `--reproduces` (and
    registered its model in a throwaway registry)."""
    out = Path(tempfile.mkdtemp(prefix=f"mllm-reproduce-{run_id[:8]}-"))
    worktree = out / "src"
    subprocess.run(
        ["git", "-C", repo, "worktree", "add", "--detach", str(worktree), commit], check=True, capture_output=True
    )
    try:
        # Code from before `--reproduces` registers its model and judges it against the champion:
        # it gets a registry of its own, thrown away after, so the real one is never touched.
        env = dict(
            environment(),
            PYTHONPATH=str(worktree),
            MLFLOW_TRACKING_URI=tracking_uri(root),
            MLFLOW_REGISTRY_URI=f"sqlite:///{out / 'throwaway-registry.db'}",
        )
        cmd = [sys.executable, "-m", "flows.cli", "run", *options]
        for o in overrides:
            cmd += ["--set", o]
        # The CLI's options: in flows/cli/ before the layout of November 2026, flows/cli/app.py since.
        cli = "".join(
            p.read_text() for p in (worktree / "flows" / "cli.py", worktree / "flows" / "cli" / "app.py") if p.exists()
        )
        old_code = '"--reproduces"' not in cli
        if not old_code:
            cmd += ["--reproduces", run_id]
        else:
            cmd += ["--tag", f"reproduces={run_id}"]
            # Since `--force` exists, a run on unchanged data and code skips training: not here.
            if '"--force"' in cli:
                cmd.append("--force")
        proc = subprocess.run(cmd, cwd=worktree, env=env)
        if proc.returncode:
            raise UserError(
                f"the reproduction of {run_id} at {commit[:12]} failed (exit {proc.returncode}): see its output above"
            )
    finally:
        subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", str(worktree)], capture_output=True)
        shutil.rmtree(out, ignore_errors=True)
    return old_code


def recorded_source(cfg: dict[str, Any], tags: dict[str, str], run_id: str) -> None:
    """Make the recorded config's source findable from the reproduction's own folder. Runs made
    before sources were recorded absolute kept a relative path as typed: a single file's
    absolute path is in the run's `data.source` tag (its sha256 in `data.raw_sha256` pins it)."""
    data = cfg.get("data") or {}
    source = data.get("source")
    named = [source] if isinstance(source, str) else list(source or [])
    if not any(s and "://" not in s and not os.path.isabs(s) for s in named):
        return
    where = tags.get("data.source", "")
    if isinstance(source, str) and os.path.isabs(where):
        data["source"] = where
        return
    raise UserError(
        f"run {run_id} recorded its source only as a path relative to the folder it ran in "
        f"({', '.join(named)}), which a reproduction cannot find: run its recipe again with --source "
        f"ABSOLUTE-PATH --set data.sha256={tags.get('data.raw_sha256', 'SHA256')} (the digest pins the data)"
    )


def _trained_by(root: str, run: Any) -> Any:
    """The run whose training `run` stands for: itself, or for a run that skipped training the
    earliest finished run that trained the same training key (what it reused)."""
    tags = run.data.tags
    key = tags.get("train.key")
    if tags.get("decision") != "skipped" or not key:
        return run
    found = client(root).search_runs(
        [run.info.experiment_id],
        filter_string=f"tags.`train.key` = '{key}' and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time ASC"],
    )
    trained = [r for r in found if "final_val_loss" in r.data.metrics and "reproduces" not in r.data.tags]
    return trained[0] if trained else run


def _repo_root() -> str:
    here = Path(__file__).resolve().parents[1]
    out = subprocess.run(["git", "-C", str(here), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if out.returncode:
        raise UserError(f"{here} is not a git checkout: reproduce needs the project's git history")
    return out.stdout.strip()


def _recorded_config(root: str, run_id: str) -> dict[str, Any]:
    import mlflow.artifacts

    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="config.yaml", dst_path=tmp)
        except (MlflowException, OSError):
            raise UserError(f"run {run_id} has no config.yaml artifact: it was not made by this pipeline") from None
        return yaml.safe_load(Path(path).read_text())


def _reproduction_storage(root: str, run_id: str) -> str:

    return layout.folder(root, layout.REPRODUCTIONS, f"{run_id[:12]}-{time.strftime('%Y%m%d-%H%M%S')}")


def _latest_reproduction(root: str, run_id: str):
    runs = client(root).search_runs(
        [e.experiment_id for e in client(root).search_experiments()],
        filter_string=f"tags.reproduces = '{run_id}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    if not runs:
        raise UserError(f"the reproduction of {run_id} finished but logged no MLflow run")
    return runs[0]


def comparison_table(result: dict[str, Any]) -> str:
    lines = [f"{'metric':28} {'original':>14} {'reproduction':>14} {'difference':>12}"]
    for name, (a, b) in result["metrics"].items():
        if a is None and b is None:
            continue
        diff = abs(a - b) if a is not None and b is not None else None
        lines.append(f"{name:28} {_num(a):>14} {_num(b):>14} {_num(diff, '.2e'):>12}")
    return "\n".join(lines)


def _num(x: float | None, fmt: str = ".6f") -> str:
    return "-" if x is None else format(x, fmt)


def as_json(rows: Any) -> str:
    return json.dumps(rows, indent=2)
