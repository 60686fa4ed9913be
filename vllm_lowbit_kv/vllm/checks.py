"""The start-up check of a vLLM config: one function, :func:`check_vllm_config`.

It runs where vLLM builds its config (the platform's ``check_and_update_config``,
wrapped in :mod:`.patches`): in the API server before anything is spawned, and again
in the engine core. So a configuration we cannot serve correctly stops the server
with the reason before any model is loaded. What vLLM decides per attention layer
(MLA, sliding window, attention type, ...) the backend answers through vLLM's own
``validate_configuration`` (:class:`~.backend.LowBitKVBackend`'s ``supports_*``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import TYPE_CHECKING

import torch

from vllm.platforms.interface import CpuArchEnum, PlatformEnum

from ..codecs.base import ModelIdentity
from ..config import ADDITIONAL_CONFIG_KEY, LowBitKVConfig, LowBitKVConfigError
from .stats import scheme_config
from ..ops import cpu, requested_implementation, unsupported_reason
from ..schemes import KVScheme
from . import BF16_NOTED_ENV, CONFIG_LOGGED_ENV, is_lowbit_dtype, scheme_names
from .eviction import SCHEDULER_CLS, eviction_refusals
from .resolve import device_type, page_layout, resolve, retrieval_layers

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.platforms.interface import Platform

logger = logging.getLogger("vllm.lowbit_kv")

#: the vLLM platforms our backend serves on
SERVING_PLATFORMS = (PlatformEnum.CPU, PlatformEnum.CUDA)


#: vision-language architectures served with packed KV, each with an end-to-end test
#: (tests/test_vllm_multimodal.py); another may attend bidirectionally inside an image
#: (vLLM's mm_prefix_lm models) or place its visual tokens in ways not checked
TESTED_MULTIMODAL = ("Idefics3ForConditionalGeneration",)


def refusal(name: str, what: str, reasons: list[str]) -> ValueError:
    return ValueError(f"--kv-cache-dtype {name} cannot serve {what}: " + "; ".join(reasons)
                      + ". Refusing to start rather than serve wrong outputs.")


def check_vllm_config(vllm_config: "VllmConfig", platform: "type[Platform]") -> None:
    """For our dtypes: validate the lowbit_kv configuration against the platform and the
    model, raising with every reason; set the page size (unless ``--block-size`` is
    given), translate ``skip_layers`` into vLLM's ``kv_cache_dtype_skip_layers`` (those
    layers get the model dtype and vLLM's own attention), name the evicting scheduler
    when eviction is configured; log the effective configuration once per server. For
    vLLM's own dtypes a ``lowbit_kv`` entry is only warned about (eviction is refused).
    For every dtype, a bfloat16 model on a CPU without bf16 matrix multiplies is noted
    once per server (:func:`_note_slow_bf16`)."""
    _note_slow_bf16(vllm_config, platform)
    cache_config = vllm_config.cache_config
    name = cache_config.cache_dtype
    if not is_lowbit_dtype(name):
        _check_unused_lowbit_config(vllm_config)
        _check_float_cache(vllm_config, platform)
        return
    if platform._enum not in SERVING_PLATFORMS:  # what Platform.is_cpu()/is_cuda() read
        raise refusal(name, f"on vLLM's {platform.__name__}", [
            "the lowbit-kv backend runs on vLLM's CPU and CUDA platforms only; a stock "
            "backend here would read packed pages as model-dtype K/V"])
    model_config = vllm_config.model_config
    try:
        scheme, cfg = resolve(vllm_config)
    except LowBitKVConfigError as e:
        raise ValueError(f"--kv-cache-dtype {name}: {e}") from None
    if model_config is None:
        return
    reasons = []
    # vLLM's own flag feeds the same mechanism: numeric entries are merged.
    flag = list(cache_config.kv_cache_dtype_skip_layers or [])
    extra = [x for x in flag if not str(x).isdigit()]
    if extra:
        reasons.append(f"--kv-cache-dtype-skip-layers entries {extra} (use layer indices, or "
                       f"lowbit_kv skip_layers)")
    skip = sorted(set(cfg.skip_layers) | {int(x) for x in flag if str(x).isdigit()})
    if skip != cfg.skip_layers:
        cfg = cfg.model_copy(update={"skip_layers": skip})
    if skip and platform._enum != PlatformEnum.CPU:
        reasons.append(f"skip_layers {skip} off the CPU: vLLM's {platform.__name__} pads mixed "
                       "KV dtypes to one per-token page (_align_heterogeneous_kv_block_size), "
                       "which packed groups cannot express")
    if model_config.is_hybrid or model_config.is_attention_free:
        reasons.append("hybrid / attention-free models (Mamba, linear attention): not supported")
    if model_config.is_encoder_decoder:
        reasons.append("encoder-decoder models: not supported")
    if model_config.use_mla:
        reasons.append("MLA attention: not supported")
    if model_config.is_multimodal_model and model_config.architecture not in TESTED_MULTIMODAL:
        reasons.append(f"multimodal architecture {model_config.architecture}: only "
                       f"{', '.join(TESTED_MULTIMODAL)} is tested with packed KV (its image "
                       "tokens attend causally, as our pages assume)")
    if vllm_config.speculative_config is not None:
        reasons.append("speculative decoding: not supported")
    if scheme.retrieval_heads and platform._enum != PlatformEnum.CPU:
        reasons.append(f"retrieval_heads {scheme.retrieval_heads} off the CPU: pages whose "
                       "heads have two formats are checked with the CPU kernels only so far "
                       "(set retrieval_heads 0)")
    par = vllm_config.parallel_config
    if scheme.retrieval_heads and (getattr(par, "tensor_parallel_size", 1) > 1
                                   or getattr(par, "pipeline_parallel_size", 1) > 1):
        reasons.append(f"retrieval_heads {scheme.retrieval_heads} with tensor/pipeline "
                       "parallelism: the heads are chosen over the whole model, a rank holds "
                       "some of them (not supported yet; set retrieval_heads 0)")
    if not cache_config.user_specified_block_size:
        # the scheme's page (the CPU platform would pick 128): one sink area per page
        cache_config.block_size = scheme.page_size
    num_layers = model_config.get_total_num_hidden_layers()
    head_dim = model_config.get_head_size()
    model = ModelIdentity.of(model_config.model, num_layers, model_config.get_total_num_kv_heads(),
                             head_dim)
    reasons += cfg.check_model(scheme, head_dim=head_dim, num_layers=num_layers,
                               block_size=cache_config.block_size, model=model)
    reasons += eviction_refusals(vllm_config, scheme, cfg)
    if not reasons:
        reasons += _attention_impl_reasons(vllm_config, scheme, cfg, head_dim)
    if not reasons and scheme.retrieval_heads:
        try:  # measured now (once per model, cached), so the workers only read the file
            retrieval_layers(vllm_config)
        except Exception as e:  # noqa: BLE001 - any failure to measure is a refusal
            reasons.append(f"retrieval_heads {scheme.retrieval_heads}: the model's retrieval "
                           f"heads could not be measured with transformers ({e}); set "
                           "retrieval_heads 0")
    if reasons:
        raise refusal(name, model_config.model, reasons)
    if skip:
        cache_config.kv_cache_dtype_skip_layers = [str(i) for i in skip]
    if cfg.eviction is not None:
        vllm_config.scheduler_config.scheduler_cls = SCHEDULER_CLS
    _log_once(vllm_config, scheme, cfg)


def _check_unused_lowbit_config(vllm_config: "VllmConfig") -> None:
    extra = vllm_config.additional_config
    if not (isinstance(extra, dict) and ADDITIONAL_CONFIG_KEY in extra):
        return
    name = vllm_config.cache_config.cache_dtype
    if (extra[ADDITIONAL_CONFIG_KEY] or {}).get("eviction"):
        raise ValueError(
            f"lowbit_kv eviction needs a lowbit-kv --kv-cache-dtype ({', '.join(scheme_names())}): "
            f"vLLM's own attention for --kv-cache-dtype {name} cannot read per-layer "
            "kept lengths. Refusing to start rather than serve wrong outputs.")
    logger.warning("additional_config 'lowbit_kv' is ignored: --kv-cache-dtype %s is not "
                   "a lowbit-kv scheme (%s)", name, ", ".join(scheme_names()))


#: vLLM's 16-bit float cache dtypes
HALF_CACHE_DTYPES = ("float16", "bfloat16")


def _check_float_cache(vllm_config: "VllmConfig", platform: "type[Platform]") -> None:
    """vLLM's CPU attention answers garbage for a float32 model over a 16-bit cache, in stock
    vLLM 0.32 too (``--dtype float32`` with ``--kv-cache-dtype bfloat16`` or ``float16``
    continues "The capital of France is" with punctuation and blank lines; a bfloat16 model
    over a float16 cache answers right): refused with the way out."""
    name, model_config = vllm_config.cache_config.cache_dtype, vllm_config.model_config
    if (platform._enum == PlatformEnum.CPU and name in HALF_CACHE_DTYPES
            and model_config is not None and model_config.dtype == torch.float32):
        raise ValueError(
            f"--kv-cache-dtype {name} with a float32 model: vLLM's CPU attention answers garbage "
            f"for it; use --kv-cache-dtype auto (the model's dtype) or --dtype {name}. "
            "Refusing to start rather than serve wrong outputs.")


def _note_slow_bf16(vllm_config: "VllmConfig", platform: "type[Platform]") -> None:
    """A bfloat16 model on an x86 CPU without AVX-512 BF16: torch multiplies bf16 matrices
    there through its reference kernels, so the model's linear layers take most of every
    request whatever the KV dtype (README, "AVX2 CPUs"). One line per server says so; the
    dtype stays the user's choice."""
    model_config = vllm_config.model_config
    if (platform._enum != PlatformEnum.CPU or model_config is None
            or model_config.dtype != torch.bfloat16
            or platform.get_cpu_architecture() != CpuArchEnum.X86
            or torch.cpu._is_avx512_bf16_supported() or os.environ.get(BF16_NOTED_ENV)):
        return
    os.environ[BF16_NOTED_ENV] = "1"
    logger.info("lowbit-kv: this CPU has no AVX-512 BF16, where torch multiplies bfloat16 "
                "matrices through slow reference kernels: --dtype float32 runs this model's "
                "linear layers several times faster (its uncompressed KV baseline is then "
                "--kv-cache-dtype auto)")


def _attention_impl_reasons(vllm_config: "VllmConfig", scheme: KVScheme, cfg: LowBitKVConfig,
                            head_dim: int) -> list[str]:
    """Why a packed-attention implementation named by the config (or the environment)
    cannot run this scheme on this device; nothing for ``auto``, which takes the first
    that can (on a GPU: cuda, triton, then the PyTorch reference)."""
    try:
        name = requested_implementation(cfg.attention_impl)
    except ValueError as e:
        return [str(e)]
    if name == "auto":
        return []
    model_config = vllm_config.model_config
    kv_heads = model_config.get_num_kv_heads(vllm_config.parallel_config)
    gqa = model_config.get_num_attention_heads(vllm_config.parallel_config) // kv_heads
    reasons = []
    for retrieval in (False, True) if scheme.retrieval_heads else (False,):
        layout = page_layout(scheme, head_dim, kv_heads, scheme.block_tokens, model_config.dtype,
                             retrieval=retrieval)
        reason = unsupported_reason(name, layout, device_type(vllm_config), gqa)
        if reason:
            reasons.append(f"attention_impl {name!r} cannot run here"
                           f"{' (retrieval heads)' if retrieval else ''}: {reason}")
    return reasons


def _kernel_table_bytes(vllm_config: "VllmConfig", scheme: KVScheme, cfg: LowBitKVConfig,
                        head_dim: int, kv_heads: int) -> int:
    """Bytes per packed layer that the C++ kernel keeps beside the codecs' RVQ codebooks,
    where it is the implementation that runs (the CPU, ``auto`` or ``cpp``)."""
    if device_type(vllm_config) != "cpu" or requested_implementation(cfg.attention_impl) not in (
            "auto", "cpp"):
        return 0
    layout = page_layout(scheme, head_dim, kv_heads, scheme.block_tokens,
                         vllm_config.model_config.dtype, layer=0)
    return 0 if cpu.format_reason(layout.format) else cpu.rvq_table_bytes(layout.format)


def _log_once(vllm_config: "VllmConfig", scheme: KVScheme, cfg: LowBitKVConfig) -> None:
    """The effective configuration with its honest bits, then the same as one JSON object
    (what /v1/kv_cache/stats serves as ``scheme``): once per server."""
    cache_config, model_config = vllm_config.cache_config, vllm_config.model_config
    name = cache_config.cache_dtype
    marker = hashlib.sha1(repr((name, cfg, cache_config.block_size)).encode()).hexdigest()[:16]
    if os.environ.get(CONFIG_LOGGED_ENV) == marker:
        return
    os.environ[CONFIG_LOGGED_ENV] = marker
    head_dim = model_config.get_head_size()
    kv_heads = model_config.get_num_kv_heads(vllm_config.parallel_config)
    logger.info(cfg.summary(
        name, scheme, head_dim=head_dim, num_kv_heads=kv_heads,
        num_layers=model_config.get_total_num_hidden_layers(), block_size=cache_config.block_size,
        model_dtype_bytes=torch.empty(0, dtype=model_config.dtype).element_size(),
        kernel_table_bytes=_kernel_table_bytes(vllm_config, scheme, cfg, head_dim, kv_heads)))
    logger.info("lowbit-kv: scheme_config %s", json.dumps(scheme_config(vllm_config),
                                                          sort_keys=True))
