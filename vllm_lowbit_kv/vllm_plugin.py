"""vLLM general plugin: our scheme names become ``--kv-cache-dtype`` values.

Loaded by vLLM in every process (entry point group ``vllm.general_plugins``,
see pyproject.toml) before argument parsing and before any model is built.
:func:`register` is idempotent and does four things (docs/vllm_integration.md
explains each hook):

1. widens ``vllm.config.cache.CacheDType`` (a ``typing.Literal``) with the
   names in :data:`vllm_lowbit_kv.schemes.SCHEMES`, on the ``CacheConfig``
   dataclass field (argparse choices come from it) and in the pydantic
   validators of ``CacheConfig``/``VllmConfig`` (rebuilt);
2. maps each name to ``torch.uint8`` in ``STR_DTYPE_TO_TORCH_DTYPE`` (the
   attention layer asks for the torch dtype of its cache);
3. registers our backend as ``AttentionBackendEnum.LOWBIT_KV``;
4. wraps ``CpuPlatform.get_attn_backend_cls`` so that our dtypes select that
   backend (after checking the layer is one we can serve), while every other
   dtype (auto, bfloat16, fp8, ...) goes to the untouched original;
5. wraps ``CpuPlatform.check_and_update_config`` (run when vLLM builds its
   config, before any process loads the model) so that for our dtypes the
   ``lowbit_kv`` additional config is validated against the model, its
   ``skip_layers`` become vLLM's ``kv_cache_dtype_skip_layers``, and the
   effective configuration is logged once
   (:func:`vllm_lowbit_kv.vllm_backend.check_vllm_config`), followed by the
   same configuration as one JSON object (``lowbit-kv: scheme_config {...}``,
   :func:`vllm_lowbit_kv.kv_stats.scheme_config`, what ``/v1/kv_cache/stats``
   serves as ``scheme``). Other dtypes are
   untouched (a stray ``lowbit_kv`` entry only draws a warning);
6. on any other platform (CUDA, ROCm, ...), where no backend of ours exists
   yet, refuses our dtypes when vLLM builds its config;
7. adds the worker method :data:`vllm_lowbit_kv.kv_stats.WORKER_METHOD` to
   vLLM's ``WorkerBase``, which the API server's ``/v1/kv_cache/stats`` route
   reaches with ``collective_rpc`` (staging slots, evicted pairs, KV bytes).
"""

from __future__ import annotations

import logging
from typing import Literal, get_args

logger = logging.getLogger("vllm.lowbit_kv")

BACKEND_NAME = "LOWBIT_KV"
BACKEND_PATH = "vllm_lowbit_kv.vllm_backend.LowBitKVBackend"

_registered = False


def scheme_names() -> list[str]:
    from .schemes import SCHEMES

    return sorted(SCHEMES)


def is_lowbit_dtype(kv_cache_dtype: object) -> bool:
    return isinstance(kv_cache_dtype, str) and kv_cache_dtype in scheme_names()


def _widen_cache_dtype(names: list[str]) -> None:
    import vllm.config.cache as cache_mod
    from pydantic.dataclasses import rebuild_dataclass

    old = get_args(cache_mod.CacheDType)
    new_args = tuple(old) + tuple(n for n in names if n not in old)
    if new_args == tuple(old):
        return
    new_literal = Literal[new_args]  # type: ignore[valid-type]
    cache_mod.CacheDType = new_literal
    cls = cache_mod.CacheConfig
    cls.__annotations__["cache_dtype"] = new_literal
    cls.__dataclass_fields__["cache_dtype"].type = new_literal
    rebuild_dataclass(cls, force=True)
    # Modules that imported the name keep their own reference.
    import vllm.v1.attention.selector as selector

    selector.CacheDType = new_literal
    # VllmConfig nests CacheConfig's schema; rebuild it so that validation of
    # a whole config accepts the new names too.
    from vllm.config.vllm import VllmConfig

    rebuild_dataclass(VllmConfig, force=True)
    # argparse kwargs are cached per config class.
    from vllm.engine import arg_utils

    arg_utils._compute_kwargs.cache_clear()


def _register_torch_dtypes(names: list[str]) -> None:
    import torch
    from vllm.utils import torch_utils

    for n in names:
        torch_utils.STR_DTYPE_TO_TORCH_DTYPE.setdefault(n, torch.uint8)


def _register_backend() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, BACKEND_PATH)


def _patch_cpu_platform() -> None:
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.get_attn_backend_cls
    if getattr(original, "_lowbit_kv_wrapped", False):
        return
    orig_func = original.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if not is_lowbit_dtype(attn_selector_config.kv_cache_dtype):
            return orig_func(cls, selected_backend, attn_selector_config, num_heads)
        from .vllm_backend import check_servable

        check_servable(attn_selector_config)
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        logger.info("kv_cache_dtype=%s: using the %s attention backend",
                    attn_selector_config.kv_cache_dtype, BACKEND_NAME)
        return AttentionBackendEnum[BACKEND_NAME].get_path()

    get_attn_backend_cls._lowbit_kv_wrapped = True  # type: ignore[attr-defined]
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)  # type: ignore[assignment]


def _patch_cpu_config_check() -> None:
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config
    if getattr(original, "_lowbit_kv_wrapped", False):
        return
    orig_func = original.__func__

    def check_and_update_config(cls, vllm_config):
        orig_func(cls, vllm_config)
        cache_dtype = vllm_config.cache_config.cache_dtype
        if is_lowbit_dtype(cache_dtype):
            import json
            import os

            from .kv_stats import scheme_config
            from .vllm_backend import _LOGGED_ENV, check_vllm_config

            before = os.environ.get(_LOGGED_ENV)
            check_vllm_config(vllm_config)
            if os.environ.get(_LOGGED_ENV) != before:  # it logged its summary: once per server
                # the object /v1/kv_cache/stats serves as "scheme"
                logger.info("lowbit-kv: scheme_config %s", json.dumps(scheme_config(vllm_config),
                                                                      sort_keys=True))
        elif isinstance(vllm_config.additional_config, dict) and \
                "lowbit_kv" in vllm_config.additional_config:
            if (vllm_config.additional_config["lowbit_kv"] or {}).get("eviction"):
                raise ValueError(
                    f"lowbit_kv eviction needs a lowbit-kv --kv-cache-dtype ({', '.join(scheme_names())}): "
                    f"vLLM's own attention for --kv-cache-dtype {cache_dtype} cannot read per-layer "
                    "kept lengths. Refusing to start rather than serve wrong outputs.")
            logger.warning("additional_config 'lowbit_kv' is ignored: --kv-cache-dtype %s is not "
                           "a lowbit-kv scheme (%s)", cache_dtype, ", ".join(scheme_names()))

    check_and_update_config._lowbit_kv_wrapped = True  # type: ignore[attr-defined]
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[assignment]


def _refuse_other_platforms() -> None:
    """Only the CPU platform has our backend so far: elsewhere (CUDA, ROCm, ...) our
    dtypes would reach a stock backend that cannot read packed pages. Refuse them
    when vLLM builds its config, with the reason."""
    from vllm.platforms import current_platform

    cls = type(current_platform)
    if current_platform.is_cpu() or getattr(cls.check_and_update_config, "_lowbit_kv_wrapped", False):
        return
    orig_func = cls.check_and_update_config.__func__

    def check_and_update_config(klass, vllm_config):
        dtype = vllm_config.cache_config.cache_dtype
        if is_lowbit_dtype(dtype):
            raise ValueError(
                f"--kv-cache-dtype {dtype}: the lowbit-kv attention backend runs on vLLM's CPU "
                f"platform only so far; {cls.__name__} would serve packed pages with a stock "
                "backend (wrong outputs). Refusing to start.")
        return orig_func(klass, vllm_config)

    check_and_update_config._lowbit_kv_wrapped = True  # type: ignore[attr-defined]
    cls.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[assignment]


def _install_worker_stats_method() -> None:
    from vllm.v1.worker.worker_base import WorkerBase

    from .kv_stats import WORKER_METHOD, worker_snapshot

    if not hasattr(WorkerBase, WORKER_METHOD):
        setattr(WorkerBase, WORKER_METHOD, worker_snapshot)  # called as worker.<method>()


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group (idempotent)."""
    global _registered
    if _registered:
        return
    names = scheme_names()
    _widen_cache_dtype(names)
    _register_torch_dtypes(names)
    _register_backend()
    _patch_cpu_platform()
    _patch_cpu_config_check()
    _refuse_other_platforms()
    _install_worker_stats_method()
    _registered = True
    logger.debug("vllm_lowbit_kv plugin registered kv-cache dtypes %s", names)
