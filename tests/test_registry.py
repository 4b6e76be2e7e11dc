"""The champion policy, as pure functions of typed inputs: no server, no store."""

from __future__ import annotations

import math

from tasks.registry import Champion, ChampionScore, decide, skip_reason

CHAMP = Champion(name="smoke", version="3", val_loss=1.5, splits_key="s1", checkpoint="mem://c.pt")


def test_first_version_is_promoted_and_a_non_finite_loss_never_is() -> None:
    assert decide(2.0, 3.0, None) == (True, "no champion yet")
    promoted, why = decide(math.nan, 3.0, None)
    assert not promoted and "not finite" in why


def test_same_split_compares_val_loss() -> None:
    assert decide(1.4, 2.0, CHAMP)[0] and "val_loss 1.4 < champion v3 1.5" in decide(1.4, 2.0, CHAMP)[1]
    promoted, why = decide(1.5, 2.0, CHAMP)
    assert not promoted and why.startswith("val_loss 1.5 >= champion v3")


def test_another_split_compares_bits_per_byte_of_the_champion_scored_on_this_split() -> None:
    score = ChampionScore(checkpoint="mem://c.pt", split="val", splits_key="s2", loss=9.0, bits_per_byte=2.1, tokens=10)
    # A higher loss (another vocabulary) but fewer bits per byte on the same text: promoted.
    promoted, why = decide(5.0, 2.0, CHAMP, score)
    assert promoted and "both on this run's validation split" in why
    assert not decide(0.1, 2.2, CHAMP, score)[0]


def test_a_headline_family_compares_its_metric_and_on_another_split_the_champions_rescore() -> None:
    champ = CHAMP.model_copy(update={"headline": "chrf", "score": 90.0})
    assert decide(0.5, None, champ, headline=("chrf", 91.0, True)) == (True, "chrf 91 > champion v3 90")
    assert not decide(0.1, None, champ, headline=("chrf", 90.0, True))[0]  # a tie keeps the champion
    # Scored on this run's held-out pairs the champion reaches only 80: 85 beats it there.
    rescored = ChampionScore(checkpoint="mem://c.pt", split="val", splits_key="s2", loss=1.0, tokens=10,
                             headline="chrf", value=80.0)
    promoted, why = decide(0.5, None, champ, rescored, headline=("chrf", 85.0, True))
    assert promoted and why == "chrf 85 > 80 for champion v3, both on this run's validation split"
    assert not decide(0.5, None, champ, rescored, headline=("chrf", 79.0, True))[0]


def test_skip_only_when_a_version_was_trained_on_the_same_key() -> None:
    assert skip_reason(None, "3", "ab" * 32, "k") is None
    assert skip_reason(CHAMP, None, "ab" * 32, "k") is None
    assert "since champion v3 was trained" in skip_reason(CHAMP, "3", "ab" * 32, "k")
    assert "v4 was trained, which did not beat champion v3" in skip_reason(CHAMP, "4", "ab" * 32, "k")
