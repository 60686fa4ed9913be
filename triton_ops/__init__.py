"""Triton kernels over the packed paged KV cache (no vLLM import).

* :func:`quantize_and_store` (:mod:`triton_ops.store`): fused encode of filled
  groups straight into their page states.
* :func:`packed_attention` (:mod:`triton_ops.attention`): paged decode
  attention over packed pages, the contract of :mod:`vllm_lowbit_kv.ops`.
* :func:`unsupported_reason`: None when the kernels read a layout, else why not.

On the CPU they run under ``TRITON_INTERPRET=1`` (how the tests run them).
"""

from .attention import packed_attention
from vllm_lowbit_kv.ops.page_format import page_format, unsupported_reason
from .store import quantize_and_store

__all__ = ["packed_attention", "page_format", "quantize_and_store", "unsupported_reason"]
