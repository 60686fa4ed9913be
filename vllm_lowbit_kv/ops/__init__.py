"""Attention over packed pages and storing into them: one contract, four implementations.

Contract shared by all implementations:

    attention(query, q_start, pages, page, group_table, num_groups, skip_tokens,
              scale, *, out=None, lse=None, rotation=None) -> (out, lse)

* ``query`` [n, Hq, D]: this step's query rows; request r owns rows
  ``q_start[r]:q_start[r+1]`` (``q_start`` int64 [R+1]).
* ``page``: the :class:`~.page_format.PageFormat` of the pages, or a layout it is
  derived from (:func:`~.page_format.page_format`, once per layout object).
* ``pages``: one layer's cache, any view of uint8 ``[num_blocks, H, P]`` laid out
  as the format says.
* ``group_table`` int32/int64 [R, G_max]: request r's encoded groups (global
  group ids, ``gid = block * N + group_in_block``) in token order; only the
  first ``num_groups[r]`` entries are read.
* ``skip_tokens`` [R]: leading token positions of the packed context left
  out (the sink tokens, which are read exactly from the sink area instead).
* Every query row of request r attends to *all* of r's packed tokens (they
  precede this step's tokens, so no causal mask is needed here).
* Returns ``out`` [n, Hq, D] float32 (softmax-weighted values) and ``lse``
  [n, Hq] float32, the natural-log sum of exp(scale * q.k) over the attended
  keys: -inf (and out = 0) for rows with no packed key; ``out``/``lse`` may be
  given (float32, contiguous) to be overwritten. Exact parts (sinks, the staged
  tail, fresh tokens) are attended separately and combined with
  :func:`merge_attention`, so kernels only ever read packed bytes.
* GQA: query head h uses KV head ``h // (Hq // H)``.
* ``rotation`` [D, D] float32 (:mod:`vllm_lowbit_kv.rotation`): the orthonormal ``M``
  the pages' K and V were multiplied by before encoding; the query is read as ``q M``
  and ``out`` returned as ``o Mᵀ``, in the query's own space. The C++ kernel applies it
  as it loads queries and writes rows; the others around their kernels
  (:func:`~.page_format.rotating`).

    store(k, v, gids, pages, page, relevance=None)

encodes the filled groups K, V [E, T, H, D] (in codec space) into their states.

Implementations
---------------
Each satisfies :class:`KernelImplementation` (a module with ``name``,
``supports``, ``attention``, ``store``); :data:`IMPLEMENTATIONS` lists them:

    torch   :mod:`.reference`: decodes with the codecs, then plain attention;
            any format, CPU or CUDA; stores with the codecs
    cpp     :mod:`.cpu`, the C++ kernel of csrc/cpu/ (CPU); stores with the C++ encoder
            (csrc/cpu/encode_states.cpp) where it writes the format, else the codecs
    triton  :mod:`.triton`, Triton kernels for attention and store (CUDA)
    cuda    :mod:`.cuda`, the kernel of csrc/cuda/ (CUDA)

``supports(fmt, device, gqa)`` is None when the implementation runs pages of
``fmt`` with ``gqa`` query heads per KV head on ``device`` (the head size is the
format's ``D``), else the reason; every limit is checked there (it may build a
kernel on first use). :func:`select_implementation` decides once per (page
format, device, GQA): the implementation asked for by name (the
``attention_impl`` field of the lowbit_kv config, else the environment variable
``LOWBIT_KV_ATTENTION_IMPL``), refused with the reason when it cannot run; or,
for ``auto`` (the default), the first that can in :data:`AUTO_ORDER` (fastest
first), the reference last.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from ..codecs.base import require
from . import cpu, cuda, reference, triton
from .page_format import PageFormat, PageGeometry, page_format
from .reference import merge_attention, packed_attention_reference

logger = logging.getLogger("vllm.lowbit_kv.ops")

#: environment variable naming the implementation when the config does not
ENV_VAR = "LOWBIT_KV_ATTENTION_IMPL"
#: ``auto`` tries these in order
AUTO_ORDER = ("cuda", "triton", "cpp", "torch")
CHOICES = ("auto",) + AUTO_ORDER

PackedAttention = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@runtime_checkable
class KernelImplementation(Protocol):
    """One implementation of the contract (see the module doc)."""

    name: str

    def supports(self, fmt: PageFormat, device: torch.device | str, gqa: int) -> str | None: ...

    def attention(self, query: torch.Tensor, q_start: torch.Tensor, pages: torch.Tensor,
                  page: PageFormat | PageGeometry, group_table: torch.Tensor,
                  num_groups: torch.Tensor, skip_tokens: torch.Tensor, scale: float, *,
                  out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                  rotation: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def store(self, k: torch.Tensor, v: torch.Tensor, gids: torch.Tensor, pages: torch.Tensor,
              page: PageFormat | PageGeometry, relevance: torch.Tensor | None = None
              ) -> None: ...


IMPLEMENTATIONS: dict[str, KernelImplementation] = {
    impl.name: impl for impl in (cuda, triton, cpu, reference)}


def unsupported_reason(name: str, page: PageFormat | PageGeometry, device: torch.device | str,
                       gqa: int = 1) -> str | None:
    """None when implementation ``name`` runs ``page`` with ``gqa`` query heads per KV head
    on ``device``, else why not (may build the implementation's kernel on first use)."""
    require(name in IMPLEMENTATIONS, "attention_impl", f"one of {CHOICES}", name)
    require(isinstance(gqa, int) and gqa >= 1, "gqa", "query heads per KV head, an int >= 1",
            gqa)
    return IMPLEMENTATIONS[name].supports(page_format(page), device, gqa)


def implementation(name: str) -> PackedAttention:
    """The attention function of implementation ``name`` (check :func:`unsupported_reason`)."""
    return IMPLEMENTATIONS[name].attention


def requested_implementation(configured: str | None = None) -> str:
    """The configured name, else the environment variable's, else ``auto``; validated."""
    name = configured or os.environ.get(ENV_VAR) or "auto"
    where = "attention_impl" if configured else ENV_VAR
    require(name in CHOICES, where, f"one of {CHOICES}", name)
    return name


@functools.lru_cache(maxsize=None)
def _log_once(message: str) -> None:
    """Log a selection once: every layer of a model selects alike."""
    logger.info(message)


def select_implementation(page: PageFormat | PageGeometry, device: torch.device | str,
                          requested: str | None = None, gqa: int = 1
                          ) -> tuple[str, PackedAttention]:
    """(name, attention function) of the implementation for this page format, device and
    GQA ratio (see the module doc; the store is ``IMPLEMENTATIONS[name].store``). A
    requested implementation that cannot run raises ValueError with the reason; under
    ``auto`` the reasons of skipped ones are logged."""
    fmt = page_format(page)
    name = requested_implementation(requested)
    if name != "auto":
        reason = unsupported_reason(name, fmt, device, gqa)
        if reason:
            raise ValueError(f"attention_impl {name!r} cannot run {fmt.describe()} on {device}"
                             f" with {gqa} query heads per KV head: {reason}")
        return name, implementation(name)
    skipped = []
    for name in AUTO_ORDER:
        reason = unsupported_reason(name, fmt, device, gqa)
        if reason is None:
            if skipped:
                _log_once(f"lowbit-kv: packed attention uses {name!r} ({'; '.join(skipped)})")
            return name, implementation(name)
        skipped.append(f"{name}: {reason}")
    raise ValueError(f"no packed-attention implementation runs on {device}: "
                     + "; ".join(skipped))


def merge_attention_into(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                         lse_b: torch.Tensor, dst: torch.Tensor) -> None:
    """:func:`merge_attention`'s output written into ``dst`` in its dtype: by the C++
    kernel in one pass where it runs (:func:`.cpu.merge_attention_into`), else merged and
    copied."""
    if not cpu.merge_attention_into(out_a, lse_a, out_b, lse_b, dst):
        dst.copy_(merge_attention(out_a, lse_a, out_b, lse_b)[0])


__all__ = ["AUTO_ORDER", "CHOICES", "ENV_VAR", "IMPLEMENTATIONS", "KernelImplementation",
           "PageFormat", "implementation", "merge_attention", "merge_attention_into",
           "packed_attention_reference",
           "page_format", "requested_implementation", "select_implementation",
           "unsupported_reason"]
