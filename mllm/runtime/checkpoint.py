"""Checkpoints: the full training state in one torch.save file that loads with weights_only=True, and
`Signals`, which let an interrupt wait for the checkpoint of the step it arrived in."""

from __future__ import annotations

import contextlib
import ctypes
import io
import pickle
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import ValidationError

from mllm import UserError, storage
from mllm.config import RunConfig
from mllm.data.text import Tokenizer, tokenizer_from_json
from mllm.data.vocab import Vocab
from mllm.families.base import build_model
from mllm.runtime.devices import resolve_device
from mllm.runtime.distributed import Dist

REQUIRED = ("model", "step", "config", "vocab", "vocab_digest", "tokenizer")
# The layout of a checkpoint's dict: raised when a change means an older mllm would misread it.
# Absent (checkpoints written before it existed) reads as 0, which this version still reads.
FORMAT = 1


@dataclass
class Loaded:
    model: torch.nn.Module  # in eval mode, on the device asked for
    config: RunConfig
    vocab: Vocab
    tokenizer: Tokenizer
    step: int
    metrics: dict[str, float] = field(default_factory=dict)
    # Sequence to sequence: the source side's (vocab and tokenizer are the target side's).
    src_vocab: Vocab | None = None
    src_tokenizer: Tokenizer | None = None
    url: str = ""  # where it was read from


def save_checkpoint(url: str, state: dict[str, Any]) -> None:
    """Write `state` so that `url` holds either the previous checkpoint or this one, never half."""
    with storage.atomic_open(url, "wb") as f:
        torch.save({"format": FORMAT, **state}, f)


def read_checkpoint(url: str, device: str | torch.device = "cpu") -> dict[str, Any]:
    """The raw checkpoint dict, tensors mapped to `device`."""
    device = resolve_device(str(device))  # no such device: say so, not "corrupt checkpoint"
    storage.require(url, "checkpoint")
    fs, path = storage.filesystem(url)
    if fs.isdir(path):
        # A run folder holds its checkpoints one level down.
        folder = storage.join(url, "checkpoints") if fs.isdir(path.rstrip("/") + "/checkpoints") else url
        raise UserError(
            f"checkpoint {url} is a folder: give a checkpoint file in it, e.g. "
            f"{storage.join(folder, 'best.pt')} or {storage.join(folder, 'last.pt')}"
        )
    blob = storage.read_bytes(url)
    if not blob:
        raise UserError(f"checkpoint {url} is empty (0 bytes): give a run's checkpoints/best.pt or checkpoints/last.pt")
    if not blob.startswith(b"PK\x03\x04"):  # torch.save writes a zip archive
        what = "text" if _looks_like_text(blob[:4096]) else "not a zip archive"
        raise UserError(
            f"checkpoint {url} is not a checkpoint ({what}; torch.save writes a zip archive): give a "
            "run's checkpoints/best.pt or checkpoints/last.pt"
        )
    try:
        state = torch.load(io.BytesIO(blob), map_location=device, weights_only=True)
    except pickle.UnpicklingError:
        raise UserError(
            f"checkpoint {url} holds objects that a safe load refuses: it was not written by mllm"
        ) from None
    except Exception as e:  # noqa: BLE001 (a damaged archive fails in many ways inside torch)
        reason = (str(e).splitlines() or [type(e).__name__])[0].split(". ")[0]
        raise UserError(
            f"checkpoint {url} is truncated or corrupt ({type(e).__name__}: {reason}): train again or pick another "
            "checkpoint"
        ) from None
    if not isinstance(state, dict) or any(k not in state for k in REQUIRED):
        raise UserError(f"checkpoint {url} is not an mllm checkpoint (it lacks {', '.join(REQUIRED)})")
    written = state.get("format", 0)
    if not isinstance(written, int) or written > FORMAT:
        raise UserError(
            f"checkpoint {url} was written by a newer mllm (checkpoint format {written}; this one reads "
            f"formats up to {FORMAT}): upgrade mllm-pipeline to load it"
        )
    return state


def _field(config: Any, loc: tuple) -> str:
    """A validation error's location as the config's own keys (pydantic adds a union's tag, e.g.
    model.recurrent.n_layer, which no config file holds)."""
    names, here = [], config
    for part in loc:
        if isinstance(here, dict) and part in here:
            names.append(str(part))
            here = here[part]
        elif isinstance(here, list) and isinstance(part, int) and part < len(here):
            names.append(str(part))
            here = here[part]
        elif not isinstance(here, (dict, list)):
            break
    return ".".join(names)


def _looks_like_text(head: bytes) -> bool:
    try:
        head.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return b"\0" not in head


def check_vocab(state: dict[str, Any], vocab: Vocab, url: str) -> None:
    if state["vocab_digest"] != vocab.digest:
        raise UserError(
            f"checkpoint {url} was trained with another vocabulary (digest {state['vocab_digest'][:12]}, "
            f"this one {vocab.digest[:12]}): use the vocabulary it was trained with, or another checkpoint_dir"
        )


def check_model(saved: dict, cfg: RunConfig, url: str) -> None:
    """The model a checkpoint holds is the one the config builds (dropout may differ)."""
    now = cfg.model.model_dump(mode="json")
    for key, value in saved.get("model", {}).items():
        if key != "dropout" and now.get(key) != value:
            raise UserError(
                f"checkpoint {url} has model.{key}={value!r}, this config {now.get(key)!r}: "
                "use the same model, another checkpoint_dir, or --no-resume"
            )


def load_checkpoint(url: str, device: str | torch.device = "cpu", vocab: Vocab | None = None) -> Loaded:
    """A model ready to sample or evaluate, with the config, vocabulary and tokenizer it was trained with.

    With `vocab`, refuses a checkpoint trained on another vocabulary: its ids would mean other tokens.
    """
    device = resolve_device(str(device))  # "auto" too, as train.device takes it
    state = read_checkpoint(url, device)
    if vocab is not None:
        check_vocab(state, vocab, url)
    try:
        config = RunConfig.model_validate(state["config"])
        ckpt_vocab = Vocab.from_json(state["vocab"])
        tokenizer = tokenizer_from_json(state["tokenizer"])
        src_vocab = Vocab.from_json(state["src_vocab"]) if "src_vocab" in state else None
        src_tokenizer = tokenizer_from_json(state["src_tokenizer"]) if "src_tokenizer" in state else None
    except ValidationError as e:
        first = e.errors()[0]
        field = _field(state["config"], first["loc"]) or "(the whole config)"
        more = f" and {e.error_count() - 1} more" if e.error_count() > 1 else ""
        raise UserError(
            f"checkpoint {url} has a config this mllm cannot read: {field}: {first['msg']}{more} "
            "(written by another version of mllm?)"
        ) from None
    except (ValueError, KeyError, TypeError) as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise UserError(f"checkpoint {url} has an unreadable config, vocabulary or tokenizer ({reason})") from None
    model = build_model(config.model)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise UserError(
            f"checkpoint {url} does not fit the model its config describes ({str(e).splitlines()[0]})"
        ) from None
    model.to(device).eval()
    metrics = {k: float(v) for k, v in state.get("metrics", {}).items()}
    return Loaded(model, config, ckpt_vocab, tokenizer, int(state["step"]), metrics, src_vocab, src_tokenizer, url)


class BrokenOff(BaseException):
    """A signal arrived while `Signals.breaking`: the work in progress is dropped. A BaseException,
    so that no `except Exception` on the way (inductor's own fallbacks) takes it for a failure."""


class Signals:
    """SIGINT and SIGTERM, while the loop runs in the main thread, only noted: the loop writes
    last.pt of the last finished step, then hands the signal to the handler it displaced (a
    terminal's Ctrl-C, Prefect's termination, Python's default), which stops the run as before.
    A second signal before that goes to the displaced handler at once.

    Within `breaking()` (a step's forward and backward, an evaluation: work that changes no state
    a checkpoint holds) the first signal also raises BrokenOff there: that work can take minutes
    when it compiles, and a signal sent to the whole process group has already ended the C++
    compiler it waits for."""

    NAMES = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # SIGHUP: the terminal closed

    def __init__(self, install: bool = True) -> None:
        """`install=False`: no handler is set; the caller, whose own handlers stay, asks for the
        stop with `stop()` (a training run in a thread while the main thread takes the signals)."""
        self.received: int | None = None
        self.previous: dict[int, object] = {}
        self._breaking = False
        self._asked = False
        self._lock = threading.Lock()
        self._loop_thread: int | None = None
        if not install or threading.current_thread() is not threading.main_thread():
            return  # signals reach the main thread only; there the caller's handlers stay
        for signum in self.NAMES:
            if signal.getsignal(signum) not in (signal.SIG_IGN, None):
                self.previous[signum] = signal.signal(signum, self._note)

    def _note(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signum
            if self._breaking:
                self._breaking = False
                raise BrokenOff(signum)
        else:
            self._hand_on(signum, frame)

    @contextlib.contextmanager
    def breaking(self, allowed: bool = True) -> Iterator[None]:
        """The first signal in this block raises BrokenOff in it (when `allowed`)."""
        self._loop_thread = threading.get_ident()
        self._breaking = allowed and self.received is None
        try:
            yield
        finally:
            with self._lock:
                self._breaking = False

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Stop as at `signum` (from any thread): last.pt of the last finished step, then the loop
        raises KeyboardInterrupt; the signal itself is the caller's to handle. Within `breaking()`
        the loop's thread is broken off as a signal would break off the main thread."""
        with self._lock:
            if self.received is not None:
                return
            self._asked = True
            self.received = signum
            if self._breaking and self._loop_thread is not None:
                # As a signal's handler raises in the main thread: BrokenOff where the loop's own
                # thread stands, at its next bytecode (a compilation: seconds to minutes of it).
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self._loop_thread), ctypes.py_object(BrokenOff)
                )

    def deliver(self, step: int) -> None:
        """The checkpoint is written: let the signal take its course."""
        if self.received is not None and not self._asked:
            self._hand_on(self.received, None)
        # A handler that only took note (or a signal from another rank): stop here all the same.
        raise KeyboardInterrupt(f"stopped by a signal after step {step}; last.pt holds it")

    def _hand_on(self, signum: int, frame) -> None:
        handler = self.previous.get(signum) or signal.SIG_DFL  # None: one set outside Python
        self.restore()
        if callable(handler):
            handler(signum, frame)
        elif handler == signal.SIG_DFL:
            signal.raise_signal(signum)


def step_position(batches, device: torch.device) -> tuple:
    """Where the data order and the RNGs stand before a step, to draw its batches again."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return batches.state_dict(), batches.rng_state(), torch.get_rng_state(), cuda


def rewind(batches, where: tuple, device: torch.device) -> None:
    """Back to `step_position`'s place: the broken-off step's batches are drawn again on resume."""
    data, data_rng, cpu, cuda = where
    batches.load_state_dict(data, data_rng)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def signalled_alone(signals: Signals, d: Dist) -> bool:
    """Whether an error in the loop follows a signal this process noted, so it is the signal's
    doing. One process only: under DDP the other ranks would wait in a collective for this one."""
    return signals.received is not None and d.world_size == 1
