"""Each stage's outputs as Prefect assets keyed by their storage URIs, with what the stage read as
their upstream assets, so that Prefect's events hold the graph `lineage` follows (docs/tracking.md)."""

from __future__ import annotations

import math
import os
from typing import Any, Iterable
from urllib.parse import urlsplit, urlunsplit

from mllm.redact import scrub, strip_userinfo

# Prefect's rules for an asset key (prefect.types.names.validate_valid_asset_key), checked here
# so that a path Prefect cannot take costs its asset, never the stage.
_MAX_KEY = 512
_REFUSED = set("\n\r\t\0 #?&%\"'<>[]{}|\\^`")


def asset_key(url: str) -> str | None:
    """The asset key of a storage URL or local path: the URL without user:password, query or
    fragment, its scheme in lower case; a local path as an absolute file:// URL. None when Prefect
    would refuse it (a character it does not allow, such as a space, or over 512 characters)."""
    if "://" not in url:
        key = "file://" + os.path.abspath(os.path.expanduser(url))
    else:
        parts = urlsplit(strip_userinfo(url)[0])
        key = urlunsplit((parts.scheme.lower(), parts.netloc, parts.path, "", ""))
    key = scrub(key)
    return None if len(key) > _MAX_KEY or _REFUSED & set(key) else key


def _context() -> Any:
    """The running task's AssetContext, or None outside a task run (a stage's `.fn` called
    directly) or on a Prefect without one."""
    try:
        from prefect.context import AssetContext
    except ImportError:  # pragma: no cover (a Prefect without assets)
        return None
    ctx = AssetContext.get()
    return ctx if ctx is not None and hasattr(ctx, "downstream_assets") else None


def materializes(url: str, reads: Iterable[str | None] = (), name: str | None = None) -> str | None:
    """Declare that the running task writes the asset at `url` from the assets at `reads` (its
    inputs' URIs, as the stages that wrote them named them). Returns the key, or None."""
    ctx = _context()
    if ctx is None:
        return None
    key = asset_key(url)
    if key is None:
        from prefect import get_run_logger

        # Debug, not a warning: a storage root with a space would repeat it for every stage of every
        # run, and the lineage through MLflow does not depend on it.
        get_run_logger().debug(
            "%s cannot be a Prefect asset key (it holds a space or another character Prefect "
            "refuses, or is over %d characters): not recorded as an asset",
            scrub(url),
            _MAX_KEY,
        )
        return None
    from prefect.assets import Asset, AssetProperties

    # A name shows beside the key where Prefect lists assets; the upstream assets carry none, so
    # that a reference never renames what another stage named.
    ctx.downstream_assets.add(Asset(key=key, properties=AssetProperties(name=name) if name else None))
    for read in reads:
        if read and (upstream := asset_key(read)) is not None and upstream != key:
            ctx.direct_asset_dependencies.add(Asset(key=upstream))
    # Not handed on to later tasks of the flow run (`ctx.update_tracked_assets()`, as a
    # @materialize task's are): Prefect infers a task's upstream from the identity of the objects
    # it is passed, and a string shared between results (a checkpoint URL in both the training's
    # and the evaluation's result) would make the samples depend on the evaluation report. Each
    # stage names what it reads; nothing else is inferred.
    return key


def describe(url: str, **metadata: Any) -> None:
    """Metadata of an asset the running task named with `materializes`: the materialization
    event's payload. Small facts only (digests, counts); non-finite numbers are left out."""
    ctx = _context()
    key = asset_key(url)
    if ctx is None or key is None or key not in {a.key for a in ctx.downstream_assets}:
        return
    facts = {k: v for k, v in metadata.items() if v is not None and not (isinstance(v, float) and not math.isfinite(v))}
    ctx.add_asset_metadata(key, scrub(facts))
