"""vLLM attention backend for the packed low-bit KV cache (thin glue over paged/ and ops/).

Selected for ``--kv-cache-dtype <scheme>`` by the platform hook of :mod:`.patches`, on
vLLM's CPU and CUDA platforms. Modelled on vLLM's ``cpu_attn.py`` (metadata builder /
impl split) and ``turboquant_attn.py`` (a backend that owns its page size via
``customize_spec``). What a layer must not be (MLA, sliding window, ...) is said the
way vLLM asks every backend: ``supports_*`` classmethods, which vLLM's
``validate_configuration`` reads. The math lives in :mod:`vllm_lowbit_kv.paged`, the
packed-attention kernels in :mod:`vllm_lowbit_kv.ops`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from ..config import LowBitKVConfigError
from .stats import ATTENTION_IMPLS, VISUAL
from ..ops import select_implementation
from ..paged import (HeadSplitLayout, PagedLayout, ReadPlan, Staging, StagingAllocator, WritePlan,
                     forward_layer, forward_split_layer,
                     protected_visual)
from ..retrieval_heads import part_implementations
from . import BACKEND_NAME, is_lowbit_dtype
from .eviction import compact_ordered, compacted_rows, forget_requests, layer_read_plan
from .resolve import (SPEC_LAYER_ATTR, device_type, layer_layout, model_dtype, page_layout,
                      resolve, resolve_config, resolve_scheme, retrieval_layers, staging_bytes,
                      staging_slots)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("vllm.lowbit_kv")

#: set to 1 to log staging-slot releases at INFO (tests read it)
LOG_STAGING = os.environ.get("LOWBIT_KV_LOG_STAGING", "0") == "1"


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

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False  # a connector would move packed pages we never told it about

    @classmethod
    def supports_combination(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype,
                             block_size: int | None, *args, **kwargs) -> str | None:
        """Why the configured scheme cannot serve a layer of this head size at the engine's
        block size (None: it can). ``block_size`` is vLLM's only when the user gave one;
        the engine's, set by :func:`~.checks.check_vllm_config`, is what pages get."""
        vllm_config = get_current_vllm_config()
        try:
            scheme, cfg = resolve(vllm_config)
        except LowBitKVConfigError as e:
            return str(e)
        num_layers = (vllm_config.model_config.get_total_num_hidden_layers()
                      if vllm_config.model_config is not None else 1 << 30)
        return "; ".join(cfg.check_model(scheme, head_dim=head_size, num_layers=num_layers,
                                         block_size=vllm_config.cache_config.block_size)) or None

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        """The scheme's page (one sink area per page) when vLLM picks the block size
        (``Platform.update_block_size_for_backend``; the CPU platform never asks)."""
        return resolve_scheme().page_size

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(_group_tokens())]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Without sinks one state = one T-token group of one head (K bytes then V bytes);
        with sinks one state = a whole block of one head (sink area, then the groups); a
        layer with retrieval heads (pages of two formats) has one state per block, all
        heads. The spec names its layer (``SPEC_LAYER_ATTR``, set by our patch of
        ``get_kv_cache_spec``); vLLM's own page-size probes pass none: a plain layer."""
        scheme = resolve_scheme()
        layout = layer_layout(scheme, spec.head_size, spec.num_kv_heads, spec.block_size,
                              model_dtype(), getattr(spec, SPEC_LAYER_ATTR, None))
        if isinstance(layout, HeadSplitLayout):
            return dataclasses.replace(spec, dtype=torch.uint8, tokens_per_state=spec.block_size,
                                       num_head_slots=1, state_content_bytes=layout.page_bytes)
        if layout.sink_bytes == 0:
            return dataclasses.replace(spec, dtype=torch.uint8, tokens_per_state=layout.T,
                                       state_content_bytes=layout.state_bytes)
        return dataclasses.replace(spec, dtype=torch.uint8, tokens_per_state=spec.block_size,
                                   state_content_bytes=layout.head_bytes)

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
    #: rows of evicted requests -> (keep_from, kept length per layer name); see .eviction
    compacted: dict | None = None
    block_table: torch.Tensor | None = None

    def read_for(self, layer_name: str, layout: PagedLayout) -> ReadPlan:
        """The context plan of one layer: per-layer kept lengths of evicted requests."""
        if not self.compacted:
            return self.read
        return layer_read_plan(self.read, self.compacted, layer_name, self.block_table, layout)


#: every live builder, told by the model runner's hook (.patches) about each step
_BUILDERS: "weakref.WeakSet[LowBitKVMetadataBuilder]" = weakref.WeakSet()


def staging_pools() -> list[StagingAllocator]:
    """The staging allocators of this process's builders (one per KV cache group we serve)."""
    return [b.alloc for b in list(_BUILDERS)]


def release_ended_requests(runner, scheduler_output) -> None:
    """Before the runner updates its states: free the staging slots of the requests vLLM
    finished, aborted or preempted (the runner still holds their block ids then), drop
    their eviction records, and run this step's eviction orders."""
    if not _BUILDERS:
        return
    ended = set(scheduler_output.finished_req_ids)
    ended |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
    states = [runner.requests[r] for r in ended if r in runner.requests]
    blocks = {b for state in states for ids in state.block_ids for b in ids}
    if blocks:
        for builder in list(_BUILDERS):
            builder.release_blocks(blocks, ended)
    forget_requests(state.block_ids[0][0] for state in states if state.block_ids[0])
    compact_ordered(runner, scheduler_output, _BUILDERS)


#: modalities whose placeholder tokens are visual tokens to STP
VISUAL_MODALITIES = ("image", "video")


def visual_positions(mm_features) -> torch.Tensor | None:
    """The positions of a request's image and video-frame embeddings (vLLM's placeholder
    ranges, only the positions that receive an embedding), or None for none."""
    runs = []
    for feature in mm_features or ():
        if feature.modality not in VISUAL_MODALITIES:
            continue
        place = feature.mm_position
        pos = torch.arange(place.offset, place.offset + place.length)
        runs.append(pos if place.is_embed is None else pos[place.is_embed.to("cpu", torch.bool)])
    return torch.cat(runs) if runs else None


def record_step_owners(runner) -> None:
    """After the runner updated its states the input batch is in the order of the step's
    rows (reordering included): row r of the next metadata belongs to ``req_ids[r]``,
    whose visual token positions it also records."""
    if _BUILDERS:
        owners = list(runner.input_batch.req_ids[:runner.input_batch.num_reqs])
        visual = [visual_positions(runner.requests[r].mm_features) for r in owners]
        for builder in list(_BUILDERS):
            builder.step_owners = owners
            builder.step_visual = visual


class LowBitKVMetadataBuilder(AttentionMetadataBuilder[LowBitKVMetadata]):
    """Per step, once for all layers: the staging bookkeeping and each request's context."""

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str],
                 vllm_config: "VllmConfig", device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        scheme = resolve_scheme(vllm_config)
        self.layout = page_layout(scheme, kv_cache_spec.head_size, kv_cache_spec.num_kv_heads,
                                  kv_cache_spec.block_size, vllm_config.model_config.dtype)
        self.alloc = StagingAllocator(staging_slots(vllm_config), self.layout.T,
                                      self.layout.sink_tokens,
                                      scheme.residual_tokens // self.layout.T,
                                      scheme.leading_tokens // self.layout.T)
        from vllm.model_executor.models.utils import extract_layer_index

        # this group's layers share one page size (layers with retrieval heads have their own)
        pages = layer_layout(scheme, kv_cache_spec.head_size, kv_cache_spec.num_kv_heads,
                             kv_cache_spec.block_size, vllm_config.model_config.dtype,
                             extract_layer_index(layer_names[0]))
        logger.info("lowbit-kv pages: %d bytes per block of %d tokens per layer (%.1f B/token, "
                    "%.3f bits/element); %d layers; staging: %d slots per layer (%d per "
                    "--max-num-seqs: leading window of %d tokens, residual window of %d "
                    "tokens and the partial group), %.1f MiB in all",
                    pages.page_bytes, kv_cache_spec.block_size, pages.bytes_per_token,
                    pages.bits_per_element, len(layer_names), self.alloc.num_slots,
                    scheme.staged_groups, scheme.leading_tokens, scheme.residual_tokens,
                    staging_bytes(vllm_config) / 2**20)
        #: request id and visual token positions of each row of the next step (set by
        #: the runner hook)
        self.step_owners: list[str] = []
        self.step_visual: list[torch.Tensor | None] = []
        #: STP ranks tokens by relevance (else visual tokens are only counted)
        self.protects = scheme.uses_relevance
        _BUILDERS.add(self)

    def release_blocks(self, block_ids, request_ids) -> None:
        freed = self.alloc.release_blocks(block_ids, self.layout.groups_per_block, request_ids)
        if freed or LOG_STAGING:
            (logger.info if LOG_STAGING else logger.debug)(
                "lowbit-kv: freed %d staging slots of ended requests (%d in use)",
                freed, self.alloc.in_use)

    def _count_visual(self, write: WritePlan) -> None:
        """Visual tokens the step encodes, and those STP protects (paged.protected_visual:
        the protected rows go to visual or to text tokens first), sink rows never."""
        candidates = torch.ones_like(write.enc_visual)
        for e, sinks in enumerate(write.enc_sink.tolist()):
            candidates[e, :sinks] = False
        rows = getattr(self.layout.value_codec, "n_protect", 0) if self.protects else 0
        protected = protected_visual(write.enc_visual, rows, self.layout.protect_first, candidates)
        VISUAL.record(int(write.enc_visual.sum()), int(protected.sum()))

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> LowBitKVMetadata:
        cam = common_attn_metadata
        n, R = cam.num_actual_tokens, cam.num_reqs
        known = len(self.step_owners) == R
        write, read = self.alloc.plan_step(
            cam.slot_mapping[:n], cam.seq_lens[:R].tolist(),
            cam.query_start_loc_cpu[:R + 1].tolist(), cam.block_table_tensor[:R],
            self.layout.groups_per_block,
            # without the runner's ids (warm-up runs) rows own nothing: no window is read
            self.step_owners if known else [("row", r) for r in range(R)],
            self.step_visual if known else None)
        if write.enc_visual is not None:
            self._count_visual(write)
        compacted = compacted_rows(cam.block_table_tensor, R)
        return LowBitKVMetadata(num_actual_tokens=n, write=write, read=read, compacted=compacted,
                                block_table=cam.block_table_tensor[:R] if compacted else None)


def _log_implementation(name: str) -> None:
    if name not in ATTENTION_IMPLS:  # once per process; /v1/kv_cache/stats reports the set
        ATTENTION_IMPLS.add(name)
        logger.info("lowbit-kv: packed attention implementation: %s (attention_impl / %s "
                    "choose another)", name, "LOWBIT_KV_ATTENTION_IMPL")


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
        self.scheme = resolve_scheme(vllm_config)
        cfg = resolve_config(vllm_config)
        self.obs_window = cfg.obs_window if self.scheme.uses_relevance else None
        self.reference_arithmetic = cfg.reference_arithmetic
        self.model_dtype = vllm_config.model_config.dtype
        self.T = self.scheme.block_tokens
        device = device_type(vllm_config)
        # decided once, before serving (this may build a kernel): the block size does not
        # change which implementation can read the pages
        self.attention_impl, self.packed_attention = select_implementation(
            page_layout(self.scheme, head_size, num_kv_heads, self.T, self.model_dtype),
            device, cfg.attention_impl, gqa=num_heads // num_kv_heads)
        _log_implementation(self.attention_impl)
        #: the implementation reading the retrieval heads' pages (their own format)
        self.retrieval_attention = None
        if self.scheme.retrieval_heads:
            name, self.retrieval_attention = select_implementation(
                page_layout(self.scheme, head_size, num_kv_heads, self.T, self.model_dtype,
                            retrieval=True), device, cfg.attention_impl,
                gqa=num_heads // num_kv_heads)
            _log_implementation(name)
        # The home of every running sequence's residual window and incomplete last group
        # (and, for STP, their queries), sized once, now: on a GPU vLLM's memory profile,
        # which runs after the model is built, then counts it. It lives where vLLM puts
        # this worker's KV cache (the current device); the first forward checks that.
        self.staging = Staging.allocate(staging_slots(vllm_config), self.T, num_kv_heads,
                                        head_size, self.model_dtype,
                                        num_heads if self.obs_window else None, device=device,
                                        staging_dtype=self.scheme.staging_dtype)
        self._layout: PagedLayout | HeadSplitLayout | None = None
        #: the implementation reading each part of this layer's pages (set with _layout)
        self._part_attention: list = []

    def _layout_for(self, kv_cache: torch.Tensor, layer_name: str) -> PagedLayout | HeadSplitLayout:
        # kv_cache: uint8 [num_blocks, H, N, C] (no sinks) or [num_blocks, H, 1, P], or
        # [num_blocks, 1, 1, page bytes] for a layer with retrieval heads
        if self._layout is None:
            from vllm.model_executor.models.utils import extract_layer_index

            if self.staging.k.device != kv_cache.device:
                raise RuntimeError(f"lowbit-kv: {layer_name}'s KV cache is on {kv_cache.device}, "
                                   f"its staging on {self.staging.k.device}")
            layer = extract_layer_index(layer_name)

            def layout(block_size: int) -> PagedLayout | HeadSplitLayout:
                return layer_layout(self.scheme, self.head_size, self.num_kv_heads, block_size,
                                    self.model_dtype, layer)
            # page bytes = fixed (sink areas) + per group: solve for this cache's groups
            one, two = layout(self.T).page_bytes, layout(2 * self.T).page_bytes
            n_groups = (kv_cache[0].numel() - (2 * one - two)) // (two - one)
            self._layout = layout(n_groups * self.T)
            assert self._layout.page_bytes == kv_cache[0].numel(), (kv_cache.shape,
                                                                    self._layout.page_bytes)
            self._part_attention = part_implementations(
                retrieval_layers().get(layer, ()), self.num_kv_heads, self.packed_attention,
                self.retrieval_attention)
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
        layout = self._layout_for(kv_cache, layer.layer_name)
        key, value, query = key[:n], value[:n], query[:n]
        query = query.view(n, self.num_heads, self.head_size)
        key = key.view(n, self.num_kv_heads, self.head_size)
        value = value.view(n, self.num_kv_heads, self.head_size)
        out = output[:n].view(n, self.num_heads, self.head_size)
        if isinstance(layout, HeadSplitLayout):  # never compacted: eviction is refused
            forward_split_layer(attn_metadata.write, attn_metadata.read, layout, query, key, value,
                                kv_cache, self.staging, self.scale, out, self.obs_window,
                                self._part_attention, self.reference_arithmetic)
            return output
        forward_layer(attn_metadata.write, attn_metadata.read_for(layer.layer_name, layout), layout,
                      query, key, value, kv_cache,
                      self.staging, self.scale, out, self.obs_window, self._part_attention[0],
                      self.reference_arithmetic)
        return output
