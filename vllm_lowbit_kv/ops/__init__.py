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
"""

from __future__ import annotations

import torch

from ..paged import PagedLayout


def packed_attention_reference(query: torch.Tensor, q_start: torch.Tensor, pages: torch.Tensor,
                               layout: PagedLayout, group_table: torch.Tensor,
                               num_groups: torch.Tensor, skip_tokens: torch.Tensor, scale: float
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode with the reference codecs, then plain float32 attention (see module doc)."""
    n, Hq, D = query.shape
    H, T = layout.H, layout.T
    G = Hq // H
    out = torch.zeros(n, Hq, D, dtype=torch.float32)
    lse = torch.full((n, Hq), float("-inf"), dtype=torch.float32)
    bounds = q_start.tolist()
    for r in range(len(bounds) - 1):
        qs, qe, g = bounds[r], bounds[r + 1], int(num_groups[r])
        skip = int(skip_tokens[r])
        if qe == qs or g * T <= skip:
            continue
        gids = group_table[r, :g].long()
        k, v = layout.decode(layout.read_states(pages, gids))  # [g, T, H, D]
        k = k.reshape(g * T, H, D)[skip:].repeat_interleave(G, dim=1)  # [S, Hq, D]
        v = v.reshape(g * T, H, D)[skip:].repeat_interleave(G, dim=1)
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
