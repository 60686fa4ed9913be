"""The vLLM configuration the engine's start-up checks see, built without a server."""

from __future__ import annotations


def vllm_config(model_dir: str, dtype: str, lowbit: dict | None = None, max_model_len: int = 2048,
                model_dtype: str = "auto", **cache_kw):
    """A ``VllmConfig`` of the model at ``model_dir`` with ``--kv-cache-dtype dtype`` and the
    ``lowbit_kv`` fields ``lowbit``, the model in ``model_dtype`` (``--dtype``; our plugin
    registered first, as vLLM loads it):
    building it runs our config checks, which raise on a refused combination."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    from vllm_lowbit_kv.vllm.plugin import register

    register()
    add = {} if lowbit is None else {"lowbit_kv": lowbit}
    return VllmConfig(model_config=ModelConfig(model=model_dir, max_model_len=max_model_len,
                                               dtype=model_dtype),
                      cache_config=CacheConfig(cache_dtype=dtype, **cache_kw),
                      additional_config=add)
