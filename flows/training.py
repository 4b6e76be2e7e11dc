"""The training stage as a flow of its own, and the one step that runs it where it belongs: in
this process, or on a worker of a Prefect work pool (`flows/dispatch.py`)."""

from __future__ import annotations

from prefect import flow, get_run_logger

from flows import dispatch, gpus
from flows.launch import with_results
from flows.settings import process_defaults
from mllm.config import RunConfig
from tasks.model import Prepared, Trained
from tasks.model import train as training_stage


def _run_name() -> str:
    """Named after the recipe, as the pipeline's flow runs are (not Prefect's random names)."""
    import time

    from prefect.runtime import flow_run

    cfg = flow_run.parameters.get("cfg")
    return f"{getattr(cfg, 'recipe', None) or 'train'}-{time.strftime('%Y%m%d-%H%M%S')}-train"


@flow(name="train", flow_run_name=_run_name)
def train(
    cfg: RunConfig,
    data: Prepared,
    root: str,
    run_id: str | None = None,
    code: dict[str, str] | None = None,
    search: bool = False,
) -> Trained:
    """Train (or resume) a model on prepared data, writing checkpoints under the storage root.

    Started by the pipeline, here or on a work pool's worker; its parameters come from there.

    Args:
        cfg: The run's whole resolved configuration (data, model, train, sample).
        data: What the data stages handed on: token ids of each split, the vocabulary.
        root: The storage root URL where inputs are read and checkpoints written.
        run_id: The MLflow run that receives the training metrics.
        code: The caller's training code (digest and commit): a worker with other code refuses the job.
        search: A search's trial: at each evaluation, ask the search's pruner through storage.
    """
    process_defaults()  # a worker imports the flows without the CLI
    if code is not None:
        training_stage.check_training_code(code)
    # On a worker with several GPUs: GPUs of its own, one a rank, beside the worker's other trainings.
    with gpus.own_devices(cfg.train.nproc_per_node, cfg.train.device, get_run_logger()):
        stage = training_stage.train.with_options(retry_delay_seconds=training_stage.retry_delay_s())
        return stage(cfg, data, root, run_id, search)


def run_training(
    cfg: RunConfig, data: Prepared, root: str, run_id: str | None, pool: str | None, search: bool = False
) -> Trained:
    """Train here, or hand the `train` flow to a worker of `pool` and follow it (`search`: the
    worker's training asks a search's pruner, tasks/trials.py)."""
    if pool:
        return dispatch.train_on_pool(train, cfg, data, root, run_id, pool, search)
    return with_results(train, root)(cfg, data, root, run_id)
