"""Attention over packed pages: the reference every kernel is checked against.

Contract shared by all implementations (PyTorch reference here, the C++ CPU
kernel in csrc/cpu/, Triton in triton_ops/, CUDA in csrc/cuda/):

    packed_attention(query, q_start, pages, layout, group_table, num_groups,
                     skip_tokens, scale) -> (out, lse)

* ``query`` [n, Hq, D]: this step's query rows; request r owns rows
  ``q_start[r]:q_start[r+1]`` (``q_start`` int64 [R+1]).
* ``pages``: one layer's cache, any view of uint8 ``[num_blocks, H, P]``
  laid out by :class:`~vllm_lowbit_kv.paged.PagedLayout`.
* ``group_table`` int32/int64 [R, G_max]: request r's encoded groups (global
  group ids, ``gid = block * N + group_in_block``) in token order; only the
  first ``num_groups[r]`` entries are read.
* ``skip_tokens`` [R]: leading token positions of the packed context left
  out (the sink tokens, which are read exactly from the sink area instead).
* Every query row of request r attends to *all* of r's packed tokens (they
  precede this step's tokens, so no causal mask is needed here).
* Returns ``out`` [n, Hq, D] float32 (softmax-weighted values) and ``lse``
  [n, Hq] float32, the natural-log sum of exp(scale * q.k) over the attended
  keys: -inf (and out = 0) for rows with no packed key. Exact parts (sinks,
  the staged tail, fresh tokens) are attended separately and combined with
  :func:`merge_attention`, so kernels only ever read packed bytes.
* GQA: query head h uses KV head ``h // (Hq // H)``.

Implementations and dispatch
----------------------------
:data:`IMPLEMENTATIONS` lists every implementation of the contract with the
device types it runs on and the module that provides it (imported only when
asked about, so none of them is needed to import this one):

    torch   :func:`packed_attention_reference` (any device; decodes each
            request's groups, then plain attention)
    cpp     :mod:`vllm_lowbit_kv.ops.cpu`, the C++ kernel of csrc/cpu/ (CPU)
    triton  ``triton_ops`` (CUDA)
    cuda    ``vllm_lowbit_kv.ops.cuda``, the kernel of csrc/cuda/ (CUDA)

Each module defines ``packed_attention(...)`` with the signature above and
``unsupported_reason(layout, device)`` (``triton_ops``: ``(layout)``): None
when it can run that layout there, else why not. :func:`select_implementation`
decides once per (layout, device): the implementation asked for by name
(the ``attention_impl`` field of the lowbit_kv config, else the environment
variable ``LOWBIT_KV_ATTENTION_IMPL``), refused with the reason when it cannot
run; or, for ``auto`` (the default), the first that can in
:data:`AUTO_ORDER` (fastest first), the reference last.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..codecs.base import require

if TYPE_CHECKING:
    from ..paged import PagedLayout

logger = logging.getLogger("vllm.lowbit_kv.ops")

#: environment variable naming the implementation when the config does not
ENV_VAR = "LOWBIT_KV_ATTENTION_IMPL"
#: ``auto`` tries these in order
AUTO_ORDER = ("cuda", "triton", "cpp", "torch")
CHOICES = ("auto",) + AUTO_ORDER


@dataclass(frozen=True)
class Implementation:
    name: str
    device_types: tuple[str, ...]
    module: str | None  # None: the reference in this module


IMPLEMENTATIONS: dict[str, Implementation] = {
    "torch": Implementation("torch", ("cpu", "cuda"), None),
    "cpp": Implementation("cpp", ("cpu",), "vllm_lowbit_kv.ops.cpu"),
    "triton": Implementation("triton", ("cuda",), "triton_ops"),
    "cuda": Implementation("cuda", ("cuda",), "vllm_lowbit_kv.ops.cuda"),
}

PackedAttention = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def unsupported_reason(name: str, layout: "PagedLayout", device: torch.device | str
                       ) -> str | None:
    """None when implementation ``name`` can run ``layout`` on ``device``, else why not
    (may build the implementation's kernel on first use)."""
    require(name in IMPLEMENTATIONS, "attention_impl", f"one of {CHOICES}", name)
    impl, device = IMPLEMENTATIONS[name], torch.device(device)
    if device.type not in impl.device_types:
        return f"it runs on {'/'.join(impl.device_types)} devices, not {device.type}"
    if impl.module is None:
        return None
    try:
        module = importlib.import_module(impl.module)
    except ImportError as e:
        return f"{impl.module} cannot be imported ({e})"
    if name == "triton":
        return module.unsupported_reason(layout)
    return module.unsupported_reason(layout, device)


def implementation(name: str) -> PackedAttention:
    """The function of implementation ``name`` (check :func:`unsupported_reason` first)."""
    impl = IMPLEMENTATIONS[name]
    if impl.module is None:
        return packed_attention_reference
    return importlib.import_module(impl.module).packed_attention


def requested_implementation(configured: str | None = None) -> str:
    """The configured name, else the environment variable's, else ``auto``; validated."""
    name = configured or os.environ.get(ENV_VAR) or "auto"
    where = "attention_impl" if configured else ENV_VAR
    require(name in CHOICES, where, f"one of {CHOICES}", name)
    return name


def select_implementation(layout: "PagedLayout", device: torch.device | str,
                          requested: str | None = None) -> tuple[str, PackedAttention]:
    """(name, function) of the packed-attention implementation for this layout and device
    (see the module doc). A requested implementation that cannot run raises ValueError
    with the reason; under ``auto`` the reasons of skipped ones are logged."""
    name = requested_implementation(requested)
    if name != "auto":
        reason = unsupported_reason(name, layout, device)
        if reason:
            raise ValueError(f"attention_impl {name!r} cannot run "
                             f"{type(layout.key_codec).__name__}/"
                             f"{type(layout.value_codec).__name__} pages on {device}: {reason}")
        return name, implementation(name)
    skipped = []
    for name in AUTO_ORDER:
        if torch.device(device).type not in IMPLEMENTATIONS[name].device_types:
            continue
        reason = unsupported_reason(name, layout, device)
        if reason is None:
            if skipped:
                logger.info("lowbit-kv: packed attention uses %r (%s)", name, "; ".join(skipped))
            return name, implementation(name)
        skipped.append(f"{name}: {reason}")
    raise AssertionError("the reference runs everywhere")


def packed_attention_reference(query: torch.Tensor, q_start: torch.Tensor, pages: torch.Tensor,
                               layout: "PagedLayout", group_table: torch.Tensor,
                               num_groups: torch.Tensor, skip_tokens: torch.Tensor, scale: float
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode with the reference codecs, then plain float32 attention (see module doc)."""
    n, Hq, D = query.shape
    H, T = layout.H, layout.T
    G = Hq // H
    out = torch.zeros(n, Hq, D, dtype=torch.float32, device=query.device)
    lse = torch.full((n, Hq), float("-inf"), dtype=torch.float32, device=query.device)
    bounds = q_start.tolist()
    counts = [int(g) if bounds[r + 1] > bounds[r] else 0 for r, g in enumerate(num_groups.tolist())]
    if not sum(counts):
        return out, lse
    # every request's groups decoded in one call, then split per request
    gids = torch.cat([group_table[r, :g] for r, g in enumerate(counts) if g]).long()
    dk, dv = layout.decode_codes(layout.read_states(pages, gids))  # [sum g, T, H, D]
    first = 0
    for r in range(len(bounds) - 1):
        qs, qe, g = bounds[r], bounds[r + 1], counts[r]
        skip = int(skip_tokens[r])
        first += g
        if g * T <= skip:
            continue
        k = dk[first - g:first].reshape(g * T, H, D)[skip:].repeat_interleave(G, dim=1)  # [S, Hq, D]
        v = dv[first - g:first].reshape(g * T, H, D)[skip:].repeat_interleave(G, dim=1)
        scores = torch.einsum("qhd,shd->hqs", query[qs:qe].float(), k) * scale
        row_lse = torch.logsumexp(scores, dim=-1)  # [Hq, q]
        probs = torch.exp(scores - row_lse.unsqueeze(-1))
        out[qs:qe] = torch.einsum("hqs,shd->qhd", probs, v)
        lse[qs:qe] = row_lse.transpose(0, 1)
    return out, lse


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over the union of two disjoint key sets from each part's
    normalized output and log-sum-exp: ``out = (e^lse_a out_a + e^lse_b out_b) / e^lse``.
    Parts with lse = -inf (no keys) contribute nothing."""
    lse = torch.logaddexp(lse_a, lse_b)
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, torch.zeros_like(lse))
    wa = torch.where(finite, torch.exp(lse_a - safe), torch.zeros_like(lse)).unsqueeze(-1)
    wb = torch.where(finite, torch.exp(lse_b - safe), torch.zeros_like(lse)).unsqueeze(-1)
    return wa * out_a + wb * out_b, lse
