"""The champion policy: which version holds the `champion` alias, and two pure functions of typed
inputs, `skip_reason` (is there anything to train?) and `decide` (does the new version beat the
champion?), so that it is tested without a server."""

from __future__ import annotations

import math
from typing import Literal

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from pydantic import BaseModel

CHAMPION = "champion"

Decision = Literal["promoted", "kept", "skipped", "reproduction"]


class Champion(BaseModel):
    """The version that holds the `champion` alias, with what it was trained and measured on."""

    name: str
    version: str
    run_id: str | None = None
    checkpoint: str | None = None
    val_loss: float | None = None
    train_key: str | None = None
    splits_key: str | None = None
    raw_sha256: str | None = None
    headline: str | None = None  # the family's headline metric, and its value for this version
    score: float | None = None
    files: list[str] | None = None  # its corpus's file digests, shortened (FILES_TAG); None: not recorded


class ChampionScore(BaseModel):
    """The champion's checkpoint scored on a challenger's validation split: its family's headline
    metric (`headline`, `value`) and loss there."""

    checkpoint: str
    split: str
    splits_key: str
    loss: float
    tokens: int
    headline: str
    value: float


class Outcome(BaseModel):
    """What a pipeline run did about the recipe's model."""

    name: str
    version: str  # the new version; the champion's when skipped; "" for a reproduction
    decision: Decision
    reason: str
    promoted: bool = False
    run_id: str | None = None
    model_uri: str | None = None
    val_loss: float | None = None
    previous: Champion | None = None  # the champion before this run
    champion_score: ChampionScore | None = None


def skip_reason(champion: Champion | None, trained_version: str | None, raw_sha256: str, train_key: str) -> str | None:
    """Why there is nothing to train (a version was trained on this very key), or None."""
    if champion is None or trained_version is None:
        return None
    if trained_version == champion.version:
        why = f"data, config and code unchanged since champion v{champion.version} was trained"
    else:
        why = (
            f"data, config and code unchanged since v{trained_version} was trained, which did not "
            f"beat champion v{champion.version}"
        )
    # What --force does: the training of this key is found in storage and reused, not repeated.
    return (
        f"{why} (corpus sha256 {raw_sha256[:12]}, training key {train_key}); --force evaluates, registers and "
        "judges it again, reusing that training (another --storage trains anew)"
    )


# The version tag that lists a corpus's files, each by the first FILE_DIGEST hex digits of its
# sha256 (2**64 digests: no two files of two corpora meet by chance), for a corpus of at most
# FILES_TAGGED files (17 characters a file); a larger one is judged against any champion.
FILES_TAG = "data.files"
FILE_DIGEST = 16
FILES_TAGGED = 5000


def files_tag(files: list[str]) -> str | None:
    """A corpus's file digests as the value of FILES_TAG, or None when there are too many."""
    short = sorted({f[:FILE_DIGEST] for f in files})
    return " ".join(short) if short and len(short) <= FILES_TAGGED else None


def shares_files(champion: Champion, files: list[str] | None) -> bool:
    """Whether the challenger's corpus (its file digests) and the champion's have a file in
    common; True when either is not known, so that a model is judged as it was before."""
    if files is None or champion.files is None:
        return True
    return not {f[:FILE_DIGEST] for f in files}.isdisjoint(champion.files)


# A challenger must beat the champion by more than this fraction of the champion's value: the
# same weights scored on another machine or thread count differ in the last digits, and a model
# must never beat itself.
TIE_TOLERANCE = 1e-4


def decide(
    headline: str,
    value: float,
    higher_is_better: bool,
    champion: Champion | None,
    champion_score: ChampionScore | None = None,
    files: list[str] | None = None,
) -> tuple[bool, str]:
    """(promoted, why): the challenger's headline value against the champion's, measured on this
    run's validation split when `champion_score` is given (the champion's data differed), else
    against the value recorded on the champion's version (the same split, or a headline that does
    not depend on the split). Both come from the family's one scoring (`Family.evaluate` and
    `Family.rescore` share their setting); a tie within TIE_TOLERANCE keeps the champion. A
    challenger whose corpus (`files`: its file digests) shares no file with the champion's is no
    rival of it: it is registered and left beside it."""
    if not math.isfinite(value):
        return False, f"{headline} {value} is not finite"
    if champion is None:
        return True, "no champion yet"
    if not shares_files(champion, files):
        return False, (
            f"not judged against champion v{champion.version}, whose corpus shares no file with this "
            "run's (--model NAME registers a model of its own)"
        )

    def beats(theirs: float) -> tuple[bool, str]:
        if abs(value - theirs) <= TIE_TOLERANCE * max(abs(value), abs(theirs)):
            return False, f"ties (within {TIE_TOLERANCE:.2%})"
        better = value > theirs if higher_is_better else value < theirs
        sign = (">" if better else "<=") if higher_is_better else ("<" if better else ">=")
        return better, sign

    if champion_score is not None and champion_score.headline == headline:
        better, sign = beats(champion_score.value)
        return better, (
            f"{headline} {value:.6g} {sign} {champion_score.value:.6g} for champion "
            f"v{champion.version}, both on this run's validation split"
        )
    if champion.score is None or champion.headline != headline:
        return True, f"champion v{champion.version} has no {headline}"
    better, sign = beats(champion.score)
    return better, f"{headline} {value:.6g} {sign} champion v{champion.version} {champion.score:.6g}"


def current_champion(client: MlflowClient, name: str) -> Champion | None:
    try:
        mv = client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None
    loss = mv.tags.get("val_loss")
    if loss is None and mv.run_id:
        metrics = client.get_run(mv.run_id).data.metrics
        loss = metrics.get("best_val_loss", metrics.get("val_loss"))
    return Champion(
        name=name,
        version=str(mv.version),
        run_id=mv.run_id,
        checkpoint=mv.tags.get("checkpoint"),
        val_loss=None if loss is None else float(loss),
        train_key=mv.tags.get("train.key"),
        splits_key=mv.tags.get("data.splits_key"),
        raw_sha256=mv.tags.get("data.raw_sha256"),
        headline=mv.tags.get("headline"),
        score=float(mv.tags["headline.value"]) if "headline.value" in mv.tags else None,
        files=mv.tags[FILES_TAG].split() if mv.tags.get(FILES_TAG) else None,
    )


def version_trained_on(client: MlflowClient, name: str, train_key: str) -> str | None:
    """The newest version of the model trained with this training key, if any."""
    try:
        found = client.search_model_versions(f"name = '{name}'")
    except MlflowException:
        return None
    same = [int(v.version) for v in found if v.tags.get("train.key") == train_key]
    return str(max(same)) if same else None
