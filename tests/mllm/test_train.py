"""Training: data windows, the loop's stop reasons and metrics, exact resume, checkpoints, the CLI."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import prewarmed
import pytest
import torch
import yaml
from textdata import write_char_ids

from mllm import UserError
from mllm.config import RunConfig
from mllm.data.vocab import Vocab
from mllm.lm.windows import EpochWindows, RandomWindows, windows
from mllm.runtime.checkpoint import Loaded, load_checkpoint
from mllm.runtime.epochs import load_ids
from mllm.runtime.optim import lr_factor
from mllm.train import main, train

REPO = Path(__file__).resolve().parents[2]
LSTM = {"arch": "lstm", "n_embd": 8, "hidden_size": 16, "n_layer": 2, "dropout": 0.3}
GPT = {"arch": "gpt", "n_embd": 16, "n_head": 2, "n_layer": 2, "block_size": 16, "dropout": 0.2}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny models run fastest on one thread; more only contend on a shared 2-core machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """Character ids of a small made-up text, split 90/10, with its vocabulary."""
    d = tmp_path_factory.mktemp("data")
    vocab = write_char_ids(d, 1200)
    # The same text with one character fewer known: another vocabulary, same ids range.
    Vocab(vocab.itos[:-1] + ["#"]).save(str(d / "other_vocab.json"))
    return d


def make_config(data_dir: Path, ckpt: Path, model=LSTM, **train) -> RunConfig:
    t = {
        "batch_size": 8,
        "window": 16,
        "max_steps": 8,
        "log_interval": 2,
        "eval_interval": 4,
        "eval_batches": 2,
        "checkpoint_interval": 4,
        "optimizer": "adamw",
        "lr": 3e-3,
    }
    t.update(train)
    return RunConfig.model_validate(
        {
            "model": model,
            "train": t,
            "paths": {
                "train_ids": str(data_dir / "train.npy"),
                "val_ids": str(data_dir / "val.npy"),
                "vocab": str(data_dir / "vocab.json"),
                "checkpoint_dir": str(ckpt),
            },
        }
    )


def weights(url) -> dict[str, torch.Tensor]:
    return torch.load(url, weights_only=True)["model"]


# ----------------------------------------------------------------------------- data


def test_windows_target_is_input_shifted_by_one():
    ids = np.arange(100, dtype=np.uint16)
    x, y = windows(ids, np.array([0, 7, 83]), 16)
    assert x.dtype == y.dtype == torch.int64 and x.shape == (3, 16)
    assert x[1].tolist() == list(range(7, 23)) and y[1].tolist() == list(range(8, 24))
    assert y[2, -1].item() == 99  # the last window reaches the last token


def test_load_ids_maps_local_files_and_rejects_other_files(tmp_path):
    np.save(tmp_path / "ids.npy", np.arange(10, dtype=np.int32))
    ids = load_ids(str(tmp_path / "ids.npy"))
    assert isinstance(ids, np.memmap) and ids.tolist() == list(range(10))
    (tmp_path / "text.npy").write_text("not an array")
    with pytest.raises(UserError, match="not a .npy array"):
        load_ids(str(tmp_path / "text.npy"))
    with pytest.raises(UserError, match="not found"):
        load_ids(str(tmp_path / "missing.npy"))


def test_an_epoch_visits_every_window_once_and_ranks_share_it():
    ids = np.arange(60)
    one = EpochWindows(ids, window=8, batch_size=5, stride=2, seed=3)
    assert one.num_windows == 26 and one.batches_per_epoch == 6  # starts 0, 2, ..., 50
    starts = [x[:, 0].tolist() for x, _ in (one.next() for _ in range(one.batches_per_epoch))]
    assert sorted(sum(starts, [])) == list(range(0, 51, 2))
    assert one.position == (1, 0)
    assert [x[:, 0].tolist() for x, _ in (one.next() for _ in range(6))] != starts  # reshuffled
    # Two ranks: equal batch counts, together every window (one padded twice at most).
    ranks = [EpochWindows(ids, 8, 5, 2, seed=3, rank=r, world_size=2) for r in range(2)]
    assert ranks[0].batches_per_epoch == ranks[1].batches_per_epoch == 3
    seen = [s for r in ranks for _ in range(3) for s in r.next()[0][:, 0].tolist()]
    assert set(seen) == set(range(0, 51, 2)) and len(seen) == 26


def test_random_windows_resume_from_generator_state_and_split_between_ranks():
    ids = np.arange(1000)
    a = RandomWindows(ids, 16, 4, seed=1)
    a.next()
    state, rng = a.state_dict(), a.rng_state()
    expected = a.next()[0]
    b = RandomWindows(ids, 16, 4, seed=1)
    b.load_state_dict(state, rng)
    assert torch.equal(b.next()[0], expected)
    whole = RandomWindows(ids, 16, 8, seed=5).next()[0]
    halves = [RandomWindows(ids, 16, 4, seed=5, rank=r, world_size=2).next()[0] for r in range(2)]
    assert torch.equal(torch.cat(halves), whole)


def test_lr_warms_up_then_decays_to_min_lr():
    cfg = RunConfig.model_validate(
        {"train": {"max_steps": 100, "lr": 1e-3, "min_lr": 1e-4, "lr_schedule": "cosine", "warmup_steps": 10}}
    ).train
    f = lr_factor(cfg, 100)
    assert f(0) == pytest.approx(1 / 11) and f(9) == pytest.approx(10 / 11)
    assert f(10) == pytest.approx(1.0) and f(100) == pytest.approx(0.1)
    assert f(55) == pytest.approx(0.55)  # halfway down the cosine: (1 + 0.1) / 2


# ----------------------------------------------------------------------------- the loop


@pytest.mark.parametrize("model,sampling", [(LSTM, "epoch"), (GPT, "random")], ids=["lstm-epoch", "gpt-random"])
def test_resume_after_a_crash_reaches_the_same_weights(data_dir, tmp_path, model, sampling):
    # Cosine schedule, warmup, clipping, accumulation and dropout > 0: every piece of state counts.
    kw = dict(
        sampling=sampling,
        max_steps=8,
        lr_schedule="cosine",
        warmup_steps=2,
        grad_clip=0.5,
        grad_accum=2,
        eval_interval=3,
    )
    straight_records = []
    straight = train(make_config(data_dir, tmp_path / "a", model, **kw), on_metrics=straight_records.extend)

    class Crash(Exception):
        pass

    def crash_at_4(progress):
        if progress["step"] == 4:
            raise Crash

    cfg = make_config(data_dir, tmp_path / "b", model, **kw)
    with pytest.raises(Crash):
        train(cfg, on_progress=crash_at_4)
    resumed_records = []
    resumed = train(cfg, on_metrics=resumed_records.extend)

    assert resumed.resumed_from_step == 4 and resumed.steps == straight.steps == 8
    a, b = weights(straight.checkpoint), weights(resumed.checkpoint)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    timeless = lambda records: [{k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu")} for r in records]  # noqa: E731 (a one-line helper, named where it is used)
    assert timeless(resumed_records) == timeless(r for r in straight_records if r["step"] > 4)
    assert resumed.val_loss == straight.val_loss


@pytest.mark.parametrize("model", [GPT, LSTM], ids=["gpt", "lstm"])
def test_losses_equal_the_plain_loop(data_dir, tmp_path, model):
    # The hot path (fused optimizer, fewer host syncs) must not change what is learned: the loop's
    # per-step losses equal those of the textbook loop (torch's per-parameter AdamW, clipping, the
    # same schedule, batches and dropout draws). The fused update only reorders float operations,
    # so after 30 steps the losses agree to float32 rounding, far inside any seed-to-seed change.
    from mllm.families.base import build_model

    kw = dict(
        sampling="random",
        max_steps=30,
        log_interval=1,
        lr_schedule="cosine",
        warmup_steps=3,
        grad_clip=0.5,
        weight_decay=0.1,
        eval_interval=10,
    )
    cfg = make_config(data_dir, tmp_path, model, **kw)
    records = []
    train(cfg, on_metrics=records.extend)
    got = [r["train_loss"] for r in records if "train_loss" in r]

    t = cfg.train
    torch.manual_seed(t.seed)
    vocab = Vocab.load(str(data_dir / "vocab.json"))
    net = build_model(cfg.model.model_copy(update={"vocab_size": len(vocab)}))
    opt = torch.optim.AdamW(net.optim_groups(t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(t, t.max_steps))
    batches = RandomWindows(load_ids(str(data_dir / "train.npy")), t.window, t.batch_size, t.seed)
    want = []
    for _ in range(t.max_steps):
        x, y = batches.next()
        _, loss, _ = net(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), t.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        want.append(loss.item())
    assert len(got) == len(want) == 30
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)
    assert want[-1] < want[0] - 0.2  # it learned: equal losses of an untrained model would prove little


def test_metrics_arrive_as_one_list_per_log_step(data_dir, tmp_path):
    calls, progress = [], []
    result = train(
        make_config(data_dir, tmp_path, max_steps=8, log_interval=2, eval_interval=4),
        on_metrics=calls.append,
        on_progress=progress.append,
    )
    assert [(p["step"], p["total_steps"]) for p in progress] == [(2, 8), (4, 8), (6, 8), (8, 8)]
    assert [[r["step"] for r in c] for c in calls] == [[2], [4, 4], [6], [8, 8]]
    train_keys = {"step", "train_loss", "lr", "grad_norm", "tokens_per_s", "mfu"}
    val_keys = {"step", "val_loss", "val_perplexity", "val_bits_per_token"}
    assert all(set(r) in (train_keys, val_keys) for c in calls for r in c)
    last_val = calls[-1][1]
    assert last_val["val_perplexity"] == pytest.approx(math.exp(last_val["val_loss"]))
    assert last_val["val_bits_per_token"] == pytest.approx(last_val["val_loss"] / math.log(2))
    assert result.val_loss == last_val["val_loss"] and result.train_loss == calls[-1][0]["train_loss"]
    assert result.stop_reason == "max_steps" and result.steps == 8 and result.tokens_per_s > 0
    assert Path(result.checkpoint).name == "last.pt" and Path(result.best_checkpoint).exists()


def test_epochs_end_training_after_every_window_was_seen(data_dir, tmp_path):
    cfg = make_config(data_dir, tmp_path, sampling="epoch", max_steps=None, epochs=1, stride=4, batch_size=32)
    n_windows = (len(np.load(data_dir / "train.npy")) - 16 - 1) // 4 + 1
    result = train(cfg)
    assert result.stop_reason == "epochs" and result.steps == math.ceil(n_windows / 32)


def test_early_stopping_when_validation_stops_improving(data_dir, tmp_path):
    # An lr far below float32 resolution leaves the weights as they are: no eval ever improves.
    cfg = make_config(data_dir, tmp_path, max_steps=100, lr=1e-12, eval_interval=1, early_stopping_patience=2)
    result = train(cfg)
    assert result.stop_reason == "early_stopping" and result.steps == 3
    # Resuming a run that already stopped early does not train on.
    assert train(cfg).steps == 3


def test_time_budget_stops_training(data_dir, tmp_path):
    result = train(make_config(data_dir, tmp_path, max_steps=None, max_minutes=1e-4))
    assert result.stop_reason == "max_minutes" and result.steps >= 1
    assert load_checkpoint(result.checkpoint).step == result.steps


def test_minutes_alone_set_a_cosine_schedule_that_runs_out_with_them(data_dir, tmp_path):
    records, progress = [], []
    cfg = make_config(
        data_dir,
        tmp_path,
        max_steps=None,
        max_minutes=0.05,
        lr_schedule="cosine",
        min_lr=3e-5,
        log_interval=1,
        eval_interval=10**6,
        checkpoint_interval=10**6,
        compile=False,
    )
    result = train(cfg, on_metrics=records.extend, on_progress=progress.append)
    assert result.stop_reason == "max_minutes" and 3.0 <= result.elapsed_s < 4.0
    # The rate follows the clock down from its peak to min_lr at the budget's end (not held at the
    # peak, as a schedule with no end would be).
    lrs = [r["lr"] for r in records if "lr" in r]
    assert lrs == sorted(lrs, reverse=True) and lrs[0] > 0.95 * 3e-3 and lrs[-1] < 3e-5 + 0.05 * (3e-3 - 3e-5)
    # The progress bar's end is the steps the budget will take at the pace so far.
    assert progress[-1]["total_steps"] == pytest.approx(result.steps, rel=0.1)


def test_a_checkpoint_every_few_minutes_besides_every_n_steps(data_dir, tmp_path):
    def saved_steps(minutes):
        seen = []
        last = tmp_path / str(minutes) / "last.pt"
        train(
            make_config(data_dir, last.parent, max_steps=6, checkpoint_interval=1000, checkpoint_minutes=minutes),
            on_progress=lambda p: seen.append(load_checkpoint(str(last)).step if last.exists() else None),
        )
        return seen

    assert saved_steps(None) == [None, None, 6]  # by steps only: nothing before the end
    assert saved_steps(1e-7) == [2, 4, 6]  # a few microseconds of training each time: every step


@pytest.mark.slow
def test_sigterm_writes_the_checkpoint_of_the_last_finished_step(data_dir, tmp_path):
    cfg = make_config(
        data_dir,
        tmp_path,
        max_steps=10_000,
        checkpoint_interval=10_000,
        checkpoint_minutes=None,
        log_interval=1,
        eval_interval=10_000,
    )
    (tmp_path / "run.yaml").write_text(cfg.to_yaml())
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mllm.train", "--config", str(tmp_path / "run.yaml")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    logged = []
    for line in proc.stdout:
        logged.append(int(line.split(":")[0].split()[1]))
        if len(logged) == 20:
            proc.terminate()  # SIGTERM, as docker stop sends
            break
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == -15, stderr[-2000:]  # then Python's default: the signal ends the process
    step = torch.load(tmp_path / "last.pt", weights_only=True)["step"]
    assert 20 <= step < 10_000  # no step printed before the signal is lost


def test_a_training_in_a_thread_stopped_from_the_main_thread_writes_its_last_finished_step(data_dir, tmp_path):
    # As a worker's flow run trains (tasks/model/train.py): the main thread keeps its own handlers
    # and asks the training's thread to stop, which writes last.pt and raises KeyboardInterrupt.
    import threading

    from mllm.runtime.checkpoint import Signals

    before = signal.getsignal(signal.SIGTERM)
    cfg = make_config(data_dir, tmp_path, max_steps=10_000, checkpoint_interval=10_000, checkpoint_minutes=None)
    signals, stepped, ended = Signals(install=False), threading.Event(), {}

    def progress(p: dict) -> None:
        if p["step"] >= 5:
            stepped.set()

    def target() -> None:
        try:
            train(cfg, on_progress=progress, signals=signals)
        except BaseException as e:  # noqa: BLE001 (the test reads it)
            ended["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    assert signal.getsignal(signal.SIGTERM) is before  # nothing installed over the main thread's
    assert stepped.wait(60)
    signals.stop()
    thread.join(60)
    assert isinstance(ended.get("error"), KeyboardInterrupt), ended
    assert 5 <= torch.load(tmp_path / "last.pt", weights_only=True)["step"] < 10_000


def test_a_hang_up_stops_the_loop_as_ctrl_c_does_unless_nohup_ignores_it():
    import signal

    from mllm.runtime.checkpoint import Signals

    # SIGHUP's disposition as a terminal leaves it, whatever this test process inherited (under
    # `nohup` it is ignored already).
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        noted = Signals()
        try:
            os.kill(os.getpid(), signal.SIGHUP)  # the terminal closed
            assert noted.received == signal.SIGHUP
        finally:
            noted.restore()
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what nohup does
        ignored = Signals()
        os.kill(os.getpid(), signal.SIGHUP)
        assert ignored.received is None
        ignored.restore()
    finally:
        signal.signal(signal.SIGHUP, previous)


def _compiler_processes(parent: int) -> list[int]:
    """The C++ compiler's processes under `parent` (g++ and what it runs: cc1plus, as, ld)."""
    ps = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,comm="], capture_output=True, text=True, check=True)
    table = [line.split(None, 2) for line in ps.stdout.splitlines()]
    found = [int(pid) for pid, ppid, comm in table if int(ppid) == parent and comm.strip() in ("g++", "c++", "cc")]
    for pid in found:  # a child's children come after it in `found`: the loop reaches them too
        found += [int(p) for p, pp, _ in table if int(pp) == pid]
    return found


@pytest.mark.slow
def test_a_signal_to_the_whole_group_while_inductor_compiles_stops_in_seconds_at_the_last_finished_step(
    data_dir, tmp_path, monkeypatch
):
    # `timeout`, a batch scheduler or a terminal signal every process of the command's group: the
    # g++ that inductor waits for dies of it too. A compilation takes minutes on a busy machine,
    # and a dead compiler used to fail the task: both give way to the signal, as at any step.
    import signal
    import threading
    import time

    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # nothing compiled: g++ runs
    torch._dynamo.reset()
    # Inductor's probes of the CPU's vector instructions first (once a process): a probe the
    # signal ends only counts as an instruction set missing. The g++ that gets the signal below
    # compiles the model's kernels, and dying fails the compilation.
    valid_vec_isa_list()
    cfg = make_config(
        data_dir,
        tmp_path,
        max_steps=1000,
        compile=True,
        checkpoint_interval=1000,
        checkpoint_minutes=None,
        eval_interval=1000,
    )
    sent: list[float] = []

    def group_signal() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (compiler := _compiler_processes(os.getpid())):
            time.sleep(0.02)
        sent.append(time.monotonic())
        for pid in [*compiler, os.getpid()]:  # what os.killpg does, without the test's other processes
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def interrupted(signum, frame):  # the CLI's handler of a first signal (flows/cli/terminal.py)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupted)
    watcher = threading.Thread(target=group_signal, daemon=True)
    watcher.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            train(cfg)
        stopped = time.monotonic()
    finally:
        signal.signal(signal.SIGTERM, previous)
        torch._dynamo.reset()
    assert sent, "inductor never ran the C++ compiler"
    assert stopped - sent[0] < 10, stopped - sent[0]
    state = torch.load(tmp_path / "last.pt", weights_only=True)
    # The first step's compilation was broken off: last.pt holds step 0, and the batches that step
    # drew are drawn again on resume.
    assert state["step"] == 0 and state["data_state"] == {"batches": 0}


DDP_SCRIPT = """
import sys, torch, torch.distributed as dist
from mllm.config import RunConfig
from mllm.train import train

dist.init_process_group("gloo")  # held across the three runs; train() joins it
base = RunConfig.model_validate_json(sys.argv[1])
def run(folder, steps):
    cfg = base.model_copy(deep=True)
    cfg.paths.checkpoint_dir, cfg.train.max_steps = folder, steps
    return train(cfg)
straight = run(sys.argv[2] + "/a", 6)
run(sys.argv[2] + "/b", 3)
resumed = run(sys.argv[2] + "/b", 6)
if dist.get_rank() == 0:
    a = torch.load(straight.checkpoint, weights_only=True)
    b = torch.load(resumed.checkpoint, weights_only=True)
    same = all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    print("ranks", len(b["rng"]["cpu"]), "resumed_from", resumed.resumed_from_step, "same", same)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_ddp_on_two_cpu_ranks_resumes_exactly(data_dir, tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    cfg = make_config(data_dir, tmp_path, sampling="epoch", grad_accum=2, eval_interval=2, checkpoint_interval=3)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(script),
            cfg.model_dump_json(),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ranks 2 resumed_from 3 same True" in out.stdout


# ----------------------------------------------------------------------------- checkpoints


def test_checkpoint_round_trip_gives_the_trained_model(data_dir, tmp_path):
    result = train(make_config(data_dir, tmp_path, model=GPT, max_steps=4))
    loaded = load_checkpoint(result.checkpoint)
    assert isinstance(loaded, Loaded) and loaded.step == 4 and not loaded.model.training
    vocab = Vocab.load(str(data_dir / "vocab.json"))
    assert loaded.vocab == vocab and loaded.config.model.vocab_size == len(vocab)
    assert loaded.config.paths is None and loaded.config.train.max_steps == 4
    assert loaded.tokenizer.split("The war") == list("The war")
    assert loaded.metrics["val_loss"] == pytest.approx(result.val_loss)
    state = weights(result.checkpoint)
    assert all(torch.equal(v, state[k]) for k, v in loaded.model.state_dict().items())
    raw = torch.load(result.checkpoint, weights_only=True)
    assert {"optimizer", "scheduler", "rng", "data_state", "vocab_digest"} <= raw.keys()


def test_truncated_or_foreign_checkpoint_is_a_user_error(data_dir, tmp_path):
    result = train(make_config(data_dir, tmp_path / "ck", max_steps=2))
    blob = Path(result.checkpoint).read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(UserError, match=f"checkpoint {cut} is truncated or corrupt"):
        load_checkpoint(str(cut))
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(2)}, other)
    with pytest.raises(UserError, match="not an mllm checkpoint"):
        load_checkpoint(str(other))
    with pytest.raises(UserError, match="checkpoint not found"):
        load_checkpoint(str(tmp_path / "nothing.pt"))


def test_another_vocabulary_is_refused(data_dir, tmp_path):
    result = train(make_config(data_dir, tmp_path, max_steps=2))
    other = Vocab.load(str(data_dir / "other_vocab.json"))
    with pytest.raises(UserError, match="trained with another vocabulary"):
        load_checkpoint(result.checkpoint, vocab=other)
    cfg = make_config(data_dir, tmp_path, max_steps=4)
    cfg.paths.vocab = str(data_dir / "other_vocab.json")
    with pytest.raises(UserError, match="trained with another vocabulary"):
        train(cfg)
    assert train(cfg, resume=False).resumed_from_step == 0


# ----------------------------------------------------------------------------- the CLI


def run_cli(*args, cwd=None):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return prewarmed.run("mllm.train", [*args], env=env, cwd=cwd, timeout=300)


def write_config(path: Path, cfg: RunConfig) -> Path:
    d = cfg.to_dict(paths=True)
    path.write_text(yaml.safe_dump(d))
    return path


@pytest.mark.slow
def test_cli_trains_and_resumes(data_dir, tmp_path):
    config = write_config(tmp_path / "run.yaml", make_config(data_dir, tmp_path / "ck", max_steps=4))
    first = run_cli("--config", str(config))
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert [line.split(":")[0] for line in lines if "tok/s" in line and "loss" in line][:2] == ["step 2", "step 4"]
    assert lines[-1].startswith("done: 4 steps (max_steps)")
    assert (tmp_path / "ck" / "last.pt").exists()
    more = run_cli("--config", str(config), "--set", "train.max_steps=6")
    assert more.returncode == 0 and "resumed from step 4" in more.stdout.splitlines()[-1]
    bad = run_cli("--config", str(config), "--set", "train.lr=-1")
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and bad.stderr.count("\n") == 1


@pytest.mark.parametrize(
    "change,message",
    [
        (["--set", "train.lrr=1"], "train.lrr: unknown field"),
        (["--set", "train.lr=-1"], "train.lr: Input should be greater than 0"),
        (["--set", "paths=null"], "has no paths section"),
        (
            ["--set", "paths.train_ids=/nowhere/train.npy"],
            "train ids (paths.train_ids) not found at /nowhere/train.npy",
        ),
        (["--set", "paths.vocab=OTHER"], "was trained with another vocabulary"),
    ],
)
def test_cli_bad_config_exits_2_with_one_line(data_dir, tmp_path, capsys, change, message):
    config = write_config(tmp_path / "run.yaml", make_config(data_dir, tmp_path / "ck", max_steps=2))
    assert main(["--config", str(config)]) == 0
    capsys.readouterr()
    change = [c.replace("OTHER", str(data_dir / "other_vocab.json")) for c in change]
    assert main(["--config", str(config), *change]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and err.count("\n") == 1 and message in err


def test_cli_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal width
    assert exit.value.code == 0
    for option in ("--config", "--set", "--no-resume", "paths section", "last.pt", "train.lr=3e-4"):
        assert option in text
