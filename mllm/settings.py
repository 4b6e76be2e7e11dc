"""The environment variables `mllm` reads, each a typed field with its default and its meaning: the
only place in `mllm` that reads the environment (docs/settings.md is generated from these fields).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from mllm import UserError


class Settings(BaseSettings):
    """Read afresh at each call of `read`: a variable set or changed while a process runs counts."""

    model_config = SettingsConfigDict(extra="ignore", env_ignore_empty=True, case_sensitive=True)

    @classmethod
    def read(cls):
        """The settings as the environment gives them now, or a UserError naming the variable
        that does not parse and what it takes."""
        try:
            return cls()
        except ValidationError as e:
            name = str(e.errors()[0]["loc"][0])
            field = next(f for f in cls.model_fields.values() if f.validation_alias == name)
            fix = (field.json_schema_extra or {}).get("fix") or f"give {field.description}, or unset it"
            raise UserError(f"{name}={os.environ.get(name, '')!r}: {fix}") from None

    @classmethod
    def table(cls) -> list[tuple[str, str, str]]:
        """(variable, default, meaning) of every field the class adds to its parent's, for
        docs/settings.md."""
        inherited = set(cls.__mro__[1].model_fields) if issubclass(cls.__mro__[1], BaseSettings) else set()
        return [
            (f.validation_alias, "" if f.default is None else str(f.default), f.description or "")
            for name, f in cls.model_fields.items()
            if name not in inherited
        ]


CPU_ENV = (
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "ONEDNN_DEFAULT_FPMATH_MODE",
    "DNNL_DEFAULT_FPMATH_MODE",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_CBWR",
    "OPENBLAS_CORETYPE",
)


class MllmSettings(Settings):
    cache_dir: str | None = Field(
        None,
        validation_alias="MLLM_CACHE_DIR",
        description="where measured speeds are kept [$XDG_CACHE_HOME/mllm or ~/.cache/mllm]",
    )
    xdg_cache_home: str | None = Field(
        None, validation_alias="XDG_CACHE_HOME", description="the user's cache folder (freedesktop.org)"
    )
    s3_connect_timeout: float = Field(
        5.0,
        gt=0,
        validation_alias="MLLM_S3_CONNECT_TIMEOUT",
        description="seconds an S3 request waits for a connection",
    )
    s3_read_timeout: float = Field(
        10.0, gt=0, validation_alias="MLLM_S3_READ_TIMEOUT", description="seconds an S3 request waits for a byte"
    )
    aws_endpoint_url_s3: str | None = Field(
        None, validation_alias="AWS_ENDPOINT_URL_S3", description="an S3-compatible store's URL (MinIO, moto)"
    )
    aws_endpoint_url: str | None = Field(
        None, validation_alias="AWS_ENDPOINT_URL", description="as AWS_ENDPOINT_URL_S3, for every AWS service"
    )
    aws_max_attempts: int | None = Field(
        None, ge=1, validation_alias="AWS_MAX_ATTEMPTS", description="botocore's tries of a request, when set [3]"
    )
    aws_retry_mode: str | None = Field(
        None, validation_alias="AWS_RETRY_MODE", description="botocore's retry mode, when set [standard]"
    )
    rank: int = Field(0, ge=0, validation_alias="RANK", description="this process's rank (set by torchrun)")
    local_rank: int = Field(0, ge=0, validation_alias="LOCAL_RANK", description="its rank on this machine (torchrun)")
    world_size: int = Field(1, ge=1, validation_alias="WORLD_SIZE", description="how many processes train (torchrun)")
    # The served model (tasks/tracking/served_model.py) has mllm alone beside it.
    serve_max_new_tokens: int | None = Field(
        None,
        ge=1,
        validation_alias="MLLM_SERVE_MAX_NEW_TOKENS",
        description="the most tokens the served model generates for one prompt [its recipe's]",
        json_schema_extra={"fix": "give a whole number of tokens, 1 or more"},
    )
    cxx: str = Field(
        "g++", validation_alias="CXX", description="the C++ compiler torch.compile's CPU code is built with"
    )

    # What changes which instructions and kernels torch, oneDNN and MKL use on this CPU (the speed
    # cache and the training key take them: mllm/runtime/machine.py).
    aten_cpu_capability: str | None = Field(
        None, validation_alias="ATEN_CPU_CAPABILITY", description="torch's kernels' ISA (avx2, avx512, ...)"
    )
    onednn_max_cpu_isa: str | None = Field(
        None, validation_alias="ONEDNN_MAX_CPU_ISA", description="oneDNN's highest ISA"
    )
    dnnl_max_cpu_isa: str | None = Field(
        None, validation_alias="DNNL_MAX_CPU_ISA", description="as ONEDNN_MAX_CPU_ISA (its older name)"
    )
    onednn_default_fpmath_mode: str | None = Field(
        None, validation_alias="ONEDNN_DEFAULT_FPMATH_MODE", description="oneDNN's implicit down-conversions"
    )
    dnnl_default_fpmath_mode: str | None = Field(
        None, validation_alias="DNNL_DEFAULT_FPMATH_MODE", description="as ONEDNN_DEFAULT_FPMATH_MODE"
    )
    mkl_enable_instructions: str | None = Field(
        None, validation_alias="MKL_ENABLE_INSTRUCTIONS", description="MKL's highest ISA"
    )
    mkl_cbwr: str | None = Field(None, validation_alias="MKL_CBWR", description="MKL's reproducible code path")
    openblas_coretype: str | None = Field(None, validation_alias="OPENBLAS_CORETYPE", description="OpenBLAS's kernels")

    def cpu_env(self) -> dict[str, str]:
        """The variables above that are set, by name (empty, as usual, when none is)."""
        return {
            f.validation_alias: getattr(self, name)
            for name, f in type(self).model_fields.items()
            if f.validation_alias in CPU_ENV and getattr(self, name)
        }

    @property
    def s3_endpoint(self) -> str | None:
        return self.aws_endpoint_url_s3 or self.aws_endpoint_url


def seconds(name: str, default: float, description: str, zero_ok: bool = True):
    """A field of seconds read from `name`: 0 or more (more than 0 unless `zero_ok`), else the one
    line that says what to give."""
    bound = "0 or more" if zero_ok else "more than 0"
    return Field(
        default,
        ge=0,
        gt=None if zero_ok else 0,
        validation_alias=name,
        description=description,
        json_schema_extra={"fix": f"give {description}, {bound}"},
    )


def settings() -> MllmSettings:
    return MllmSettings.read()


def environment() -> dict[str, str]:
    """A copy of the whole environment: what a child process is handed, and where the scrubber
    looks for the values of secrets (mllm/redact.py)."""
    return dict(os.environ)


def export(values: Mapping[str, str | None]) -> dict[str, str | None]:
    """Put `values` in this process's environment (None: unset it), for a library that reads its
    settings there (MLflow's client, CUDA); returns what they were, for `export` to put back."""
    before = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    return before


def export_defaults(values: Mapping[str, str]) -> dict[str, str]:
    """`export` the `values` that are not set yet (the user's own setting wins); returns those set."""
    missing = {k: v for k, v in values.items() if k not in os.environ}
    export(missing)
    return missing


@contextlib.contextmanager
def exported(values: Mapping[str, str | None]) -> Iterator[None]:
    """`values` in the environment while the block runs, the environment as it was after."""
    before = export(values)
    try:
        yield
    finally:
        export(before)
