"""The machine a benchmark ran on, as its results record it (CPU model, cores, platform)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (the ISA and speed of a run depend on it)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def describe() -> dict[str, object]:
    """``{"cpu", "cores", "platform"}`` for a result's ``machine`` field."""
    return dict(cpu=cpu_name(), cores=os.cpu_count(), platform=platform.platform())
