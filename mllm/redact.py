"""Secrets out of everything a person or a file will read: log and error lines, stage metadata,
configs, checkpoints, MLflow and Prefect's parameters all pass `scrub` first."""

from __future__ import annotations

import logging
import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from mllm.settings import environment

_SECRET_ENV = ("KEY", "SECRET", "TOKEN", "PASSWORD", "CREDENTIAL", "AUTH_STRING")
_SECRET_WORDS = ("key", "secret", "token", "password", "passwd", "credential", "credentials")
# Values too short or too common to be a secret: replacing them would garble every text.
_NOT_SECRETS = {"true", "false", "none", "null", "yes", "no", "on", "off"}
_USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.\-]*://)[^\s/@'\"]+@")
_ASSIGNMENT = re.compile(r"\b([A-Za-z_][A-Za-z0-9_.\-]*)(\s*[:=]\s*)([\"']?)([^\s\"',}]+)")
REDACTED = "***"


# A "key" named after a pipeline stage is the digest that names the stage's folder (train.key,
# data.splits_key), printed in clear by the registry and `lineage`: hiding it hides nothing.
_DIGEST_KEYS = ("train", "training", "split", "splits", "tokens", "vocab", "pairs", "generated", "stage", "cache")


def _secret_name(name: str) -> bool:
    """Names like aws_secret_access_key, sessionToken, api-key (not tokenizer, max_new_tokens,
    train.key or data.splits_key)."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(name)).lower()
    words = [w for w in re.split(r"[^a-z0-9]+", spaced) if w]
    if len(words) >= 2 and words[-1] == "key" and words[-2] in _DIGEST_KEYS:
        return any(w.endswith(_SECRET_WORDS) for w in words[:-2])
    return any(w.endswith(_SECRET_WORDS) for w in words)


def _secret_values() -> list[str]:
    values = {
        v
        for k, v in environment().items()
        if any(s in k.upper() for s in _SECRET_ENV) and len(v) >= 4 and v.lower() not in _NOT_SECRETS
    }
    return sorted(values, key=len, reverse=True)  # longest first: one secret may contain another


def _scrub_text(text: str, secrets: list[str]) -> str:
    for value in secrets:
        text = text.replace(value, REDACTED)
    text = _USERINFO.sub(rf"\1{REDACTED}@", text)

    def assignment(m: re.Match) -> str:
        # A bare `key=` is a sort key or a dict key far more often than a credential.
        if m.group(1).lower() == "key" or not _secret_name(m.group(1)) or m.group(4) == REDACTED:
            return m.group(0)
        return f"{m.group(1)}{m.group(2)}{m.group(3)}{REDACTED}"

    return _ASSIGNMENT.sub(assignment, text)


def scrub(obj: Any, _secrets: list[str] | None = None) -> Any:
    """`obj` with every secret replaced by "***": values of secret-named environment variables,
    userinfo in URLs, and the values of dict entries named like secrets (storage options)."""
    secrets = _secret_values() if _secrets is None else _secrets
    if isinstance(obj, str):
        return _scrub_text(obj, secrets)
    if isinstance(obj, dict):
        return {
            k: REDACTED if _secret_name(k) and obj[k] not in (None, "") else scrub(v, secrets) for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return [scrub(v, secrets) for v in obj]
    return obj


class ScrubFilter(logging.Filter):
    """A logging filter that scrubs each record's message."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = scrub(record.getMessage()), None
        return True


def strip_userinfo(url: str) -> tuple[str, tuple[str, str] | None]:
    """(the URL without user:password, (user, password) or None): the credential stays in
    memory for the one request that needs it, the URL without it goes everywhere else."""
    parts = urlsplit(url)
    if not (parts.username or parts.password) or "://" not in url:
        return url, None
    return (
        urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2])),
        (parts.username or "", parts.password or ""),
    )
