"""The training stage as a Prefect task: it trains into `runs/<key>/`, resuming from its last
checkpoint when the same training runs again."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import psutil
from prefect import get_run_logger, task

import mllm.train
import tasks
from mllm import UserError, layout, storage
from mllm.config import RunConfig, TrainPaths
from mllm.runtime import speed
from mllm.runtime.checkpoint import Signals
from tasks import assets, trials
from tasks.caching import forget_exception, retry_io_only
from tasks.model import Prepared, Trained
from tasks.settings import settings
from tasks.tracking import outage
from tasks.tracking.provenance import code_git_info
from tasks.tracking.system import system_metrics
from tasks.tracking.tracker import RunTracker


def train_key(cfg: RunConfig, data: Prepared) -> str:
    return layout.train_key(data.splits.key, data.vocab.digest, cfg, training_code()["digest"], speed.cpu_env())


def lineage_tags(cfg: RunConfig, data: Prepared) -> dict[str, str]:
    """What the training key digests and where each data stage lives, as run tags: `lineage`
    follows them from a model back to the corpus and checks each against storage."""
    return {
        "train.key": train_key(cfg, data),
        "train.config_digest": layout.config_digest(cfg),
        "train.code_digest": training_code()["digest"],
        "data.splits_key": data.splits.key,
        "data.vocab": data.vocab.url,
        "data.vocab_key": data.vocab.key,
        "data.tokens": data.tokens.url,
        "data.tokens_key": data.tokens.key,
        "data.raw_url": data.raw_url,
        "data.raw_bytes": str(data.raw_bytes),
        "data.raw_files": str(data.raw_files),
        **({"data.tokens_corpus": data.tokens.corpus} if data.tokens.corpus else {}),
        **({"train.cpu_env": json.dumps(speed.cpu_env(), sort_keys=True)} if speed.cpu_env() else {}),
        "data.source": data.source,
    }


def training_code() -> dict[str, str]:
    """The training code this process runs: the digest that goes into every training key, and
    its commit. A worker compares the caller's with its own before it trains."""
    return {"digest": layout.package_digest(), "commit": code_git_info()["commit"] or "unknown"}


def check_training_code(caller: dict[str, str]) -> None:
    """Refuse to train with other code than the caller's: the training key, the folder the model
    goes to and what the caller reads back would all differ."""
    ours = training_code()
    if caller["digest"] != ours["digest"]:
        raise UserError(
            f"the worker runs other training code than the pipeline that sent the job: pipeline "
            f"at commit {caller['commit']}, worker at commit {ours['commit']} (code digests "
            f"{caller['digest']} and {ours['digest']}): deploy the pipeline's commit to the worker "
            "(rebuild its image or update its checkout), or run the pipeline from the worker's commit"
        )


# A training job's progress line in a worker's log; `parse_progress` reads it back where the
# pipeline follows a job on a work pool, to drive its progress bar.
_PROGRESS = re.compile(r"^step (\d+)/(\d+|\?) loss ([0-9.naN]+)")


def progress_line(p: dict[str, Any]) -> str:
    loss = p.get("train_loss")
    return (
        f"step {p['step']}/{p['total_steps'] or '?'} loss {float('nan') if loss is None else loss:.4f} "
        f"lr {p.get('lr', 0.0):.2e} {p.get('tokens_per_s', 0.0):.0f} tok/s"
    )


def parse_progress(line: str) -> dict[str, Any] | None:
    m = _PROGRESS.match(line)
    if m is None:
        return None
    loss = float(m.group(3))
    return {
        "step": int(m.group(1)),
        "total_steps": None if m.group(2) == "?" else int(m.group(2)),
        "train_loss": None if loss != loss else loss,
    }


def train_job(cfg: RunConfig, data: Prepared, root: str) -> tuple[RunConfig, str]:
    """The config a training job runs: the run's tree with its input and output paths."""
    run_dir = layout.folder(root, layout.RUNS, train_key(cfg, data))
    src = data.source_side
    # Vocabulary sizes stay 0 in the job's model section: training takes them from the files.
    paths = TrainPaths(
        train_ids=data.splits.train.ids,
        val_ids=data.splits.val.ids,
        train_offsets=data.splits.train.offsets,
        val_offsets=data.splits.val.offsets,
        vocab=data.vocab.url,
        tokenizer=data.tokens.tokenizer,
        src_vocab=src.vocab.url if src else None,
        src_tokenizer=src.tokenizer if src else None,
        checkpoint_dir=storage.join(run_dir, "checkpoints"),
    )
    job = cfg.model_copy(update={"paths": paths}, deep=True)  # never change the caller's config
    return job, run_dir


def retry_delay_s() -> float:
    """Seconds before the training stage runs again after a storage failure, resuming from its
    last checkpoint: MLLM_TRAIN_RETRY_DELAY_S, 5 by default (docs/object-storage.md)."""
    return settings().train_retry_delay_s


# The delay is given where the task is called (flows/training.py): retry_delay_s().
@task(name="train", on_failure=[forget_exception], retries=2, retry_delay_seconds=5, retry_condition_fn=retry_io_only)
def train(cfg: RunConfig, data: Prepared, root: str, run_id: str | None = None, search: bool = False) -> Trained:
    """Train (or resume) the run's model; metrics go to the MLflow run `run_id` in batches. A
    trial of a search that runs elsewhere (`search`) asks its pruner through storage.

    A storage failure is retried (training resumes from its last checkpoint). The result is
    also written to `<run_dir>/trained.json`, where a pipeline that dispatched this training to
    a work pool reads it.
    """
    logger = get_run_logger()
    on_metrics = RunTracker.attach(run_id, cfg, root).metrics_after_resume() if run_id else None
    job, run_dir = train_job(cfg, data, root)
    reads = data_assets(data)
    assets.materializes(storage.join(job.paths.checkpoint_dir, "last.pt"), reads=reads, name="checkpoint (last)")
    config_url = storage.join(run_dir, "config.yaml")
    storage.write_text(config_url, job.to_yaml())
    logger.info("training %s %s: %s", cfg.recipe, cfg.model.arch, run_dir)
    every = settings().log_every_s
    last_log = [0.0]

    def on_progress(p: dict[str, Any]) -> None:
        if tasks.progress_hook is not None and p.get("budget_s"):  # a time budget's bar: seconds of it
            tasks.report_progress("train", min(p["elapsed_s"], p["budget_s"]), p["budget_s"], **p)
        elif tasks.progress_hook is not None:
            tasks.report_progress("train", p["step"], p["total_steps"], **p)
        elif time.monotonic() - last_log[0] > every:  # a line every few seconds in a worker's log
            last_log[0] = time.monotonic()
            logger.info(progress_line(p))

    try:
        with storage.room_on(root):
            result = _train(
                job,
                run_dir,
                run_id,
                root,
                on_metrics,
                on_progress,
                logger,
                trials.hook_for(train_key(cfg, data)) or (trials.through_storage(run_dir) if search else None),
            )
        if result.busy:
            logger.info(result.busy_line(), extra=tasks.NOTICE)
    except BaseException:
        # Nothing written (a full disk at the first checkpoint, a crash before it): no empty
        # checkpoints folder is left to look like a training.
        storage.remove_empty(job.paths.checkpoint_dir)
        raise
    logger.info(
        "trained %d steps (%s): val loss %s",
        result.steps,
        result.stop_reason,
        f"{result.val_loss:.4f}" if result.val_loss is not None else "n/a",
    )
    trained = Trained(key=train_key(cfg, data), run_dir=run_dir, config=config_url, **dataclasses.asdict(result))
    assets.describe(
        trained.checkpoint,
        key=trained.key,
        steps=trained.steps,
        train_loss=trained.train_loss,
        val_loss=trained.val_loss,
        stop_reason=trained.stop_reason,
    )
    if trained.best_checkpoint:
        assets.materializes(trained.best_checkpoint, reads=reads, name="checkpoint (best)")
        assets.describe(trained.best_checkpoint, key=trained.key, best_val_loss=trained.best_val_loss)
    storage.write_json(storage.join(run_dir, "trained.json"), trained.model_dump(mode="json"))
    return trained


def _train(
    job: RunConfig,
    run_dir: str,
    run_id: str | None,
    root: str,
    on_metrics: Any,
    on_progress: Any,
    logger: Any,
    on_eval: Any = None,
) -> mllm.train.TrainResult:
    # Two pipelines training the same thing at once: the second waits, then resumes from (or
    # returns at once with) what the first wrote, instead of both writing the same checkpoints.
    # A tracking server that goes away does not stop the training (tasks/tracking/outage.py).
    waiting = "another training of %s is running: waiting for it"
    with (
        storage.exclusive(run_dir, lambda: logger.info(waiting, run_dir, extra=tasks.NOTICE)),
        outage.fail_fast(),
        system_metrics(run_id, root),
    ):
        if job.train.nproc_per_node > 1:
            result = _torchrun(job, on_metrics, on_progress)
        else:
            result = _in_process(job, on_metrics, on_progress, on_eval, logger)
        if on_metrics is not None:
            on_metrics.flush()
    return result


def _in_process(job: RunConfig, on_metrics: Any, on_progress: Any, on_eval: Any, logger: Any) -> mllm.train.TrainResult:
    """Train in this process. The `train` flow run of a deployment (`--train-on POOL`: a worker
    started it) trains in a thread of its own, so that the main thread keeps Prefect's SIGTERM
    handler: the worker's runner asks on its control channel before it signals a cancel, and
    only that handler answers (with mllm's in its place the run ends Crashed, not Cancelled).
    The signal then stops the training as mllm's handler would: last.pt of the last finished
    step, then the signal's exception goes on."""
    from prefect.context import FlowRunContext

    def run(signals: Signals | None = None) -> mllm.train.TrainResult:
        return mllm.train.train(
            job,
            on_metrics=on_metrics,
            on_progress=on_progress,
            on_eval=on_eval,
            on_notice=lambda line: logger.info(line, extra=tasks.NOTICE),
            signals=signals,
        )

    context = FlowRunContext.get()  # a run of a deployment (not prefect.runtime: an API call, outages)
    if context is None or context.flow_run is None or context.flow_run.deployment_id is None:
        return run()
    signals = Signals(install=False)

    def stop() -> None:
        signals.stop()
        # What a signal to the whole process group does: a step that compiles (the C++ compiler,
        # inductor's workers) fails at once, and the training writes the last finished step.
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.terminate()

    return _beside_the_main_thread(lambda: run(signals), stop)


def _beside_the_main_thread(fn: Any, stop: Any, wait_s: float = 25.0) -> Any:
    """fn() in a thread (with this context: Prefect's run context, for its logger); an exception
    a signal raises in the main thread meanwhile calls stop() and waits up to `wait_s` for fn to
    end, through any further signal (a worker's runner kills a cancelled run 30 s after its
    SIGTERM), before it goes on. The main thread polls an event rather than join(): Python 3.11's
    join, interrupted by a signal's exception, marks a thread that still runs as stopped."""
    box: dict[str, Any] = {}
    done = threading.Event()
    context = contextvars.copy_context()

    def target() -> None:
        try:
            box["result"] = context.run(fn)
        except BaseException as e:  # noqa: BLE001 (handed to the main thread, which raises it)
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=target, name="mllm-training", daemon=True).start()
    try:
        while not done.is_set():
            time.sleep(0.1)  # a signal's handler runs between the sleeps
    except BaseException as signalled:
        stop()
        deadline = time.monotonic() + wait_s
        while not done.is_set() and time.monotonic() < deadline:
            try:
                time.sleep(0.1)
            except BaseException:  # noqa: BLE001 (a second signal: the runner's kill follows its cancel)
                pass
        raise signalled
    if "error" in box:
        raise box["error"]
    return box["result"]


def data_assets(data: Prepared) -> list[str]:
    """What training reads, as the data stages named their assets: the split, the vocabulary, the
    token chunks (their folder holds the tokenizer) and, for parallel text, the source side's
    vocabulary."""
    return [data.splits.url, data.vocab.url, data.tokens.url, data.source_side.vocab.url if data.source_side else None]


def _torchrun(job: RunConfig, on_metrics: Any, on_progress: Any) -> mllm.train.TrainResult:
    """Run `python -m mllm.train` under torchrun with `nproc_per_node` processes (DDP) and
    follow it through its event file: metrics to MLflow, progress to the log."""
    n = job.train.nproc_per_node
    logger = get_run_logger()
    with tempfile.TemporaryDirectory(prefix="mllm-torchrun-") as tmp:
        config, events, out = (os.path.join(tmp, name) for name in ("config.yaml", "events.jsonl", "out.log"))
        with open(config, "w") as f:
            f.write(job.to_yaml())
        open(events, "w").close()
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={n}",
            "-m",
            "mllm.train",
            "--config",
            config,
            "--events",
            events,
        ]
        logger.info("starting %d training processes: torchrun --nproc_per_node=%d -m mllm.train", n, n)
        result: dict[str, Any] | None = None
        with open(out, "wb") as log, open(events, encoding="utf-8") as ev:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            try:
                pending = ""
                while True:
                    done = proc.poll() is not None
                    pending += ev.read()
                    *lines, pending = pending.split("\n")
                    for line in lines:
                        event = json.loads(line)
                        if "metrics" in event and on_metrics:
                            on_metrics(event["metrics"])
                        elif "progress" in event:
                            on_progress(event["progress"])
                        elif "result" in event:
                            result = event["result"]
                    if done:
                        break
                    time.sleep(0.5)
            finally:
                if proc.poll() is None:  # this task was cancelled or failed: stop the ranks
                    proc.terminate()
                    proc.wait(30)
        if proc.returncode != 0 or result is None:
            tail = open(out, errors="replace").read().strip().splitlines()
            errors = [line[len("error: ") :] for line in tail if line.startswith("error: ")]
            if errors:
                raise UserError(errors[-1])
            raise RuntimeError(f"torchrun exited with status {proc.returncode}:\n" + "\n".join(tail[-20:]))
    return mllm.train.TrainResult(**result)
