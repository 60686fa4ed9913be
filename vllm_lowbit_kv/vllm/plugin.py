"""vLLM general plugin: our scheme names become ``--kv-cache-dtype`` values.

Loaded by vLLM in every process (entry point group ``vllm.general_plugins``, see
pyproject.toml) before argument parsing and before any model is built.
:func:`register` is idempotent and

1. widens vLLM's ``CacheDType`` with the names of :data:`vllm_lowbit_kv.schemes.SCHEMES`
   and maps each to ``torch.uint8`` (:mod:`.patches`);
2. registers our backend as ``AttentionBackendEnum.LOWBIT_KV`` (vLLM's own API);
3. hooks the current platform, CPU or CUDA (:func:`.patches.install_platform_hooks`):
   our dtypes select that backend, every other dtype (auto, bfloat16, fp8, ...) goes to
   the untouched original; when vLLM builds its config, :func:`.checks.check_vllm_config`
   validates ours against the platform and the model (on any other platform it refuses
   them) and logs the effective configuration once;
4. adds the worker method behind ``/v1/kv_cache/stats``.
"""

from __future__ import annotations

import logging

from . import BACKEND_NAME, BACKEND_PATH, patches, scheme_names

logger = logging.getLogger("vllm.lowbit_kv")

_registered = False


def _register_backend() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, BACKEND_PATH)


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm.platforms import current_platform

    names = scheme_names()
    patches.widen_cache_dtype(names)
    patches.register_torch_dtypes(names)
    _register_backend()
    patches.install_platform_hooks(type(current_platform))
    patches.install_worker_stats_method()
    _registered = True
    logger.debug("vllm_lowbit_kv plugin registered kv-cache dtypes %s", names)
