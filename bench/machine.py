"""The machine a benchmark ran on, as its results record it (CPU model, cores, platform)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def _cpuinfo(field: str) -> str | None:
    """The value of the first ``field`` line of /proc/cpuinfo (None where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (the ISA and speed of a run depend on it)."""
    return _cpuinfo("model name") or platform.processor() or "cpu"


#: the CPU features the kernels' speed depends on (csrc/cpu: vector width, bf16 products,
#: byte permutes), as /proc/cpuinfo names them
ISA_FLAGS = ("avx2", "avx512f", "avx512vbmi", "avx512_bf16", "avx512_vnni", "amx_tile")


def isa() -> list[str]:
    """Which of :data:`ISA_FLAGS` the CPU has (empty where /proc/cpuinfo is unreadable)."""
    flags = set((_cpuinfo("flags") or "").split())
    return [f for f in ISA_FLAGS if f in flags]


def describe() -> dict[str, object]:
    """``{"cpu", "isa", "cores", "platform"}`` for a result's ``machine`` field."""
    return dict(cpu=cpu_name(), isa=isa(), cores=os.cpu_count(), platform=platform.platform())
