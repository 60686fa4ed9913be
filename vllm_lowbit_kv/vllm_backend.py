"""vLLM attention backend for the packed low-bit KV cache (thin glue over paged.py).

Selected by the plugin (vllm_plugin.py) for ``--kv-cache-dtype <scheme>``.
Modelled on vLLM's ``cpu_attn.py`` (metadata builder / impl split) and
``turboquant_attn.py`` (a backend that owns its page size via
``customize_spec``). The math lives in :mod:`vllm_lowbit_kv.paged`.

Scheme parameters beyond the name come from vLLM's additional config:
``--additional-config '{"lowbit_kv": {"bits": 2, "block_tokens": 32}}'``
(validated by :meth:`KVScheme.with_params`, logged once at start-up).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from vllm.config import get_current_vllm_config, get_current_vllm_config_or_none
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from .paged import PagedLayout, ReadPlan, StagingAllocator, WritePlan, apply_writes, paged_attention
from .schemes import KVScheme, get_scheme
from .vllm_plugin import BACKEND_NAME, is_lowbit_dtype

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("vllm.lowbit_kv")

ADDITIONAL_CONFIG_KEY = "lowbit_kv"
#: staging slots beyond max_num_seqs (a safety margin; ended requests free theirs)
STAGING_MARGIN = 8
#: set to 1 to log staging-slot releases at INFO (tests read it)
LOG_STAGING = os.environ.get("LOWBIT_KV_LOG_STAGING", "0") == "1"

_scheme_cache: dict[tuple, KVScheme] = {}
#: the scheme this process resolved last (hooks such as customize_spec run outside
#: vLLM's config context; one process serves one engine config)
_last_scheme: KVScheme | None = None


def resolve_scheme(vllm_config: "VllmConfig | None" = None) -> KVScheme:
    """The scheme named by ``cache_config.cache_dtype`` with additional-config overrides."""
    global _last_scheme
    vllm_config = vllm_config or get_current_vllm_config_or_none()
    if vllm_config is None:
        if _last_scheme is None:
            raise RuntimeError("lowbit-kv: no vLLM config in scope and no scheme resolved yet")
        return _last_scheme
    name = vllm_config.cache_config.cache_dtype
    params = dict((vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY, {}) or {})
    key = (name, tuple(sorted((k, repr(v)) for k, v in params.items())))
    if key not in _scheme_cache:
        scheme = get_scheme(name)
        if params:
            scheme = scheme.with_params(**params)
        _scheme_cache[key] = scheme
        logger.info("lowbit-kv scheme %s: %s; key %s, value %s, block_tokens=%d, sink_tokens=%d",
                    name, scheme.summary, scheme.key, scheme.value, scheme.block_tokens,
                    scheme.sink_tokens)
    _last_scheme = _scheme_cache[key]
    return _last_scheme


def staging_slots(vllm_config: "VllmConfig") -> int:
    return int(vllm_config.scheduler_config.max_num_seqs) + STAGING_MARGIN


def check_servable(sel) -> None:
    """Refuse, with the reason, every layer configuration this backend was not built for.

    ``sel`` is vLLM's AttentionSelectorConfig for one attention layer.
    """
    name = sel.kv_cache_dtype
    reasons = []
    if sel.use_mla:
        reasons.append("MLA attention")
    if sel.use_sparse:
        reasons.append("sparse attention")
    if sel.has_sliding_window:
        reasons.append("sliding-window attention")
    if sel.has_sink:
        reasons.append("learned attention sinks")
    if sel.use_mm_prefix:
        reasons.append("multimodal prefix-LM attention")
    if sel.attn_type != AttentionType.DECODER:
        reasons.append(f"attention type {sel.attn_type} (encoder / encoder-decoder)")
    if sel.use_non_causal:
        reasons.append("non-causal attention")
    if sel.use_kv_connector:
        reasons.append("KV connectors / disaggregated prefill")
    if sel.use_pcp or sel.use_dcp:
        reasons.append("context parallelism")
    if sel.use_rswa:
        reasons.append("R-SWA")
    if sel.use_per_head_quant_scales:
        reasons.append("checkpoint KV-cache quantization scales")
    if sel.dtype not in LowBitKVBackend.supported_dtypes:
        reasons.append(f"model dtype {sel.dtype}")
    vllm_config = get_current_vllm_config()
    cache_config = vllm_config.cache_config
    if cache_config.kv_cache_dtype_skip_layers:
        reasons.append("--kv-cache-dtype-skip-layers (use the scheme's own skip settings)")
    if vllm_config.speculative_config is not None:
        reasons.append("speculative decoding")
    scheme = resolve_scheme(vllm_config)
    if scheme.sink_tokens:
        reasons.append(f"sink_tokens={scheme.sink_tokens} (bf16 sinks are not implemented "
                       "in the vLLM backend yet; set sink_tokens=0)")
    if scheme.uses_relevance:
        reasons.append(f"scheme {name} needs STP relevance scores, which the vLLM backend does "
                       "not compute yet")
    try:
        kc, _ = scheme.codecs(sel.head_size)
    except ValueError as e:
        reasons.append(f"head_size {sel.head_size}: {e}")
    else:
        if cache_config.block_size % kc.block_tokens:
            reasons.append(f"--block-size {cache_config.block_size} is not a multiple of the "
                           f"scheme's block_tokens ({kc.block_tokens})")
    if reasons:
        raise ValueError(
            f"--kv-cache-dtype {name} cannot serve this model: " + "; ".join(reasons)
            + ". Refusing to start rather than serve wrong outputs.")


def _group_tokens() -> int:
    try:
        return resolve_scheme().block_tokens
    except Exception:  # no config in scope (e.g. introspection): the registry default
        return 64


class LowBitKVBackend(AttentionBackend):
    # Writes happen inside forward(): they need the step's plan from the metadata.
    forward_includes_kv_cache_update: bool = True
    accept_output_buffer: bool = True

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = []  # see supports_kv_cache_dtype

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        return is_lowbit_dtype(kv_cache_dtype)

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(_group_tokens())]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """One state = one T-token group of one head: K bytes then V bytes."""
        scheme = resolve_scheme()
        kc, vc = scheme.codecs(spec.head_size)
        return dataclasses.replace(spec, dtype=torch.uint8, tokens_per_state=kc.block_tokens,
                                   state_content_bytes=kc.nbytes + vc.nbytes)

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type["LowBitKVImpl"]:
        return LowBitKVImpl

    @staticmethod
    def get_builder_cls() -> type["LowBitKVMetadataBuilder"]:
        return LowBitKVMetadataBuilder


@dataclass
class LowBitKVMetadata:
    num_actual_tokens: int
    write: WritePlan
    read: ReadPlan


#: every live builder's allocator, told about ended requests by the runner hook
_BUILDERS: "weakref.WeakSet[LowBitKVMetadataBuilder]" = weakref.WeakSet()
_hook_installed = False


def _install_request_end_hook() -> None:
    """Wrap the model runner's ``_update_states`` to free ended requests' staging slots.

    vLLM's scheduler output lists the requests finished (or aborted) since the
    last step and those preempted in this step; the runner still holds their
    block ids when ``_update_states`` starts. Only installed in processes that
    build a LOWBIT_KV backend; it does nothing when no builder is alive.
    """
    global _hook_installed
    if _hook_installed:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._update_states

    def _update_states(self, scheduler_output):
        if _BUILDERS:
            ended = set(scheduler_output.finished_req_ids)
            ended |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
            blocks: set[int] = set()
            for req_id in ended:
                state = self.requests.get(req_id)
                if state is not None:
                    for ids in state.block_ids:
                        blocks.update(ids)
            if blocks:
                for builder in list(_BUILDERS):
                    builder.release_blocks(blocks)
        return original(self, scheduler_output)

    GPUModelRunner._update_states = _update_states
    _hook_installed = True


class LowBitKVMetadataBuilder(AttentionMetadataBuilder[LowBitKVMetadata]):
    """Per step, once for all layers: the staging bookkeeping and each request's context."""

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str],
                 vllm_config: "VllmConfig", device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        scheme = resolve_scheme(vllm_config)
        kc, vc = scheme.codecs(kv_cache_spec.head_size)
        self.layout = PagedLayout(kc, vc, kv_cache_spec.num_kv_heads, kv_cache_spec.block_size)
        self.alloc = StagingAllocator(staging_slots(vllm_config), kc.block_tokens)
        logger.info("lowbit-kv pages: %d bytes per block of %d tokens per layer (%.1f B/token, "
                    "bf16 would be %d); %d staging slots",
                    self.layout.page_bytes, kv_cache_spec.block_size, self.layout.bytes_per_token,
                    2 * kv_cache_spec.num_kv_heads * kv_cache_spec.head_size * 2,
                    self.alloc.num_slots)
        _BUILDERS.add(self)
        _install_request_end_hook()

    def release_blocks(self, block_ids) -> None:
        freed = self.alloc.release_blocks(block_ids, self.layout.groups_per_block)
        if freed:
            (logger.info if LOG_STAGING else logger.debug)("lowbit-kv: freed %d staging slots of ended requests (%d in use)",
                         freed, self.alloc.in_use)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> LowBitKVMetadata:
        cam = common_attn_metadata
        n, R = cam.num_actual_tokens, cam.num_reqs
        write = self.alloc.plan_writes(cam.slot_mapping[:n])
        read = self.alloc.plan_reads(cam.seq_lens[:R].tolist(),
                                     cam.query_start_loc_cpu[:R + 1].tolist(),
                                     cam.block_table_tensor[:R], self.layout.groups_per_block)
        return LowBitKVMetadata(num_actual_tokens=n, write=write, read=read)


class LowBitKVImpl(AttentionImpl[LowBitKVMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None,
                 kv_cache_dtype: str, logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, **kwargs) -> None:
        unsupported = {
            "alibi_slopes": alibi_slopes is not None,
            "sliding_window": sliding_window is not None,
            "logits_soft_cap": bool(logits_soft_cap),
            "kv_sharing_target_layer_name": kv_sharing_target_layer_name is not None,
            "sinks": kwargs.get("sinks") is not None,
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise ValueError(f"--kv-cache-dtype {kv_cache_dtype}: attention layers with "
                             f"{', '.join(bad)} are not supported")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = None
        vllm_config = get_current_vllm_config()
        scheme = resolve_scheme(vllm_config)
        self.key_codec, self.value_codec = scheme.codecs(head_size)
        T = self.key_codec.block_tokens
        S = staging_slots(vllm_config)
        dtype = vllm_config.model_config.dtype
        # The bf16 home of every sequence's incomplete last group, sized once.
        self.stage_k = torch.zeros(S, T, num_kv_heads, head_size, dtype=dtype)
        self.stage_v = torch.zeros_like(self.stage_k)
        self._layout: PagedLayout | None = None

    def _layout_for(self, kv_cache: torch.Tensor) -> PagedLayout:
        # kv_cache: uint8 [num_blocks, H, N, C]; block_size = N * T
        if self._layout is None:
            N = kv_cache.shape[2]
            self._layout = PagedLayout(self.key_codec, self.value_codec, self.num_kv_heads,
                                       N * self.key_codec.block_tokens)
            assert kv_cache.shape[3] == self._layout.state_bytes, (kv_cache.shape,
                                                                   self._layout.state_bytes)
        return self._layout

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: LowBitKVMetadata | None,
                output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by LOWBIT_KV")
        if attn_metadata is None:  # warm-up / profiling
            return output
        n = attn_metadata.num_actual_tokens
        if kv_cache.numel() == 0:
            return output
        layout = self._layout_for(kv_cache)
        key, value, query = key[:n], value[:n], query[:n]
        apply_writes(attn_metadata.write, layout, key, value, kv_cache, self.stage_k, self.stage_v)
        paged_attention(attn_metadata.read, layout, query, key, value, kv_cache, self.stage_k,
                        self.stage_v, self.scale, output[:n])
        return output
