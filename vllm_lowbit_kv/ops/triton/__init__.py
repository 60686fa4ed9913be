"""The Triton kernels over packed pages, implementation ``triton`` (no vLLM import).

* :func:`attention` (:mod:`.attention_kernel`): paged decode attention over packed pages,
  the contract of :mod:`vllm_lowbit_kv.ops`.
* :func:`store` (:mod:`.store_kernel`): fused encode of filled groups straight into their
  page states, what the reference store writes.
* :func:`supports`: the formats of
  :func:`~vllm_lowbit_kv.ops.page_format.gpu_format_reason`, any number of query
  heads per KV head, on a CUDA device.

This module imports triton only when a kernel is called (the kernel modules import
it), so the package imports without triton. On the CPU the kernels run under
``TRITON_INTERPRET=1`` (how the tests run them, calling the kernel modules directly);
:func:`supports` still says CUDA, so no CPU server picks the interpreter.
``python -m vllm_lowbit_kv.ops.triton.compile_check`` compiles them for GPU targets
without a GPU.
"""

from __future__ import annotations

import importlib.util

import torch

from ..page_format import PageFormat, gpu_format_reason

name = "triton"


def supports(fmt: PageFormat, device: torch.device | str, gqa: int) -> str | None:
    device = torch.device(device)
    if device.type != "cuda":
        return f"the Triton kernels run on CUDA devices, not {device.type}"
    reason = gpu_format_reason(fmt)
    if reason:
        return reason
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    return None


def attention(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`.attention_kernel.packed_attention` (the contract, plus ``num_splits``)."""
    from .attention_kernel import packed_attention

    return packed_attention(*args, **kwargs)


def store(*args, **kwargs) -> None:
    """:func:`.store_kernel.quantize_and_store` (the reference store's arguments and
    ``validate``)."""
    from .store_kernel import quantize_and_store

    quantize_and_store(*args, **kwargs)
