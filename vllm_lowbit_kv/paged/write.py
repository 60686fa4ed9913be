"""Staging buffers and the writes of a step: encode completed groups into their pages,
copy sink tokens into the sink area, stage the tokens of incomplete groups."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codecs.quant import absmax_int8, require_staging_dtype
from ..ops.cpu import read_staged, stage_rows
from .layout import SINK_RELEVANCE, PagedLayout, mask_sink_rows, rank_protected
from .plan import WritePlan


@dataclass
class StagedTokens:
    """One staged tensor (K or V) [S, T, H, D]: in the model dtype (``scale`` None), or
    int8 codes with a float32 scale [S, T, H, 1] per (token, head)."""

    data: torch.Tensor
    scale: torch.Tensor | None = None

    @classmethod
    def allocate(cls, shape: tuple[int, ...], dtype: torch.dtype, staging_dtype: str,
                 device=None) -> "StagedTokens":
        require_staging_dtype(staging_dtype)
        if staging_dtype == "model":
            return cls(torch.zeros(shape, dtype=dtype, device=device))
        return cls(torch.zeros(shape, dtype=torch.int8, device=device),
                   torch.ones(*shape[:-1], 1, dtype=torch.float32, device=device))

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device) -> "StagedTokens":
        return StagedTokens(self.data.to(device), None if self.scale is None else
                            self.scale.to(device))

    def heads(self, lo: int, hi: int) -> "StagedTokens":
        """A view of KV heads lo..hi-1."""
        return StagedTokens(self.data[:, :, lo:hi], None if self.scale is None else
                            self.scale[:, :, lo:hi])

    def store(self, slot: torch.Tensor, off: torch.Tensor, x: torch.Tensor, rows: torch.Tensor
              ) -> None:
        """Tokens ``x[rows]`` (x [n, H, D]) at (``slot``, ``off``) [len(rows)]."""
        if stage_rows(x, rows, slot, off, self.data, self.scale):  # the C++ op, no copies
            return
        x = x[rows]
        if self.scale is None:
            self.data[slot, off] = x.to(self.data.dtype)
        else:
            self.data[slot, off], self.scale[slot, off] = absmax_int8(x)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """Whole slots ``slots`` [n] -> float32 [n, T, H, D]."""
        return self.read_run(slots.unsqueeze(-1), self.data.shape[1])

    def read_run(self, slots: torch.Tensor, n: int) -> torch.Tensor:
        """The first ``n`` tokens of the runs ``slots`` [..., S] (slot after slot):
        [..., n, H, D] float32."""
        x = read_staged(self.data, self.scale, slots, n)  # the C++ op: one pass
        if x is not None:
            return x
        x = _run(self.data, slots, n).float()
        return x if self.scale is None else x * _run(self.scale, slots, n)


def _run(buf: torch.Tensor, slots: torch.Tensor, n: int) -> torch.Tensor:
    # index_select on whole slots: a row copy each, far cheaper than advanced indexing
    run = buf.flatten(1).index_select(0, slots.flatten().to(buf.device))
    return run.view(*slots.shape[:-1], -1, *buf.shape[2:])[..., :n, :, :]


@dataclass
class Staging:
    """One layer's staging buffers: K, V [S, T, H, D] (:class:`StagedTokens`) and, for STP,
    queries [S, T, Hq, D] in the model dtype."""

    k: StagedTokens
    v: StagedTokens
    q: torch.Tensor | None = None

    @classmethod
    def allocate(cls, num_slots: int, T: int, H: int, D: int, dtype: torch.dtype,
                 num_q_heads: int | None = None, device=None, staging_dtype: str = "model"
                 ) -> "Staging":
        k, v = (StagedTokens.allocate((num_slots, T, H, D), dtype, staging_dtype, device)
                for _ in "kv")
        q = None
        if num_q_heads:
            q = torch.zeros(num_slots, T, num_q_heads, D, dtype=dtype, device=device)
        return cls(k, v, q)

    def heads(self, lo: int, hi: int, query_group: int) -> "Staging":
        """A view of KV heads lo..hi-1 (and their query heads, ``query_group`` per KV head)."""
        return Staging(self.k.heads(lo, hi), self.v.heads(lo, hi), None if self.q is None
                       else self.q[:, :, lo * query_group:hi * query_group])

    def to(self, device) -> "Staging":
        return Staging(self.k.to(device), self.v.to(device),
                       None if self.q is None else self.q.to(device))


def apply_writes(plan: WritePlan, layout: PagedLayout, key: torch.Tensor, value: torch.Tensor,
                 pages: torch.Tensor, staging: Staging, relevance: torch.Tensor | None = None,
                 query: torch.Tensor | None = None) -> None:
    """Write one layer's fresh K/V [tokens, H, D]: encode completed groups and copy sink
    tokens into their sink areas (:func:`encode_groups`), then stage the rest
    (:func:`stage_tokens`). ``relevance`` [E, T, H] for the completed groups (STP);
    ``query`` [tokens, Hq, D] is staged too when ``staging.q`` exists."""
    encode_groups(plan, layout, key, value, pages, staging, relevance)
    stage_tokens(plan, key, value, staging, query)


def encode_groups(plan: WritePlan, layout: PagedLayout, key: torch.Tensor, value: torch.Tensor,
                  pages: torch.Tensor, staging: Staging, relevance: torch.Tensor | None = None,
                  rows: torch.Tensor | None = None, reference_arithmetic: bool = False) -> None:
    """Encode the completed groups ``rows`` (indices into ``plan.enc_gids``, default all;
    ``relevance`` [E, T, H] is indexed the same way) into their pages, and, with all
    rows (``rows`` None), write the step's sink tokens into their sink areas
    (:func:`write_sink_tokens`; a caller encoding in parts writes them itself).

    Runs before :func:`stage_tokens` of the same step: completed groups read their
    earlier tokens from staging slots that this very step may hand to a new group.
    Groups encode on the tensors' device: on the CPU by the C++ encoder where it runs;
    ``reference_arithmetic`` keeps the codecs, the transformers cache's own arithmetic, for
    the engines' float32 parity checks (the C++ encoder may put a code on the other side of
    its threshold, within float32 rounding, which moves the next layers).
    """
    E = plan.enc_gids.numel()
    if rows is None:
        write_sink_tokens(plan, layout, key, value, pages)
    if E == 0 or (rows is not None and rows.numel() == 0):
        return
    tk = _completed_groups(plan, layout.T, key, staging.k)
    tv = _completed_groups(plan, layout.T, value, staging.v)
    if relevance is not None and plan.enc_visual is not None:
        relevance = rank_protected(relevance, plan.enc_visual.to(relevance.device),
                                   layout.protect_first)
    sink_groups, gids = plan.sink_groups, plan.enc_gids
    if rows is not None:
        tk, tv = tk[rows], tv[rows]
        relevance = None if relevance is None else relevance[rows]
        gids = gids[rows.to(gids.device)]
        sink_rows = dict(sink_groups)
        sink_groups = [(i, sink_rows[g]) for i, g in enumerate(rows.tolist()) if g in sink_rows]
    relevance = _mask_sinks(tk, tv, relevance, sink_groups)
    layout.write_states(pages, gids, layout.encode(tk, tv, relevance, cpp=not reference_arithmetic))


def _completed_groups(plan: WritePlan, T: int, x: torch.Tensor, staged: StagedTokens
                      ) -> torch.Tensor:
    """The completed groups' tokens of one of K, V [E, T, H, D], never ``x``'s memory where
    a sink row gets masked (in place): the earlier tokens from their staging slots, the
    fresh ones from ``x`` [tokens, H, D], in float32; a prefill chunk's groups (fresh rows
    back to back, :attr:`WritePlan.enc_run`) as a view of ``x``, in its dtype (a copy where
    they hold sinks), or, where the first continues from staging, copied as two slices."""
    E, (H, D) = plan.enc_gids.numel(), x.shape[1:]
    if plan.enc_run >= 0:
        lead = E * T - plan.enc_tok.numel()  # the first group's rows from its staging slot
        fresh = x[plan.enc_run:plan.enc_run + E * T - lead]
        if lead == 0:
            groups = fresh.unflatten(0, (E, T))
            return groups.clone() if plan.sink_groups else groups
        groups = torch.empty(E * T, H, D, dtype=torch.float32, device=x.device)
        groups[:lead] = staged.read_run(plan.enc_src_slot[:1, None], lead)[0]
        groups[lead:] = fresh
        return groups.unflatten(0, (E, T))
    groups = torch.zeros(E, T, H, D, dtype=torch.float32, device=x.device)
    has = plan.enc_src_slot >= 0
    if bool(has.any()):
        groups[torch.nonzero(has).flatten()] = staged.read(plan.enc_src_slot[has])
    groups.view(E * T, H, D).index_copy_(0, plan.enc_dest.to(x.device),
                                         x[plan.enc_tok].float())
    return groups


def _mask_sinks(tk: torch.Tensor, tv: torch.Tensor, relevance: torch.Tensor | None,
                sink_groups: list[tuple[int, int]]) -> torch.Tensor | None:
    """Groups [G, T, H, D] of which group g's first s rows are sink tokens, for each (g, s)
    of ``sink_groups``: those rows masked (:func:`mask_sink_rows`, in place), and the
    relevance [G, T, H] returned with them at :data:`SINK_RELEVANCE` (a copy; never
    protected)."""
    if sink_groups and relevance is not None:
        relevance = relevance.clone()
    for g, s in sink_groups:
        mask_sink_rows(tk[g], s)
        mask_sink_rows(tv[g], s)
        if relevance is not None:
            relevance[g, :s] = SINK_RELEVANCE
    return relevance


def write_sink_tokens(plan: WritePlan, layout: PagedLayout, key: torch.Tensor,
                      value: torch.Tensor, pages: torch.Tensor) -> None:
    """Copy the step's sink tokens (positions < sink_tokens) into the sink area of their
    sequence's first block, where every read of a sink position looks."""
    if plan.sink_tok.numel():
        layout.write_sinks(pages, plan.sink_block, plan.sink_pos, key[plan.sink_tok],
                           value[plan.sink_tok])


def stage_tokens(plan: WritePlan, key: torch.Tensor, value: torch.Tensor, staging: Staging,
                 query: torch.Tensor | None = None) -> None:
    """Copy the fresh tokens of groups still incomplete into their staging slots."""
    if plan.stage_tok.numel():
        staging.k.store(plan.stage_slot, plan.stage_off, key, plan.stage_tok)
        staging.v.store(plan.stage_slot, plan.stage_off, value, plan.stage_tok)
        if staging.q is not None and query is not None:
            staging.q[plan.stage_slot, plan.stage_off] = query[plan.stage_tok].to(staging.q.dtype)
