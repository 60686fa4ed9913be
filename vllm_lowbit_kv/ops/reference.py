"""The PyTorch reference implementation (``torch``): the codecs decode, plain attention.

Runs every page format on any device the tensors are on; every kernel is checked
against :func:`packed_attention_reference`, and :func:`store` (encode with the
codecs, write the states) is what the Triton store kernel must write.
"""

from __future__ import annotations

import torch

from .page_format import PageFormat, PageGeometry, attention_outputs, page_format, rotating

name = "torch"
DEVICE_TYPES = ("cpu", "cuda")


def supports(fmt: PageFormat, device: torch.device | str, gqa: int) -> str | None:
    device = torch.device(device)
    if device.type not in DEVICE_TYPES:
        return f"it runs on {'/'.join(DEVICE_TYPES)} devices, not {device.type}"
    return None


@rotating
def packed_attention_reference(query: torch.Tensor, q_start: torch.Tensor, pages: torch.Tensor,
                               page: PageFormat | PageGeometry, group_table: torch.Tensor,
                               num_groups: torch.Tensor, skip_tokens: torch.Tensor, scale: float,
                               *, out: torch.Tensor | None = None,
                               lse: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode with the reference codecs, then plain float32 attention (the contract of
    :mod:`vllm_lowbit_kv.ops`)."""
    fmt = page_format(page)
    H, T, D = fmt.H, fmt.T, fmt.D
    G = query.shape[1] // H
    out, lse, nothing = attention_outputs(query, q_start, group_table, out, lse)
    if nothing:
        return out, lse
    out.zero_()
    lse.fill_(float("-inf"))
    bounds = q_start.tolist()
    counts = [int(g) if bounds[r + 1] > bounds[r] else 0 for r, g in enumerate(num_groups.tolist())]
    if not sum(counts):
        return out, lse
    # every request's groups decoded in one call, then split per request
    gids = torch.cat([group_table[r, :g] for r, g in enumerate(counts) if g]).long()
    dk, dv = fmt.decode(fmt.read_states(pages, gids))  # [sum g, T, H, D]
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


attention = packed_attention_reference


def store(k: torch.Tensor, v: torch.Tensor, gids: torch.Tensor, pages: torch.Tensor,
          page: PageFormat | PageGeometry, relevance: torch.Tensor | None = None) -> None:
    """Encode the filled groups K, V ``[E, T, H, D]`` (in codec space: a rotating layout
    rotates them first) with the codecs, on their device, into page states ``gids`` [E];
    ``relevance`` [E, T, H]: STP scores (None: the codecs' fallback)."""
    fmt = page_format(page)
    fmt.write_states(pages, gids, fmt.encode(k, v, relevance))


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
