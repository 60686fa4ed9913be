"""vLLM attention backend for the packed low-bit KV cache (thin glue over paged/).

Selected by the plugin (vllm_plugin.py) for ``--kv-cache-dtype <scheme>``.
Modelled on vLLM's ``cpu_attn.py`` (metadata builder / impl split) and
``turboquant_attn.py`` (a backend that owns its page size via
``customize_spec``). The math lives in :mod:`vllm_lowbit_kv.paged`.

Scheme parameters beyond the name come from vLLM's additional config,
``--additional-config '{"lowbit_kv": {...}}'`` (or the launcher's
``--lowbit-config FILE.json``), validated by :class:`~vllm_lowbit_kv.config.LowBitKVConfig`
in :func:`check_vllm_config` (run by the plugin when vLLM builds its config, so
a bad value stops the server before any model is loaded) and logged there once.
"""

from __future__ import annotations

import dataclasses
import hashlib
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

from .codecs.base import ModelIdentity
from .config import ADDITIONAL_CONFIG_KEY, LowBitKVConfig, LowBitKVConfigError
from .ops import requested_implementation, select_implementation, unsupported_reason
from .paged import PagedLayout, ReadPlan, Staging, StagingAllocator, WritePlan, forward_layer
from .schemes import KVScheme
from .vllm_plugin import BACKEND_NAME, is_lowbit_dtype

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("vllm.lowbit_kv")

__all__ = ["ADDITIONAL_CONFIG_KEY", "LowBitKVBackend", "check_servable", "check_vllm_config",
           "resolve_scheme", "staging_slots"]

#: set to 1 to log staging-slot releases at INFO (tests read it)
LOG_STAGING = os.environ.get("LOWBIT_KV_LOG_STAGING", "0") == "1"

_resolved: dict[tuple, tuple[KVScheme, LowBitKVConfig]] = {}
#: what this process resolved last (hooks such as customize_spec run outside
#: vLLM's config context; one process serves one engine config)
_last: tuple[KVScheme, LowBitKVConfig] | None = None
_LOGGED_ENV = "LOWBIT_KV_CONFIG_LOGGED"


def _resolve(vllm_config: "VllmConfig | None" = None) -> tuple[KVScheme, LowBitKVConfig]:
    global _last
    vllm_config = vllm_config or get_current_vllm_config_or_none()
    if vllm_config is None:
        if _last is None:
            raise RuntimeError("lowbit-kv: no vLLM config in scope and no scheme resolved yet")
        return _last
    name = vllm_config.cache_config.cache_dtype
    raw = (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY) \
        if isinstance(vllm_config.additional_config, dict) else None
    key = (name, repr(raw))
    if key not in _resolved:
        cfg = LowBitKVConfig.parse(raw)
        _resolved[key] = (cfg.scheme(name), cfg)
    _last = _resolved[key]
    return _last


def resolve_scheme(vllm_config: "VllmConfig | None" = None) -> KVScheme:
    """The scheme named by ``cache_config.cache_dtype`` with the lowbit_kv overrides,
    as the backend runs it (:meth:`LowBitKVConfig.scheme`)."""
    return _resolve(vllm_config)[0]


def resolve_config(vllm_config: "VllmConfig | None" = None) -> LowBitKVConfig:
    return _resolve(vllm_config)[1]


def staging_slots(vllm_config: "VllmConfig") -> int:
    """Staging slots per layer: the residual window's groups and the partial group of
    every running request (:class:`~vllm_lowbit_kv.paged.StagingAllocator`); the slots of
    ended/preempted requests are returned before the next step."""
    return int(vllm_config.scheduler_config.max_num_seqs) * resolve_scheme(vllm_config).staged_groups


def staging_bytes(vllm_config: "VllmConfig") -> int:
    """Bytes of staging in all packed layers of this worker (K and V, and for STP the
    queries), which come out of the KV cache budget."""
    scheme, cfg = _resolve(vllm_config)
    mc, par = vllm_config.model_config, vllm_config.parallel_config
    rows = 2 * mc.get_num_kv_heads(par)
    if scheme.uses_relevance:  # STP keeps the staged tokens' queries too
        rows += mc.get_num_attention_heads(par)
    layers = mc.get_total_num_hidden_layers() - len(cfg.skip_layers)
    elt = torch.empty(0, dtype=mc.dtype).element_size()
    return (staging_slots(vllm_config) * scheme.block_tokens * rows * mc.get_head_size() * elt
            * layers)


def check_vllm_config(vllm_config: "VllmConfig") -> None:
    """Validate the lowbit_kv configuration against the model, once vLLM has built its
    config (all processes see the result); translate ``skip_layers`` into vLLM's
    ``kv_cache_dtype_skip_layers`` (those layers get the model dtype and vLLM's own
    attention); log the effective configuration once. Raises with the reason."""
    cache_config = vllm_config.cache_config
    name = cache_config.cache_dtype
    model_config = vllm_config.model_config
    try:
        scheme, cfg = _resolve(vllm_config)
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
    if model_config.is_hybrid or model_config.is_attention_free:
        reasons.append("hybrid / attention-free models (Mamba, linear attention): not supported")
    if model_config.is_encoder_decoder:
        reasons.append("encoder-decoder models: not supported")
    if model_config.use_mla:
        reasons.append("MLA attention: not supported")
    if vllm_config.speculative_config is not None:
        reasons.append("speculative decoding: not supported")
    if not cache_config.user_specified_block_size:
        # the scheme's page (vLLM's CPU platform would pick 128): one sink area per page
        cache_config.block_size = scheme.page_size
    num_layers = model_config.get_total_num_hidden_layers()
    head_dim = model_config.get_head_size()
    model = ModelIdentity.of(model_config.model, num_layers, model_config.get_total_num_kv_heads(),
                             head_dim)
    reasons += cfg.check_model(scheme, head_dim=head_dim, num_layers=num_layers,
                               block_size=cache_config.block_size, model=model)
    from . import vllm_eviction
    reasons += vllm_eviction.eviction_refusals(vllm_config, scheme, cfg)
    if not reasons:
        reasons += _attention_impl_reasons(vllm_config, scheme, cfg, head_dim)
    if reasons:
        raise ValueError(f"--kv-cache-dtype {name} cannot serve {model_config.model}: "
                         + "; ".join(reasons) + ". Refusing to start rather than serve wrong outputs.")
    if skip:
        cache_config.kv_cache_dtype_skip_layers = [str(i) for i in skip]
    if cfg.eviction is not None:
        vllm_eviction.install(vllm_config)
    # Once per server: vLLM re-runs this check in the engine-core process it spawns
    # later, which inherits the marker through the environment.
    marker = hashlib.sha1(repr((name, cfg, cache_config.block_size)).encode()).hexdigest()[:16]
    if os.environ.get(_LOGGED_ENV) != marker:
        os.environ[_LOGGED_ENV] = marker
        logger.info(cfg.summary(
            name, scheme, head_dim=head_dim,
            num_kv_heads=model_config.get_num_kv_heads(vllm_config.parallel_config),
            num_layers=num_layers, block_size=cache_config.block_size,
            model_dtype_bytes=torch.empty(0, dtype=model_config.dtype).element_size()))


def _device_type(vllm_config: "VllmConfig") -> str:
    return getattr(getattr(vllm_config, "device_config", None), "device_type", None) or "cpu"


def _attention_impl_reasons(vllm_config: "VllmConfig", scheme: KVScheme, cfg: LowBitKVConfig,
                            head_dim: int) -> list[str]:
    """Why a packed-attention implementation named by the config (or the environment)
    cannot run this scheme on this device; nothing for ``auto``."""
    try:
        name = requested_implementation(cfg.attention_impl)
    except ValueError as e:
        return [str(e)]
    if name == "auto":
        return []
    model_config = vllm_config.model_config
    kv_heads = model_config.get_num_kv_heads(vllm_config.parallel_config)
    layout = _layout(scheme, head_dim, kv_heads, scheme.block_tokens, model_config.dtype)
    gqa = model_config.get_num_attention_heads(vllm_config.parallel_config) // kv_heads
    reason = unsupported_reason(name, layout, _device_type(vllm_config), gqa)
    return [f"attention_impl {name!r} cannot run here: {reason}"] if reason else []


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
    if vllm_config.speculative_config is not None:
        reasons.append("speculative decoding")
    try:
        scheme, cfg = _resolve(vllm_config)
    except LowBitKVConfigError as e:
        reasons.append(str(e))
    else:
        num_layers = (vllm_config.model_config.get_total_num_hidden_layers()
                      if vllm_config.model_config is not None else 1 << 30)
        reasons += cfg.check_model(scheme, head_dim=sel.head_size, num_layers=num_layers,
                                   block_size=cache_config.block_size)
    if reasons:
        raise ValueError(
            f"--kv-cache-dtype {name} cannot serve this model: " + "; ".join(reasons)
            + ". Refusing to start rather than serve wrong outputs.")


def _group_tokens() -> int:
    try:
        return resolve_scheme().block_tokens
    except Exception:  # no config in scope (e.g. introspection): the registry default
        return 64


def _layout(scheme: KVScheme, head_size: int, num_kv_heads: int, block_size: int,
            dtype: torch.dtype, layer: int | None = None) -> PagedLayout:
    """The page layout; codecs with per-layer state (RVQ codebooks) need ``layer`` to
    code, the byte layout is the same for every layer."""
    kc, vc = scheme.codecs(head_size, layer=layer)
    return PagedLayout(kc, vc, num_kv_heads, block_size, scheme.sink_tokens, dtype,
                       scheme.rotation(head_size, layer))


def _model_dtype() -> torch.dtype:
    cfg = get_current_vllm_config_or_none()
    if cfg is not None and cfg.model_config is not None:
        return cfg.model_config.dtype
    return torch.bfloat16


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
        """Without sinks one state = one T-token group of one head (K bytes then V bytes);
        with sinks one state = a whole block of one head (sink area, then the groups)."""
        scheme = resolve_scheme()
        layout = _layout(scheme, spec.head_size, spec.num_kv_heads, spec.block_size, _model_dtype())
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
    #: rows of evicted requests -> (keep_from, kept length per layer name); see vllm_eviction
    compacted: dict | None = None
    block_table: torch.Tensor | None = None

    def read_for(self, layer_name: str, layout: PagedLayout) -> ReadPlan:
        """The context plan of one layer: per-layer kept lengths of evicted requests."""
        if not self.compacted:
            return self.read
        from .vllm_eviction import layer_read_plan
        return layer_read_plan(self.read, self.compacted, layer_name, self.block_table, layout)


#: every live builder's allocator, told about ended requests by the runner hook
_BUILDERS: "weakref.WeakSet[LowBitKVMetadataBuilder]" = weakref.WeakSet()
_hook_installed = False


def _install_request_end_hook() -> None:
    """Wrap the model runner's ``_update_states`` to free ended requests' staging slots
    and to tell the builders whose request each row of the step is.

    vLLM's scheduler output lists the requests finished (or aborted) since the
    last step and those preempted in this step; the runner still holds their
    block ids when ``_update_states`` starts. When it returns, the input batch is
    in the order of the step's rows (reordering included), so ``req_ids`` names
    the owner of each row's staged window. Only installed in processes that build
    a LOWBIT_KV backend; it does nothing when no builder is alive.
    """
    global _hook_installed
    if _hook_installed:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._update_states

    def _release_ended(self, scheduler_output):
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
            from . import vllm_eviction
            vllm_eviction.forget_requests(self.requests[r].block_ids[0][0] for r in ended
                                          if r in self.requests and self.requests[r].block_ids[0])
            vllm_eviction.compact_ordered(self, scheduler_output, _BUILDERS)
        return original(self, scheduler_output)

    def _update_states(self, scheduler_output):
        result = _release_ended(self, scheduler_output)
        if _BUILDERS:  # row r of this step's metadata is input_batch.req_ids[r]
            owners = list(self.input_batch.req_ids[:self.input_batch.num_reqs])
            for builder in list(_BUILDERS):
                builder.step_owners = owners
        return result

    GPUModelRunner._update_states = _update_states
    _hook_installed = True


def _install_budget_hook() -> None:
    """Make the CPU worker's KV budget pay for staging: ``determine_available_memory``
    (run after the model, and so our attention layers, are built) returns the budget
    less :func:`staging_bytes`, so vLLM's page count, its ``KV cache size: N tokens``
    and every capacity figure include the staging memory."""
    from vllm.v1.worker.cpu_worker import CPUWorker

    original = CPUWorker.determine_available_memory
    if getattr(original, "_lowbit_kv_wrapped", False):
        return

    def determine_available_memory(self) -> int:
        budget = original(self)
        if not is_lowbit_dtype(self.vllm_config.cache_config.cache_dtype):
            return budget
        staged = staging_bytes(self.vllm_config)
        if staged >= budget:
            raise ValueError(
                f"lowbit-kv: staging needs {staged / 2**20:.1f} MiB (residual window and partial "
                f"group of --max-num-seqs sequences) but the KV cache budget is only "
                f"{budget / 2**20:.1f} MiB: raise VLLM_CPU_KVCACHE_SPACE / "
                "--kv-cache-memory-bytes or lower --max-num-seqs or residual_tokens")
        logger.info("lowbit-kv: KV cache budget %.1f MiB = %.1f MiB of pages + %.1f MiB of "
                    "staging", budget / 2**20, (budget - staged) / 2**20, staged / 2**20)
        return budget - staged

    determine_available_memory._lowbit_kv_wrapped = True  # type: ignore[attr-defined]
    CPUWorker.determine_available_memory = determine_available_memory


class LowBitKVMetadataBuilder(AttentionMetadataBuilder[LowBitKVMetadata]):
    """Per step, once for all layers: the staging bookkeeping and each request's context."""

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str],
                 vllm_config: "VllmConfig", device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        scheme = resolve_scheme(vllm_config)
        self.layout = _layout(scheme, kv_cache_spec.head_size, kv_cache_spec.num_kv_heads,
                              kv_cache_spec.block_size, vllm_config.model_config.dtype)
        self.alloc = StagingAllocator(staging_slots(vllm_config), self.layout.T,
                                      self.layout.sink_tokens,
                                      scheme.residual_tokens // self.layout.T)
        logger.info("lowbit-kv pages: %d bytes per block of %d tokens per layer (%.1f B/token, "
                    "%.3f bits/element); %d layers; staging: %d slots per layer (%d per "
                    "--max-num-seqs: residual window of %d tokens and the partial group), "
                    "%.1f MiB in all, inside the KV cache budget",
                    self.layout.page_bytes, kv_cache_spec.block_size, self.layout.bytes_per_token,
                    self.layout.bits_per_element, len(layer_names), self.alloc.num_slots,
                    scheme.staged_groups, scheme.residual_tokens,
                    staging_bytes(vllm_config) / 2**20)
        #: request id of each row of the next step (set by the runner hook)
        self.step_owners: list[str] = []
        _BUILDERS.add(self)
        _install_request_end_hook()

    def release_blocks(self, block_ids) -> None:
        freed = self.alloc.release_blocks(block_ids, self.layout.groups_per_block)
        if freed or LOG_STAGING:
            (logger.info if LOG_STAGING else logger.debug)(
                "lowbit-kv: freed %d staging slots of ended requests (%d in use)",
                freed, self.alloc.in_use)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> LowBitKVMetadata:
        cam = common_attn_metadata
        n, R = cam.num_actual_tokens, cam.num_reqs
        write, read = self.alloc.plan_step(
            cam.slot_mapping[:n], cam.seq_lens[:R].tolist(),
            cam.query_start_loc_cpu[:R + 1].tolist(), cam.block_table_tensor[:R],
            self.layout.groups_per_block,
            # without the runner's ids (warm-up runs) rows own nothing: no window is read
            self.step_owners if len(self.step_owners) == R else [("row", r) for r in range(R)])
        from .vllm_eviction import compacted_rows
        compacted = compacted_rows(cam.block_table_tensor, R)
        return LowBitKVMetadata(num_actual_tokens=n, write=write, read=read, compacted=compacted,
                                block_table=cam.block_table_tensor[:R] if compacted else None)


_logged_impls: set[str] = set()


def _log_implementation(name: str) -> None:
    if name not in _logged_impls:
        _logged_impls.add(name)
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
        self.model_dtype = vllm_config.model_config.dtype
        self.T = self.scheme.block_tokens
        # decided once, before serving (this may build the C++ kernel): the block size
        # does not change which implementation can read the pages
        self.attention_impl, self.packed_attention = select_implementation(
            _layout(self.scheme, head_size, num_kv_heads, self.T, self.model_dtype),
            _device_type(vllm_config), cfg.attention_impl, gqa=num_heads // num_kv_heads)
        _log_implementation(self.attention_impl)
        if _device_type(vllm_config) == "cpu":
            _install_budget_hook()
        # The home of every running sequence's residual window and incomplete last
        # group (and, for STP, their queries), sized once.
        self.staging = Staging.allocate(staging_slots(vllm_config), self.T, num_kv_heads,
                                        head_size, self.model_dtype,
                                        num_heads if self.obs_window else None)
        self._layout: PagedLayout | None = None

    def _layout_for(self, kv_cache: torch.Tensor, layer_name: str) -> PagedLayout:
        # kv_cache: uint8 [num_blocks, H, N, C] (no sinks) or [num_blocks, H, 1, P]
        if self._layout is None:
            from vllm.model_executor.models.utils import extract_layer_index

            per_head = kv_cache.shape[2] * kv_cache.shape[3]
            one = _layout(self.scheme, self.head_size, self.num_kv_heads, self.T, self.model_dtype)
            n_groups = (per_head - one.sink_bytes) // one.state_bytes
            self._layout = _layout(self.scheme, self.head_size, self.num_kv_heads,
                                   n_groups * self.T, self.model_dtype,
                                   layer=extract_layer_index(layer_name))
            assert self._layout.head_bytes == per_head, (kv_cache.shape, self._layout.head_bytes)
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
        forward_layer(attn_metadata.write, attn_metadata.read_for(layer.layer_name, layout), layout,
                      query, key, value, kv_cache,
                      self.staging, self.scale, output[:n].view(n, self.num_heads, self.head_size),
                      self.obs_window, self.packed_attention)
        return output
