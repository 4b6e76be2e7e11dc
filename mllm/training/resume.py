"""Resume: a training whose checkpoint_dir holds a last.pt goes on from it, to the weights it would have reached."""

from __future__ import annotations

from mllm import UserError, storage
from mllm.runtime.checkpoint import check_model, check_vocab, read_checkpoint
from mllm.runtime.distributed import gather, set_rng_state
from mllm.training.setup import Training
from mllm.training.state import LoopState


def resume(tr: Training, st: LoopState, wanted: bool = True) -> None:
    """Model, optimizer, schedule, step, metrics and RNG states from last.pt, if there is one and
    a resume is `wanted` (else a fresh start overwrites it)."""
    url, t = tr.last_url, tr.cfg.train
    if wanted and storage.exists(url):
        state = read_checkpoint(url, "cpu")
        check_vocab(state, tr.vocab, url)
        check_model(state["config"], tr.cfg, url)
        saved_optimizer = state["config"].get("train", {}).get("optimizer", "adamw")
        if (saved_optimizer == "muon") != (t.optimizer == "muon"):
            raise UserError(
                f"checkpoint {url} was trained with train.optimizer {saved_optimizer}, this config "
                f"{t.optimizer}: its optimizer state does not carry over; use another checkpoint_dir "
                "or --no-resume"
            )
        tr.raw.load_state_dict(state["model"])
        tr.optimizer.load_state_dict(state["optimizer"])
        tr.scheduler.load_state_dict(state["scheduler"])
        st.step = int(state["step"])
        st.metrics = {k: float(v) for k, v in state.get("metrics", {}).items()}
        # Last: building the model and optimizer drew from the RNG.
        set_rng_state(state.get("rng", {}), tr.batches, state.get("data_state", {}), tr.device, tr.d)
        del state
        minutes = st.metrics.get("elapsed_s", 0.0) / 60
        tr.hooks.notice(
            f"resumed from {url}: step {st.step} of {tr.limits.total_steps or '?'}"
            + (f" ({minutes:.1f} of {t.max_minutes:g} minutes trained)" if tr.limits.budget_s else "")
        )
    st.resumed()  # fresh or resumed: the counters that go on from earlier runs
    if len(set(gather(st.step, tr.d))) > 1:
        raise UserError(
            f"the ranks found different checkpoints in {tr.cfg.paths.checkpoint_dir}: "
            "it must be storage that every rank reads (a shared folder or object storage)"
        )
