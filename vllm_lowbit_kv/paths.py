"""Where the project caches what it builds or prepares (no imports beyond the stdlib).

Everything lives under one root, ``$VLLM_LOWBIT_KV_CACHE`` when set, else
``$XDG_CACHE_HOME/vllm-lowbit-kv`` (``~/.cache/vllm-lowbit-kv``): the converted
embedded model (:mod:`vllm_lowbit_kv.model`), RVQ codebooks, and the compiled
kernels (:mod:`vllm_lowbit_kv.ops.cpu`).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache root (``cache_dir`` when given)."""
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get("VLLM_LOWBIT_KV_CACHE"):
        return Path(os.environ["VLLM_LOWBIT_KV_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "vllm-lowbit-kv"


def extension_build_root() -> Path:
    """Build folders of the JIT-compiled kernels (one per source, flags and machine)."""
    return cache_root() / "torch_extensions"
