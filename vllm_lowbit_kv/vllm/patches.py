"""Every change this package makes to vLLM's own functions and tables, in one place.

docs/vllm_integration.md ("Patch points") lists each with why and the vLLM version it
was checked against; tests/test_vllm_patches.py fails when vLLM changes one of them.

- ``CacheDType`` (a ``typing.Literal``) and the tables built from it take our names:
  :func:`widen_cache_dtype`, :func:`register_torch_dtypes`;
- the platform's ``get_attn_backend_cls`` and ``check_and_update_config`` (CPU or CUDA,
  the same two wrappers): :func:`install_platform_hooks`;
- the model runner's ``_update_states``, the attention layer's ``get_kv_cache_spec``
  and the CPU worker's ``determine_available_memory``, in processes that selected our
  backend:
  :func:`install_worker_hooks`;
- a new ``WorkerBase`` method for ``/v1/kv_cache/stats``: :func:`install_worker_stats_method`.

Every wrapper passes vLLM's own dtypes (auto, bfloat16, fp8, ...) to the original
untouched. Installing is idempotent.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, get_args

from vllm.platforms.interface import PlatformEnum

from .stats import WORKER_METHOD, worker_snapshot
from . import BACKEND_NAME, BACKEND_PATH, is_lowbit_dtype

if TYPE_CHECKING:
    from vllm.platforms.interface import Platform

logger = logging.getLogger("vllm.lowbit_kv")


def _wrap(owner: type, name: str, make_wrapper: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.<name>`` by ``make_wrapper(original)``, once. A classmethod stays a
    classmethod (``original`` is its function: call it with the class first)."""
    current = inspect.getattr_static(owner, name)
    is_classmethod = isinstance(current, classmethod)
    original = current.__func__ if is_classmethod else current
    if getattr(original, "_lowbit_kv_patch", False):
        return
    wrapper = functools.wraps(original)(make_wrapper(original))
    wrapper._lowbit_kv_patch = True  # type: ignore[attr-defined]
    setattr(owner, name, classmethod(wrapper) if is_classmethod else wrapper)


# ----------------------------------------------------------------------------- dtypes
def widen_cache_dtype(names: list[str]) -> None:
    """Add ``names`` to ``CacheDType`` where vLLM reads it: the ``CacheConfig`` field
    (argparse's choices), the pydantic validators of ``CacheConfig`` and ``VllmConfig``,
    the selector's assertion."""
    import vllm.config.cache as cache_mod
    import vllm.v1.attention.selector as selector
    from pydantic.dataclasses import rebuild_dataclass
    from vllm.config.vllm import VllmConfig
    from vllm.engine import arg_utils

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
    selector.CacheDType = new_literal  # it imported the name: its own reference
    rebuild_dataclass(VllmConfig, force=True)  # it nests CacheConfig's schema
    arg_utils._compute_kwargs.cache_clear()  # argparse kwargs are cached per config class


def register_torch_dtypes(names: list[str]) -> None:
    """Our pages are bytes: the attention layer asks this table for its cache's dtype."""
    import torch
    from vllm.utils import torch_utils

    for n in names:
        torch_utils.STR_DTYPE_TO_TORCH_DTYPE.setdefault(n, torch.uint8)


# ----------------------------------------------------------------------------- platform
def install_platform_hooks(platform: "type[Platform]") -> None:
    """On vLLM's platform class (CPU, CUDA; any other refuses our dtypes at start-up):
    our dtypes select our backend, after vLLM's ``validate_configuration`` of it, and
    the config check of :mod:`.checks` runs where vLLM builds its config."""
    _wrap(platform, "get_attn_backend_cls", _select_our_backend)
    _wrap(platform, "check_and_update_config", _check_our_config)


def _select_our_backend(original: Callable) -> Callable:
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        dtype = attn_selector_config.kv_cache_dtype
        if not is_lowbit_dtype(dtype):
            return original(cls, selected_backend, attn_selector_config, num_heads)
        from .backend import LowBitKVBackend
        from .checks import refusal

        reasons = LowBitKVBackend.validate_configuration(
            device_capability=cls.get_device_capability(), **attn_selector_config._asdict())
        if reasons:
            raise refusal(dtype, "this model", reasons)
        install_worker_hooks(cls)
        logger.info("kv_cache_dtype=%s: using the %s attention backend", dtype, BACKEND_NAME)
        return BACKEND_PATH
    return get_attn_backend_cls


def _check_our_config(original: Callable) -> Callable:
    def check_and_update_config(cls, vllm_config):
        original(cls, vllm_config)
        from .checks import check_vllm_config

        check_vllm_config(vllm_config, cls)
    return check_and_update_config


# ----------------------------------------------------------------------------- worker
def install_worker_hooks(platform: "type[Platform]") -> None:
    """In a process that selected our backend (its workers): the model runner tells our
    metadata builders about each step; on the CPU the KV budget pays for staging (on a
    GPU vLLM's memory profile counts it: it is allocated with the model)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # the CPU runner's base too

    from vllm.model_executor.layers.attention.attention import Attention

    _wrap(GPUModelRunner, "_update_states", _tell_builders)
    _wrap(Attention, "get_kv_cache_spec", _name_spec_layer)
    if platform._enum == PlatformEnum.CPU:
        from vllm.v1.worker.cpu_worker import CPUWorker

        _wrap(CPUWorker, "determine_available_memory", _budget_less_staging)


def _tell_builders(original: Callable) -> Callable:
    """vLLM's scheduler output lists the requests finished (or aborted) since the last
    step and those preempted in this one; the runner still holds their block ids when
    ``_update_states`` starts, and the input batch is in the step's row order when it
    returns. Nothing happens while no builder of ours is alive."""
    def _update_states(self, scheduler_output):
        from .backend import record_step_owners, release_ended_requests

        release_ended_requests(self, scheduler_output)
        result = original(self, scheduler_output)
        record_step_owners(self)
        return result
    return _update_states


def _name_spec_layer(original: Callable) -> Callable:
    """Pages differ between layers when some hold retrieval heads, but vLLM hands our
    ``customize_spec`` the layer's spec alone: the spec an attention layer returns
    carries its layer index (``resolve.SPEC_LAYER_ATTR``)."""
    def get_kv_cache_spec(self, vllm_config):
        from vllm.model_executor.models.utils import extract_layer_index

        from .resolve import SPEC_LAYER_ATTR

        spec = original(self, vllm_config)
        if spec is not None and is_lowbit_dtype(vllm_config.cache_config.cache_dtype):
            object.__setattr__(spec, SPEC_LAYER_ATTR, extract_layer_index(self.layer_name))
        return spec
    return get_kv_cache_spec


def _budget_less_staging(original: Callable) -> Callable:
    """``determine_available_memory`` runs after the model (so our attention layers) is
    built: the budget less the staging bytes, so vLLM's page count, its ``KV cache size:
    N tokens`` and every capacity figure include the staging memory. When staging leaves
    too little for one ``--max-model-len`` request, refuse with the sizes (vLLM's own check
    would only say that the pages' share, rounded to 0.0 GiB, is too small)."""
    def determine_available_memory(self) -> int:
        budget = original(self)
        cfg = self.vllm_config
        if not is_lowbit_dtype(cfg.cache_config.cache_dtype):
            return budget
        from vllm.v1.core.kv_cache_utils import max_memory_usage_bytes

        from .resolve import resolve_scheme, staging_bytes

        staged = staging_bytes(cfg)
        specs = self.get_kv_cache_spec().values()
        # one request's pages plus the null block vLLM's pool keeps back (a block per layer)
        needed = max_memory_usage_bytes(cfg, specs) + sum(s.page_size_bytes for s in specs)
        if budget - staged < needed:
            seqs = cfg.scheduler_config.max_num_seqs
            fits = max(0, (budget - needed) * seqs // staged)
            mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
            raise ValueError(
                f"lowbit-kv: staging (windows and partial group, staging_dtype "
                f"{resolve_scheme(cfg).staging_dtype}) "
                f"for --max-num-seqs {seqs} sequences takes {mib(staged)} of the "
                f"{mib(budget)} KV cache budget, leaving {mib(max(0, budget - staged))} of "
                f"pages, and one request of --max-model-len "
                f"{cfg.model_config.max_model_len} needs {mib(needed)} of them: lower "
                f"--max-num-seqs (at most {fits} fit this budget), raise "
                "VLLM_CPU_KVCACHE_SPACE / --kv-cache-memory-bytes, or lower --max-model-len "
                "or residual_tokens / leading_tokens")
        logger.info("lowbit-kv: KV cache budget %.1f MiB = %.1f MiB of pages + %.1f MiB of "
                    "staging", budget / 2**20, (budget - staged) / 2**20, staged / 2**20)
        return budget - staged
    return determine_available_memory


def install_worker_stats_method() -> None:
    """``WorkerBase.<WORKER_METHOD>``, which the API server's ``/v1/kv_cache/stats`` route
    reaches with ``collective_rpc`` (a new attribute: nothing of vLLM's is replaced)."""
    from vllm.v1.worker.worker_base import WorkerBase

    if not hasattr(WorkerBase, WORKER_METHOD):
        setattr(WorkerBase, WORKER_METHOD, _worker_stats)  # called as worker.<method>()


def _worker_stats(worker) -> dict:
    from .backend import staging_pools

    return worker_snapshot(worker, staging_pools())
