"""The CPU this process runs on: its name, its flags, and the environment variables that change
what it computes with (a CPU with AMX told to compute as an AVX2 one does emulates bf16)."""

from __future__ import annotations

import contextlib
import platform
from pathlib import Path

from mllm.settings import CPU_ENV, settings  # noqa: F401 (CPU_ENV: its names, for the tests)

# The variables that change which instructions and kernels torch, oneDNN and MKL use on this CPU
# (under ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 an AMX CPU multiplies bf16 ten times
# slower than float32) key what is measured (the speed cache) and what is trained (the training key).


def cpu_env() -> dict[str, str]:
    """The variables of mllm.settings.CPU_ENV set in this process (empty, as usual, when none is)."""
    return settings().cpu_env()


def cpu_model() -> str:
    """The CPU's name with its family and model numbers: a virtual machine may name only the
    vendor's line ("AMD EPYC"), which tells Zen 4 (family 25) from Zen 5 (26) no more, and the
    two train this project's models at very different speeds (docs/benchmarks.md)."""
    info = _cpuinfo()
    name = info.get("model name") or platform.processor() or platform.machine()
    if info.get("cpu family") and info.get("model"):
        name += f", family {info['cpu family']} model {info['model']}"
    return name


def cpu_flags() -> set[str]:
    return set(_cpuinfo().get("flags", "").split())


def fast_bf16(flags: set[str] | None = None) -> bool:
    """Whether the CPU multiplies bf16 in hardware (Intel AMX, or AVX512-BF16 on Intel and AMD)."""
    flags = cpu_flags() if flags is None else flags
    return bool({"amx_bf16", "avx512_bf16"} & flags)


def matmul_flags() -> list[str]:
    """The CPU flags that decide its matrix-multiply speed, as figures are reported beside them."""
    return sorted(f for f in cpu_flags() if f.startswith(("amx", "avx512_bf16", "avx512f", "avx2")))


def _cpuinfo() -> dict[str, str]:
    info: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if not line.strip():
                break  # the first processor says it for all
            info.setdefault(key.strip(), value.strip())
    return info
