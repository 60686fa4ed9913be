"""The vLLM glue: the only part of the package that imports vLLM.

The compute it drives lives elsewhere and imports no vLLM (:mod:`vllm_lowbit_kv.paged`,
:mod:`vllm_lowbit_kv.ops`, the codecs). One module per job:

    plugin    :func:`~.plugin.register`, the ``vllm.general_plugins`` entry point
    patches   every change to vLLM's own functions and tables, in one place
              (docs/vllm_integration.md lists each with the vLLM version checked)
    checks    the start-up check of a vLLM config that asks for one of our dtypes
    resolve   the scheme, lowbit_kv config and page layout a vLLM config asks for
    backend   the attention backend: Backend, MetadataBuilder, Impl
    eviction  the scheduler and worker sides of KV eviction
    stats     engine-side KV figures for ``/v1/kv_cache/stats`` (staging, evicted pairs)

This module imports no vLLM either: it only names the backend and our dtypes.
"""

from __future__ import annotations

from ..schemes import SCHEMES

#: our member of vLLM's ``AttentionBackendEnum``
BACKEND_NAME = "LOWBIT_KV"
BACKEND_PATH = f"{__name__}.backend.LowBitKVBackend"
#: set in the environment once a server has logged its effective configuration, and its
#: note on bfloat16 models where the CPU has no bf16 matrix multiply (.checks): the engine
#: core vLLM spawns later inherits them and logs nothing again; whoever starts a new
#: server clears them
CONFIG_LOGGED_ENV = "LOWBIT_KV_CONFIG_LOGGED"
BF16_NOTED_ENV = "LOWBIT_KV_BF16_NOTED"
LOGGED_ONCE_ENVS = (CONFIG_LOGGED_ENV, BF16_NOTED_ENV)


def scheme_names() -> list[str]:
    """Our ``--kv-cache-dtype`` values."""
    return sorted(SCHEMES)


def is_lowbit_dtype(kv_cache_dtype: object) -> bool:
    return isinstance(kv_cache_dtype, str) and kv_cache_dtype in SCHEMES
