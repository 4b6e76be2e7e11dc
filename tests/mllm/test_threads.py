"""The training's thread count chosen by timing its own steps (issue 64, item 2): fed step times,
not timed, so that what it decides does not depend on this machine's load."""

from __future__ import annotations

import pytest

from mllm.runtime import threads as th
from mllm.runtime.threads import ThreadChooser


def feed(chooser: ThreadChooser, step_s: dict[int, float], share: float = 1.0, steps: int | None = None) -> list[str]:
    """Steps at the chooser's count taking step_s[count] seconds, the threads running `share` of
    that time; until the measurement ends (or `steps` steps). The lines it said."""
    said = []
    for _ in range(steps if steps is not None else 1000):
        if steps is None and not chooser.measuring:
            break
        n = chooser.threads
        if line := chooser.observe(step_s[n], step_s[n] * n * share):
            said.append(line)
    return said


def until_measuring(chooser: ThreadChooser, step_s: dict[int, float], limit: int) -> int:
    """Settled steps until the chooser measures again (at most `limit`): how many it took."""
    for i in range(1, limit + 1):
        feed(chooser, step_s, steps=1)
        if chooser.measuring:
            return i
    return limit + 1


def test_a_busy_machine_gets_the_count_whose_steps_are_shortest_and_is_said_to_be_busy():
    chooser = ThreadChooser(2)
    assert chooser.counts == [2, 1] and chooser.measuring and chooser.threads == 1
    # Each count in turn from one thread up, a warm-up and four timed steps each (1 1 1 1 1 2 2 2 2 2).
    assert [n for n, _ in chooser.plan] == [1] * 5 + [2] * 5
    said = feed(chooser, {2: 0.548, 1: 0.180}, share=0.45)
    assert not chooser.measuring and chooser.threads == 1 and chooser.busy
    # Two threads' first step took three times one thread's: left at once, no second round.
    assert chooser.times == {2: [], 1: [0.180] * 4}
    assert said == [
        "threads: 1 thread of 2 (a step over 2.5x on 2, 180 ms on 1; measured: the first steps); the "
        "machine is busy: the training's threads ran 45% of the time"
    ]
    record = th.record(chooser, steps=300, resumed_from=0, total_steps=None)
    assert (record["threads"], record["busy"], record["cpu_share"]) == (1, True, 0.45)
    assert record["steps_planned"] == round(300 / 0.45)  # a time budget's steps with the CPU to itself
    assert th.record(chooser, steps=300, resumed_from=100, total_steps=None)["steps_planned"] == 100 + round(200 / 0.45)
    assert th.record(chooser, steps=300, resumed_from=0, total_steps=500)["steps_planned"] == 500


def test_a_quiet_machine_keeps_the_default_and_says_nothing():
    chooser = ThreadChooser(2)
    assert feed(chooser, {2: 0.050, 1: 0.090}) == []
    assert chooser.times == {2: [0.050] * 8, 1: [0.090] * 8}  # close enough for a second round
    assert chooser.threads == 2 and not chooser.busy and chooser.said.startswith("2 threads of 2 (a step 50 ms")
    assert th.record(chooser, steps=300, resumed_from=0, total_steps=None)["steps_planned"] == 300
    # Within MARGIN of the default, fewer threads are not worth taking.
    near = ThreadChooser(2)
    feed(near, {2: 0.100, 1: 0.095})
    assert near.threads == 2


def test_a_step_time_that_drifts_is_measured_again_and_the_count_follows():
    chooser = ThreadChooser(2)
    feed(chooser, {2: 0.050, 1: 0.090})
    assert chooser.threads == 2 and chooser.reference == pytest.approx(0.050)
    # A little slower: within DRIFT, nothing measured again.
    feed(chooser, {2: 0.060, 1: 0.090}, steps=th.WINDOW)
    assert not chooser.measuring
    # Another job arrives: the steps at two threads take three times as long; it measures again,
    # no sooner than its gap, doubled since the first measurement kept the count.
    assert chooser.gap == 2 * th.WINDOW
    assert until_measuring(chooser, {2: 0.150, 1: 0.090}, 2 * th.WINDOW) == th.WINDOW
    assert chooser.why == "a step went from 50 to 150 ms"
    said = feed(chooser, {2: 0.150, 1: 0.100}, share=0.5)
    assert chooser.threads == 1 and said[0].startswith(
        "threads: 1 thread of 2 (a step 150 ms on 2, 100 ms on 1; measured: a step went from 50 to 150 ms)"
    )
    assert chooser.gap == th.WINDOW  # a new count: watched closely again
    # It leaves: one thread's steps get faster, measured again, back to two, said once.
    assert until_measuring(chooser, {2: 0.050, 1: 0.060}, th.WINDOW) <= th.WINDOW
    said = feed(chooser, {2: 0.050, 1: 0.090})
    assert chooser.threads == 2 and said == [said[0]] and said[0].endswith("the machine is quiet again")


def test_steady_steps_are_measured_again_after_recheck_steps_and_one_thread_has_nothing_to_choose():
    chooser = ThreadChooser(4)
    assert chooser.counts == [4, 2, 1]
    feed(chooser, {4: 0.05, 2: 0.08, 1: 0.15})
    feed(chooser, {4: 0.05, 2: 0.08, 1: 0.15}, steps=th.RECHECK_STEPS - 1)
    assert not chooser.measuring
    feed(chooser, {4: 0.05, 2: 0.08, 1: 0.15}, steps=1)
    assert chooser.measuring and chooser.why == f"{th.RECHECK_STEPS} steps since the last measurement"

    # A load that comes and goes: each measurement that keeps the count doubles the gap before the next.
    feed(chooser, {4: 0.05, 2: 0.08, 1: 0.15})
    assert chooser.gap == 4 * th.WINDOW  # kept twice: at the start and at the recheck
    gaps = []
    for _ in range(8):
        feed(chooser, {4: 0.05, 2: 0.08, 1: 0.15}, steps=chooser.gap - 1)
        assert not chooser.measuring
        until_measuring(chooser, {4: 0.10, 2: 0.16, 1: 0.30}, chooser.gap)
        feed(chooser, {4: 0.05, 2: 0.08, 1: 0.15})
        gaps.append(chooser.gap)
    assert gaps == [200, 400, 800, 1000, 1000, 1000, 1000, 1000] and chooser.threads == 4

    alone = ThreadChooser(1)
    assert not alone.active and not alone.measuring
    assert feed(alone, {1: 0.3}, share=0.4, steps=50) == [] and alone.threads == 1
    assert th.record(alone, steps=50, resumed_from=0, total_steps=None)["busy"]  # busy is measured all the same
