"""MLflow's system metrics of a training run: CPU, memory, disk, network and GPU use."""

from __future__ import annotations

import contextlib
import logging

from tasks.settings import settings
from tasks.tracking.store import tracking_uri

log = logging.getLogger(__name__)


@contextlib.contextmanager
def system_metrics(run_id: str | None, storage_root: str):
    """CPU, memory, disk, network and (where nvidia-ml-py finds a GPU) GPU use, as MLflow's
    `system/*` metrics of the run, while the block runs.

    MLflow's monitor samples in a thread of its own every MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL
    seconds (10 unless set), off the training loop's path. A training shorter than one interval
    still gets one sample, taken at its end. MLLM_SYSTEM_METRICS=0 turns it off."""
    if not run_id or not settings().system_metrics:
        yield
        return
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    quiet = logging.getLogger("mlflow.system_metrics")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # its start and stop lines would interleave with the progress bar
    try:
        monitor = SystemMetricsMonitor(run_id, resume_logging=True, tracking_uri=tracking_uri(storage_root))
        first = monitor._logging_step
        monitor.start()
    except Exception as e:  # noqa: BLE001 (a measurement must never stop a training)
        log.warning("no system metrics for run %s: %s", run_id, e)
        quiet.setLevel(level)
        yield
        return
    try:
        yield
    finally:
        monitor.finish()
        if monitor._logging_step == first:
            with contextlib.suppress(Exception):
                monitor.collect_metrics()
                monitor.publish_metrics(monitor.aggregate_metrics())
                monitor.mlflow_logger.flush()
        quiet.setLevel(level)
