"""What a run is, beyond its config: the git state of the code, the package versions, the device,
and the Prefect flow run that started it. Recorded as MLflow tags, compared by `reproduce`.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import mllm
from mllm.config import RunConfig
from mllm.runtime.devices import resolve_device
from tasks.settings import settings

# The packages whose versions a run records (tags `version.<name>`) and `reproduce` compares.
PACKAGES = ("torch", "numpy", "pyarrow", "tokenizers", "prefect", "mlflow")


def _git(path: str, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", path, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def git_info(path: str = ".") -> dict[str, Any]:
    """commit, branch, dirty and the diff against HEAD (with untracked files listed) when
    dirty; None values outside a git checkout. Remote URL too, for finding the commit."""
    info: dict[str, Any] = {"commit": None, "branch": None, "dirty": None, "diff": None, "remote": None}
    commit = _git(path, "rev-parse", "--verify", "HEAD")
    if commit is None:
        return info
    info["commit"] = commit.strip()
    branch = (_git(path, "rev-parse", "--abbrev-ref", "HEAD") or "").strip()
    info["branch"] = branch if branch and branch != "HEAD" else None  # HEAD: detached
    remote = (_git(path, "config", "--get", "remote.origin.url") or "").strip()
    info["remote"] = remote or None
    status = _git(path, "status", "--porcelain") or ""
    info["dirty"] = bool(status.strip())
    if info["dirty"]:
        diff = _git(path, "diff", "HEAD") or ""
        untracked = [line[3:] for line in status.splitlines() if line.startswith("??")]
        if untracked:
            diff += "".join(f"# untracked: {name}\n" for name in untracked)
        info["diff"] = diff
    return info


def code_git_info() -> dict[str, Any]:
    """The git state of the code that runs: the working folder's checkout, else the checkout this
    code was installed from (a worker starts a flow run in a temporary folder), else the commit an
    image was built from (`MLLM_GIT_COMMIT`, set by infra/Dockerfile's build argument)."""
    info = git_info(".")
    if info["commit"] is None:
        info = git_info(str(Path(__file__).resolve().parents[1]))
    given = settings().git_commit
    if info["commit"] is None and given not in (None, "unknown"):
        info.update(commit=given, dirty=False)
    return info


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions() -> dict[str, str]:
    """`version.<package>` tags: Python, mllm and PACKAGES."""
    return {
        "version.python": sys.version.split()[0],
        "version.mllm": mllm.__version__,
        **{f"version.{dist}": version(dist) for dist in PACKAGES},
    }


def version_changes(tags: dict[str, str]) -> dict[str, tuple[str, str]]:
    """{package: (recorded, running)} for each package whose version a run recorded (its
    `version.*` tags) and which differs from the one running now."""
    now = versions()
    return {
        k[len("version.") :]: (v, now[k])
        for k, v in sorted(tags.items())
        if k.startswith("version.") and k in now and now[k] != v
    }


def describe_device(requested: str) -> str:
    device = resolve_device(requested)
    if device.type == "cuda":
        import torch

        return f"cuda ({torch.cuda.get_device_name(device)})"
    return str(device)


def _prefect_flow_run() -> tuple[str | None, str | None]:
    # Importing prefect costs a second and creates its home folder: only ask when a flow run
    # can exist, i.e. prefect is already loaded or a worker started this process for one.
    if "prefect" not in sys.modules and not settings().flow_run_id:
        return None, None
    from prefect.runtime import flow_run
    from prefect.settings import PREFECT_UI_URL

    run_id = flow_run.id
    if run_id is None:
        return None, None
    return run_id, (flow_run.ui_url if PREFECT_UI_URL.value() else None)


PROCESS_TAG = "process"


def process_tag(pid: int | None = None) -> str:
    """A process as `host:pid:start` (its start in clock ticks since boot), which tells it from a
    later process given the same PID: whoever reads a RUNNING run can ask whether it still runs."""
    pid = pid or os.getpid()
    return f"{os.uname().nodename}:{pid}:{_started(pid)}"


def _started(pid: int) -> str:
    try:
        # Field 22 of /proc/PID/stat, counted after the command's closing parenthesis (a
        # command may hold spaces and parentheses of its own).
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return ""


def process_gone(tag: str | None) -> bool:
    """Whether the process a PROCESS_TAG names has ended: False when it runs, or runs on another
    machine, or the tag says too little to tell."""
    host, _, rest = (tag or "").partition(":")
    pid, _, start = rest.partition(":")
    if host != os.uname().nodename or not pid.isdigit() or not start:
        return False
    return _started(int(pid)) != start


def run_tags(cfg: RunConfig, storage_root: str, git: dict[str, Any]) -> dict[str, str]:
    tags = {
        "storage.root": storage_root,
        "device": describe_device(cfg.train.device),
        **versions(),
        PROCESS_TAG: process_tag(),
    }
    if cfg.paths is not None:
        tags.update({f"storage.{k}": v for k, v in cfg.paths.model_dump().items() if v})
    if git["commit"]:
        tags.update(
            {
                "git.commit": git["commit"],
                "git.dirty": str(git["dirty"]).lower(),
                "mlflow.source.git.commit": git["commit"],
            }
        )
        if git["branch"]:
            tags["git.branch"] = tags["mlflow.source.git.branch"] = git["branch"]
        if git["remote"]:
            tags["mlflow.source.git.repoURL"] = git["remote"]
    flow_run_id, flow_run_url = _prefect_flow_run()
    if flow_run_id:
        tags["prefect.flow_run_id"] = flow_run_id
        if flow_run_url:
            tags["prefect.flow_run_url"] = flow_run_url
    return tags
