"""How many threads a training on a CPU computes with, chosen by timing its own steps and chosen again
when they drift; and whether the machine was busy, and what that cost."""

from __future__ import annotations

import os
import statistics
from collections import deque

import torch

WARMUP_STEPS = 1  # the first step at a new count is not timed: its thread pool is still growing
TRIAL_STEPS = 4  # steps timed at each count a round
ROUNDS = 2  # counts alternate (A B A B), so that a burst of load slows each rather than deciding
# A count whose step takes this many times the best median of another is left at once, and a
# round whose best is this much ahead of the rest ends the measurement: on a busy machine a step on
# too many threads took 10 times one thread's (6 s at load 13), and each one tried is paid for.
CLEAR = 2.5
MARGIN = 0.10  # another count replaces the default only when its median step is this much shorter
WINDOW = 25  # settled steps whose median is watched for drift
DRIFT = 1.3  # that median this many times slower or faster than at the choice: measure again
# ... but no sooner than `gap` settled steps, a gap that doubles (from WINDOW up to RECHECK_STEPS)
# each time a measurement keeps the count: under a load that comes and goes, each measurement
# pays for steps at a worse count (a measurement every 30 s cost one run a tenth of its steps).
RECHECK_STEPS = 1000  # and measure again after this many settled steps, drift or not
BUSY_SHARE = 0.8  # the threads ran less than this share of their wall time: the machine is busy


def candidates(default: int) -> list[int]:
    """The thread counts tried: the default (torch's: one a core, or OMP_NUM_THREADS), half of it
    and one."""
    return sorted({default, max(1, default // 2), 1}, reverse=True)


class Share:
    """The CPU time a training's threads were given over the wall time they could have run."""

    def __init__(self) -> None:
        self.cpu_s = self.thread_s = 0.0

    def add(self, wall_s: float, cpu_s: float, threads: int) -> None:
        self.cpu_s += cpu_s
        self.thread_s += wall_s * threads

    @property
    def share(self) -> float | None:
        return min(1.0, self.cpu_s / self.thread_s) if self.thread_s > 0 else None


class ThreadChooser:
    """The thread count of the next step (`threads`), from the steps before (`observe`).

    Measuring: each candidate count in turn from one thread up, a warm-up step and TRIAL_STEPS
    timed steps, ROUNDS times (a round fewer, or a count's steps cut short, where CLEAR says the
    rest is plain); the count with the shortest median step wins, the default unless another is
    at least MARGIN shorter. Settled: the median of the last WINDOW steps is watched; DRIFT times slower or
    faster than when chosen (another job took cores or gave them back), it measures again. Pure
    bookkeeping: the caller sets the count and times the steps (`follow`).
    """

    def __init__(self, default: int):
        self.default = self.threads = self.chosen = default
        self.counts = candidates(default)
        self.reference: float | None = None  # the chosen count's median step, seconds
        self.window: deque[float] = deque(maxlen=WINDOW)
        self.settled_steps, self.gap = 0, WINDOW
        self.why = "the first steps"  # why the current measurement runs
        self.said = _threads(default) + ("" if self.active else " (nothing to choose from)")
        self.total = Share()  # over the training (`recent`: over the measurement, `_measure`)
        self.busy = False  # as the last choice found it
        self._measure()

    @property
    def active(self) -> bool:
        return len(self.counts) > 1

    @property
    def measuring(self) -> bool:
        return bool(self.plan)

    def _measure(self) -> None:
        self.times: dict[int, list[float]] = {n: [] for n in self.counts}
        self.rounds = 0
        self._round()
        self.window.clear()
        self.settled_steps = 0
        self.recent = Share()
        if self.plan:
            self.threads = self.plan[0][0]

    def _round(self) -> None:
        self.plan = (
            [(n, i >= WARMUP_STEPS) for n in reversed(self.counts) for i in range(WARMUP_STEPS + TRIAL_STEPS)]
            if self.active
            else []
        )

    def _medians(self) -> dict[int, float]:
        return {n: statistics.median(ts) for n, ts in self.times.items() if ts}

    def _plain(self) -> bool:
        """Whether the best count so far is CLEAR ahead of every other (one cut short included)."""
        medians = sorted(self._medians().values())
        return len(medians) == 1 or medians[0] * CLEAR < medians[1]

    def observe(self, wall_s: float, cpu_s: float) -> str | None:
        """Take a step's wall and CPU seconds (at `threads`); a line to show when a measurement
        ended with another count than before or found the machine busy or quiet again."""
        self.total.add(wall_s, cpu_s, self.threads)
        self.recent.add(wall_s, cpu_s, self.threads)
        if self.plan:
            n, timed = self.plan.pop(0)
            if timed:
                self.times[n].append(wall_s)
            others = [t for m, t in self._medians().items() if m != n]
            if others and wall_s > CLEAR * min(others):  # plainly slower: the rest of its steps are not worth it
                while self.plan and self.plan[0][0] == n:
                    self.plan.pop(0)
            if not self.plan:
                self.rounds += 1
                if self.rounds < ROUNDS and not self._plain():
                    self._round()
            if self.plan:
                self.threads = self.plan[0][0]
                return None
            return self._choose()
        if not self.active:
            return None
        self.window.append(wall_s)
        self.settled_steps += 1
        if len(self.window) == WINDOW:
            now = statistics.median(self.window)
            if self.settled_steps >= self.gap and not self.reference / DRIFT <= now <= self.reference * DRIFT:
                self.why = f"a step went from {1000 * self.reference:.0f} to {1000 * now:.0f} ms"
                self._measure()
            elif self.settled_steps >= RECHECK_STEPS:
                self.why = f"{RECHECK_STEPS} steps since the last measurement"
                self._measure()
        return None

    def _choose(self) -> str | None:
        medians = self._medians()
        best = min(medians, key=medians.get)
        if self.default in medians and medians[best] > (1 - MARGIN) * medians[self.default]:
            best = self.default
        before, self.chosen, self.threads, self.reference = self.chosen, best, best, medians[best]
        self.gap = min(2 * self.gap, RECHECK_STEPS) if best == before else WINDOW
        share, was_busy = self.recent.share, self.busy
        self.busy = share is not None and share < BUSY_SHARE
        steps = ", ".join(
            f"{1000 * medians[n]:.0f} ms on {n}" if n in medians else f"over {CLEAR:g}x on {n}" for n in self.counts
        )
        self.said = f"{_threads(best)} of {self.default} (a step {steps}; measured: {self.why})"
        if self.busy:
            self.said += f"; the machine is busy: the training's threads ran {share:.0%} of the time"
        if best != before or self.busy != was_busy:
            return "threads: " + self.said + ("" if self.busy or not was_busy else "; the machine is quiet again")
        return None


def _threads(n: int) -> str:
    return f"{n} thread{'s' if n > 1 else ''}"


def chooser(device: torch.device, world_size: int) -> ThreadChooser:
    """The training's chooser: it chooses on a CPU training of one process (DDP's ranks share the
    cores by their own arrangement), from torch's thread count as the training starts."""
    chosen = ThreadChooser(torch.get_num_threads() if device.type == "cpu" and world_size == 1 else 1)
    if chosen.active:
        torch.set_num_threads(chosen.threads)  # the first step is the measurement's first
    return chosen


def follow(threads: ThreadChooser, wall_s: float, cpu_s: float) -> str | None:
    """`observe` a step, and compute the next one at the count it says."""
    said = threads.observe(wall_s, cpu_s)
    if threads.active and torch.get_num_threads() != threads.threads:
        torch.set_num_threads(threads.threads)
    return said


def record(threads: ThreadChooser, steps: int, resumed_from: int, total_steps: int | None) -> dict:
    """What the training's result says of its threads and the machine: the count and why,
    whether the machine was busy, the share of the CPU the training's threads got, and the steps
    planned: a step count's, or a time budget's, those it would have done had its threads run all
    the time (an estimate: what another job took, given back)."""
    share = threads.total.share
    busy = share is not None and share < BUSY_SHARE
    planned = total_steps
    if total_steps is None and share and steps > resumed_from:
        planned = resumed_from + round((steps - resumed_from) / share) if busy else steps
    return {
        "threads": threads.threads,
        "threads_reason": threads.said,
        "busy": busy,
        "cpu_share": None if share is None else round(share, 3),
        "steps_planned": planned,
        "load_average": round(os.getloadavg()[0], 2),
        "cores": len(os.sched_getaffinity(0)),
    }
