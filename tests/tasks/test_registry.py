"""The champion policy, as pure functions of typed inputs: no server, no store (a corpus's
manifest, for what its files are, in a temporary folder)."""

from __future__ import annotations

import json
import math

from tasks.tracking.champion import (
    Champion,
    ChampionScore,
    decide,
    files_tag,
    skip_reason,
)

CHAMP = Champion(
    name="smoke",
    version="3",
    val_loss=1.5,
    splits_key="s1",
    checkpoint="mem://c.pt",
    headline="val_bits_per_byte",
    score=2.0,
)
BPB = ("val_bits_per_byte", False)  # a language model's headline: lower is better


def test_first_version_is_promoted_and_a_non_finite_value_never_is() -> None:
    assert decide(BPB[0], 3.0, BPB[1], None) == (True, "no champion yet")
    promoted, why = decide("val_bits_per_byte", math.nan, False, None)
    assert not promoted and "not finite" in why


def test_same_split_compares_the_headline_recorded_on_the_champion() -> None:
    promoted, why = decide("val_bits_per_byte", 1.9, False, CHAMP)
    assert promoted and why == "val_bits_per_byte 1.9 < champion v3 2"
    promoted, why = decide("val_bits_per_byte", 2.0, False, CHAMP)  # a tie keeps the champion
    assert not promoted and why == "val_bits_per_byte 2 ties (within 0.01%) champion v3 2"
    # Within the tolerance is a tie too (the same weights scored on another machine); past it is not.
    assert not decide("val_bits_per_byte", 2.0 - 1.5e-4, False, CHAMP)[0]
    assert decide("val_bits_per_byte", 2.0 - 3e-4, False, CHAMP)[0]
    promoted, why = decide("val_bits_per_byte", 2.01, False, CHAMP)
    assert not promoted and why == "val_bits_per_byte 2.01 >= champion v3 2"


def test_another_split_compares_the_champion_scored_on_this_split() -> None:
    score = ChampionScore(
        checkpoint="mem://c.pt",
        split="val",
        splits_key="s2",
        loss=9.0,
        tokens=10,
        headline="val_bits_per_byte",
        value=2.1,
    )
    # Worse than the champion's own 2.0 on its split, but better than it does on this text: promoted.
    promoted, why = decide("val_bits_per_byte", 2.05, False, CHAMP, score)
    assert promoted and "both on this run's validation split" in why
    assert not decide("val_bits_per_byte", 2.2, False, CHAMP, score)[0]


def test_a_higher_is_better_headline_and_on_another_split_the_champions_rescore() -> None:
    champ = CHAMP.model_copy(update={"headline": "chrf", "score": 90.0})
    assert decide("chrf", 91.0, True, champ) == (True, "chrf 91 > champion v3 90")
    assert not decide("chrf", 90.0, True, champ)[0]  # a tie keeps the champion
    # Scored on this run's held-out pairs the champion reaches only 80: 85 beats it there.
    rescored = ChampionScore(
        checkpoint="mem://c.pt", split="val", splits_key="s2", loss=1.0, tokens=10, headline="chrf", value=80.0
    )
    promoted, why = decide("chrf", 85.0, True, champ, rescored)
    assert promoted and why == "chrf 85 > 80 for champion v3, both on this run's validation split"
    assert not decide("chrf", 79.0, True, champ, rescored)[0]


def test_a_champion_with_another_headline_gives_way() -> None:
    # A version registered before its family had this headline (or of another family) cannot be compared.
    old = CHAMP.model_copy(update={"headline": None, "score": None})
    assert decide("accuracy", 0.5, True, old) == (True, "champion v3 has no accuracy")


def test_skip_only_when_a_version_was_trained_on_the_same_key() -> None:
    assert skip_reason(None, "3", "ab" * 32, "k") is None
    assert skip_reason(CHAMP, None, "ab" * 32, "k") is None
    assert "since champion v3 was trained" in skip_reason(CHAMP, "3", "ab" * 32, "k")
    assert "v4 was trained, which did not beat champion v3" in skip_reason(CHAMP, "4", "ab" * 32, "k")


def test_a_challenger_of_a_corpus_that_shares_no_file_with_the_champions_is_not_judged() -> None:
    ours, theirs = ["a" * 64, "b" * 64], ["c" * 64]
    champ = CHAMP.model_copy(update={"files": files_tag(theirs).split()})
    promoted, why = decide("val_bits_per_byte", 0.5, False, champ, files=ours)  # far better, but of another corpus
    assert not promoted and why == (
        "not judged against champion v3, whose corpus shares no file with this run's "
        "(--model NAME registers a model of its own)"
    )
    # One file in common (a corpus grown or changed), or either side not recorded: judged as ever.
    assert decide("val_bits_per_byte", 0.5, False, champ, files=[*ours, "c" * 64])[0]
    assert decide("val_bits_per_byte", 0.5, False, CHAMP, files=ours)[0]
    assert decide("val_bits_per_byte", 0.5, False, champ)[0]
    assert files_tag(["ab" * 32] * 3) == "ab" * 8 and files_tag([]) is None


def test_a_corpus_file_is_known_by_its_bytes_and_by_where_it_was_read(tmp_path) -> None:
    from types import SimpleNamespace

    from tasks.data.download import file_identities

    one = file_identities(SimpleNamespace(raw_manifest=None, raw_sha256="a" * 64, source="/data/wp.txt"))
    edited = file_identities(SimpleNamespace(raw_manifest=None, raw_sha256="b" * 64, source="/data/wp.txt"))
    packed = file_identities(SimpleNamespace(raw_manifest=None, raw_sha256="c" * 64, source="/data/wp.txt.gz"))
    other = file_identities(SimpleNamespace(raw_manifest=None, raw_sha256="d" * 64, source="/data/stdlib.txt"))
    assert one[0] == "a" * 64 and set(one) & set(edited) and set(one) & set(packed) and not set(one) & set(other)
    manifest = tmp_path / "corpus.json"
    manifest.write_text(
        json.dumps(
            {
                "files": [
                    {"source": "/lib/os.py", "sha256": "e" * 64},
                    {"source": "/lib/bad.py", "sha256": "f" * 64, "skipped": "not UTF-8"},
                ]
            }
        )
    )
    many = file_identities(SimpleNamespace(raw_manifest=str(manifest), raw_sha256="0" * 64, source="/lib"))
    assert len(many) == 2 and many[0] == "e" * 64 and "f" * 64 not in many
