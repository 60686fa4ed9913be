"""Write and read planning: from vLLM's slot mapping to the groups each step completes, the
staging slots of partial groups, leading and residual windows, and what every request reads."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..codecs.base import require

logger = logging.getLogger("vllm.lowbit_kv.paged")


@dataclass
class WritePlan:
    """Where this step's fresh K/V tokens go (identical for every layer).

    Tokens are indices into this step's ``key``/``value`` rows.
    """

    # tokens of groups still incomplete after this step -> staging[slot, off]
    stage_tok: torch.Tensor
    stage_slot: torch.Tensor
    stage_off: torch.Tensor
    # groups completed in this step: encoded into their pages
    enc_gids: torch.Tensor  # [E]
    enc_src_slot: torch.Tensor  # [E] slot holding the group's earlier tokens, -1: none
    enc_tok: torch.Tensor  # fresh tokens of completed groups ...
    enc_dest: torch.Tensor  # ... and their row in the groups' [E * T] (group * T + offset)
    enc_req: torch.Tensor  # [E] request (row of the step) owning the group, -1: unknown
    enc_start: torch.Tensor  # [E] position of the group's first token, -1: unknown
    enc_sink: torch.Tensor  # [E] leading rows that are sink tokens (group 0), else 0
    # fresh sink tokens -> sink area of their sequence's first block
    sink_tok: torch.Tensor
    sink_block: torch.Tensor
    sink_pos: torch.Tensor
    # [E, T] bool: visual (image, video-frame) tokens of the completed groups; None: none
    enc_visual: torch.Tensor | None = None
    # the completed groups' fresh tokens are rows [enc_run, enc_run + n) of the step, filling
    # the groups' last n of E T rows in order (a prefill chunk's groups; the first group's
    # E T - n earlier rows, if any, from its staging slot), else -1
    enc_run: int = -1
    _sink_groups: list | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def empty(self) -> bool:
        return self.stage_tok.numel() == 0 and self.enc_gids.numel() == 0

    @property
    def sink_groups(self) -> list[tuple[int, int]]:
        """(group, sink rows) of the completed groups that hold sink tokens (``enc_sink``
        > 0), groups as indices into ``enc_gids``: read at the first layer's call, then
        reused by the step's others."""
        if self._sink_groups is None:
            self._sink_groups = [(g, s) for g, s in enumerate(self.enc_sink.tolist()) if s > 0]
        return self._sink_groups


@dataclass
class ReadPlan:
    """What each request attends to besides its fresh tokens: its context as stored
    before this step's writes."""

    page_gids: torch.Tensor  # [G] encoded groups of all requests, request-major
    page_start: list[int]  # [R+1] request r's groups are page_gids[page_start[r]:page_start[r+1]]
    tail_slot: list[int]  # [R] staging slot holding the partial group in the context, -1: none
    window_slots: list[list[int]]  # [R] slots of the residual window's groups, token order
    lead_slots: list[list[int]]  # [R] slots of the leading window's groups (group 0 on)
    ctx_len: list[int]  # [R] tokens before this step's fresh tokens
    q_start: list[int]  # [R+1] fresh tokens of request r: rows q_start[r]:q_start[r+1]
    first_block: list[int]  # [R] the request's first block (sink area), -1: none
    # the packed context as the packed-attention contract takes it (vllm_lowbit_kv.ops)
    group_table: torch.Tensor  # int64 [R, G_max]: request r's groups, token order
    num_groups: torch.Tensor  # int64 [R]
    skip_tokens: torch.Tensor  # int64 [R]: sink positions read from the sink area instead
    q_start_t: torch.Tensor  # int64 [R+1]: q_start as a tensor
    exact: list["ExactBatch"]  # the exact parts, requests batched by query length
    _packed: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def packed_groups(self, prefill_dense: bool) -> tuple[torch.Tensor, bool]:
        """What the packed part reads: ``num_groups``, or with ``prefill_dense`` (prefill
        chunks read their groups as dense rows, :func:`~.attention.reads_packed_dense`)
        only the single-row requests' (0 for the others), and whether any request reads
        a group. Computed at the first layer's call, then reused by the step's others."""
        if prefill_dense not in self._packed:
            groups = self.num_groups
            if prefill_dense:
                groups = groups * (self.q_start_t.diff() == 1)
            self._packed[prefill_dense] = groups, bool(groups.any())
        return self._packed[prefill_dense]

    @property
    def prefill_only(self) -> bool:
        """Whether every request of the step is a prefill chunk (no decode batch)."""
        return all(b.bias is None for b in self.exact)


@dataclass
class ExactBatch:
    """Requests whose fresh rows attend together to their exact keys: their sinks (sink
    area), the staged run of their context (leading window, residual window, then partial
    group) and their fresh tokens (causal). Planned once per step, used by every layer."""

    requests: list[int]  # [B] the batch's requests (indices into the plan's requests)
    rows: torch.Tensor  # int64 [B, Q]: the fresh rows of each request
    first_rows: torch.Tensor  # int64 [B]: rows[:, 0] (a decode batch's rows), contiguous
    sink_blocks: torch.Tensor  # int64 [B]: first block (sink area) of each request
    sinks: int  # sink positions read per request (the batch's largest skip_tokens)
    tail_slots: torch.Tensor  # int64 [B, S]: staging slots of the staged run, token order
    tail: int  # staged tokens read per request (the batch's largest)
    #: decode batches (Q = 1): float32 [B, sinks + tail + 1], 0 = attend, -inf = not;
    #: None for a prefill chunk (one request: its sinks and tail whole, its rows causal)
    bias: torch.Tensor | None
    #: a prefill chunk's first staged tokens read from the sink area instead (a leading
    #: window's sinks); decode batches mask them in ``bias``
    staged_skip: int = 0


EMPTY_INDEX = torch.empty(0, dtype=torch.long)


def _visual_mask(visual: list[torch.Tensor | None] | None, enc_req: torch.Tensor,
                 enc_start: torch.Tensor, T: int) -> torch.Tensor | None:
    """[E, T] bool: which tokens of each completed group are visual (None: no group has
    one). Every completed group of a request with visual tokens must know its request
    and position: a group encoded without its mask would protect the wrong tokens."""
    if not visual or all(v is None or v.numel() == 0 for v in visual):
        return None
    mask = torch.zeros(enc_req.numel(), T, dtype=torch.bool)
    for e, (r, start) in enumerate(zip(enc_req.tolist(), enc_start.tolist())):
        if r < 0 or start < 0:
            raise RuntimeError("lowbit-kv: a completed group of a step with visual tokens has "
                               "no known request or position; refusing to encode it unmarked")
        if visual[r] is not None:
            mask[e] = torch.isin(torch.arange(start, start + T), visual[r])
    return mask if bool(mask.any()) else None


def _fresh_run(enc_tok: torch.Tensor, enc_dest: torch.Tensor, enc_src_slot: torch.Tensor,
               T: int) -> int:
    """WritePlan.enc_run: the first fresh row when the completed groups' fresh tokens are
    rows back to back filling the groups' last rows in order (only the first group may
    continue from staging: token i fills row E T - n + i of the groups), else -1."""
    n = enc_tok.numel()
    if n == 0 or bool((enc_src_slot[1:] >= 0).any()):
        return -1
    steps = torch.arange(n)
    lead = int(enc_dest[0])  # the first group's rows before its first fresh token
    if lead + n != enc_src_slot.numel() * T or lead >= T or \
            (lead > 0) != bool(enc_src_slot[0] >= 0):
        return -1
    first = int(enc_tok[0])
    return first if torch.equal(enc_dest, steps + lead) and torch.equal(enc_tok, steps + first) \
        else -1


def _empty_write_plan() -> WritePlan:
    return WritePlan(*([EMPTY_INDEX] * 13))


def make_read_plan(table: torch.Tensor, num_groups: torch.Tensor, tail_slot: list[int],
                   ctx_len: list[int], query_start: list[int], first_block: list[int], T: int,
                   sink_tokens: int, window_slots: list[list[int]] | None = None,
                   lead_slots: list[list[int]] | None = None) -> ReadPlan:
    """A :class:`ReadPlan` from each request's packed groups (``table`` int64 [R, G_max] in
    token order, valid up to ``num_groups[r]``), the slots of its leading window's groups
    (read instead of the pages: they precede the packed groups) and of its residual
    window's groups (they follow them), tail and context length; adds the flat group list
    and the batched exact parts. The sink positions come from the sink area once group 0
    is complete: out of the packed groups (``skip_tokens``) or of the leading window
    (its staged run then starts after them)."""
    window_slots = window_slots or [[] for _ in ctx_len]
    lead_slots = lead_slots or [[] for _ in ctx_len]
    valid = torch.arange(table.shape[1]) < num_groups.unsqueeze(1)
    page_start = [0] + torch.cumsum(num_groups, 0).tolist()
    led = torch.tensor([bool(x) for x in lead_slots], dtype=torch.bool)
    skip = torch.clamp(num_groups * T, max=sink_tokens).masked_fill(led, 0)
    lead_skip = torch.zeros_like(skip).masked_fill(led, sink_tokens)  # group 0 staged: complete
    staged = [a + w + ([t] if c % T else [])
              for a, w, t, c in zip(lead_slots, window_slots, tail_slot, ctx_len)]
    exact = plan_exact(query_start, ctx_len, (skip + lead_skip).tolist(), staged, first_block, T,
                       lead_skip.tolist())
    return ReadPlan(table[valid], page_start, list(tail_slot), window_slots, lead_slots,
                    list(ctx_len), list(query_start), list(first_block), table * valid,
                    num_groups, skip, torch.tensor(query_start, dtype=torch.long), exact)


def plan_exact(q_start: list[int], ctx_len: list[int], skip: list[int], staged: list[list[int]],
               first_block: list[int], T: int, staged_skip: list[int] | None = None
               ) -> list[ExactBatch]:
    """The exact parts of one step: all single-row (decode) requests in one batch, every
    multi-row request (a prefill chunk) in its own. ``skip[r]``: sink positions request r
    reads from the sink area; ``staged[r]``: the slots of its staged run (leading window
    groups, residual window groups, then the partial group): ``len * T - (T - ctx % T) % T``
    tokens of its context, the first ``staged_skip[r]`` of them left out (the sinks)."""
    staged_skip = staged_skip or [0] * len(ctx_len)
    q_len = [q_start[r + 1] - q_start[r] for r in range(len(ctx_len))]
    batches = [[r for r, q in enumerate(q_len) if q == 1]]
    batches += [[r] for r, q in enumerate(q_len) if q > 1]
    out = []
    for reqs in batches:
        if not reqs:
            continue
        Q = q_len[reqs[0]]
        rows = torch.tensor([q_start[r] for r in reqs]).unsqueeze(1) + torch.arange(Q)
        sinks = torch.tensor([skip[r] for r in reqs])
        tails = torch.tensor([staged_tokens(staged[r], ctx_len[r], T) for r in reqs])
        after = torch.tensor([staged_skip[r] for r in reqs])
        S, P = int(sinks.max()), int(tails.max())
        slots = torch.zeros(len(reqs), max(max(len(staged[r]) for r in reqs), 1), dtype=torch.long)
        for i, r in enumerate(reqs):
            slots[i, :len(staged[r])] = torch.tensor(staged[r], dtype=torch.long)
        bias = None
        if Q == 1:  # requests of other lengths share the batch: padding masked out
            run = torch.arange(P)
            attend = torch.cat([torch.arange(S) < sinks.unsqueeze(1),
                                (run < tails.unsqueeze(1)) & (run >= after.unsqueeze(1)),
                                torch.ones(len(reqs), 1, dtype=torch.bool)], dim=-1)
            bias = torch.zeros(attend.shape).masked_fill_(~attend, float("-inf"))
        out.append(ExactBatch(
            reqs, rows, rows[:, 0].contiguous(),
            torch.tensor([max(first_block[r], 0) for r in reqs]), S, slots, P, bias,
            int(after[0]) if Q > 1 else 0))
    return out


def staged_tokens(slots: list[int], ctx_len: int, T: int) -> int:
    """Tokens of a staged run of ``slots`` ending at the context's end: whole window
    groups, the last one partial when the context ends inside a group."""
    return len(slots) * T - (T - ctx_len % T) % T if slots else 0


class StagingAllocator:
    """Maps staged groups (gid) to staging slots; bookkeeping only, on the CPU.

    A slot holds one group of one sequence in the model dtype: its partial last
    group, (with ``window_groups = W > 0``) its last W complete groups, the
    residual window, and (with ``lead_groups = A > 0``) its first A complete groups, the
    leading window (attention sinks and a system prompt), which that sequence reads
    instead of their pages. The pages are
    written as groups fill, whatever the window: a cached block is always valid
    packed bytes, so another sequence sharing it through the prefix cache reads the
    pages. A slot records its *owner* (the sequence that wrote it, a key the engine
    gives per request row) and the group's index in that sequence; only the owner
    reads a window slot.

    A slot is taken when a group's first token is written; a complete group keeps
    it while it is among its sequence's first A or last W complete groups, and returns
    it in the step that moves it out of the residual window (or at once); the engine
    returns the slots of finished, aborted and preempted requests (:meth:`release_blocks`,
    by owner: their blocks may already be another sequence's). So
    ``A + W + 1`` slots per running sequence always suffice: a step returns the slots
    it moves out of windows before it hands out new ones. A group restarted at
    offset 0 whose gid still holds a slot (its block's previous owner ended
    unreported) reuses that slot: the new owner writes from offset 0 and reads only
    what it wrote (counted in ``stale_reused``). A group continuing without staged
    tokens, or a full pool, raises.
    """

    def __init__(self, num_slots: int, group_tokens: int, sink_tokens: int = 0,
                 window_groups: int = 0, lead_groups: int = 0):
        require(isinstance(num_slots, int) and num_slots >= 1, "num_slots", "an int >= 1", num_slots)
        for name, value in (("window_groups", window_groups), ("lead_groups", lead_groups)):
            require(isinstance(value, int) and value >= 0, name, "an int >= 0", value)
        self.num_slots, self.T, self.sink_tokens = num_slots, group_tokens, sink_tokens
        self.window_groups, self.lead_groups = window_groups, lead_groups
        self.slot_of: dict[int, int] = {}
        self.gid_of = [-1] * num_slots
        self.owner_of: list = [None] * num_slots
        self.index_of = [-1] * num_slots  # the group's index in its owner's sequence
        self.owned: dict = {}  # owner -> its slots
        self.free = list(range(num_slots - 1, -1, -1))
        self.stale_reused = 0

    @property
    def in_use(self) -> int:
        return self.num_slots - len(self.free)

    def _assign(self, slot: int, gid: int, owner, index: int) -> None:
        self._disown(slot)
        self.slot_of[gid] = slot
        self.gid_of[slot] = gid
        self.owner_of[slot], self.index_of[slot] = owner, index
        self.owned.setdefault(owner, set()).add(slot)

    def _disown(self, slot: int) -> None:
        mine = self.owned.get(self.owner_of[slot])
        if mine is not None:
            mine.discard(slot)
            if not mine:
                del self.owned[self.owner_of[slot]]
        self.owner_of[slot], self.index_of[slot] = None, -1

    def _take(self, gid: int, owner, index: int) -> int:
        if not self.free:
            raise RuntimeError(
                f"lowbit-kv: staging pool exhausted ({self.num_slots} slots, "
                f"{self.lead_groups + self.window_groups + 1} per running request): groups "
                f"{sorted(self.slot_of)[:8]}... hold them. More staged groups than that means "
                "ended requests were not released; refusing to overwrite staged tokens")
        slot = self.free.pop()
        self._assign(slot, gid, owner, index)
        return slot

    def _release(self, gid: int) -> None:
        slot = self.slot_of.pop(gid, None)
        if slot is not None:
            self.gid_of[slot] = -1
            self._disown(slot)
            self.free.append(slot)

    def release_blocks(self, block_ids, groups_per_block: int, owners=None) -> int:
        """Free the slots of the staged groups in these blocks of ended requests
        (``owners``: theirs; None: every slot in the blocks).

        Call before the step is planned. A slot another sequence owns stays: vLLM can
        hand the blocks of a preempted request to another request, which stages tokens
        in them, before the first one ends (its runner state keeps the old block ids).
        """
        ended = None if owners is None else set(owners)
        freed = 0
        for b in block_ids:
            for g in range(b * groups_per_block, (b + 1) * groups_per_block):
                slot = self.slot_of.get(g)
                if slot is not None and (ended is None or self.owner_of[slot] is None
                                         or self.owner_of[slot] in ended):
                    self._release(g)
                    freed += 1
        return freed

    def release_window(self, owner) -> int:
        """Free ``owner``'s complete groups (its leading and residual windows; e.g. its
        pages were rewritten by eviction). Its partial group keeps its slot."""
        done = [self.gid_of[s] for s in self.owned.get(owner, ()) if self.index_of[s] >= 0]
        for gid in done:
            self._release(gid)
        return len(done)

    # -- one step ---------------------------------------------------------------
    def plan_step(self, slot_mapping: torch.Tensor, seq_lens: list[int], query_start: list[int],
                  block_table: torch.Tensor, groups_per_block: int, owners: list | None = None,
                  visual: list[torch.Tensor | None] | None = None) -> tuple[WritePlan, ReadPlan]:
        """Plan one step: the context each request reads (as stored before the step),
        then where the fresh tokens go. ``slot_mapping`` [tokens] (-1 = padding),
        ``seq_lens`` [R], ``query_start`` [R+1], ``block_table`` [R, max_blocks];
        ``owners`` [R]: a key per request row that stays the request's for its life
        (vLLM's request id; default its first block, which prefix caching may share);
        ``visual`` [R]: each request's visual token positions (int64, any order), None
        for a text-only request."""
        R = len(seq_lens)
        bt = block_table.to("cpu", torch.long)[:R]
        if owners is None:
            owners = [("block", int(b)) for b in bt[:, 0].tolist()] if R else []
        read = self.plan_reads(seq_lens, query_start, block_table, groups_per_block, owners)
        n = query_start[-1]
        q_len = torch.tensor(query_start[1:]) - torch.tensor(query_start[:-1])
        req = torch.repeat_interleave(torch.arange(R), q_len)
        ctx = torch.tensor(read.ctx_len, dtype=torch.long)
        positions = ctx[req] + torch.arange(n) - torch.tensor(query_start[:-1])[req]
        write = self.plan_writes(slot_mapping[:n], positions=positions, req=req,
                                 first_block=torch.tensor(read.first_block, dtype=torch.long),
                                 owners=owners, seq_lens=seq_lens, visual=visual)
        return write, read

    def plan_reads(self, seq_lens: list[int], query_start: list[int], block_table: torch.Tensor,
                   groups_per_block: int, owners: list | None = None) -> ReadPlan:
        """The context of every request as stored *before* this step's writes: its
        complete groups from the pages, except its residual window (the last
        ``window_groups`` complete groups it staged itself, read from their slots) and its
        leading window (the first ``lead_groups`` of them, likewise), and its partial
        group from its staging slot. Call before :meth:`plan_writes` of the same step."""
        T, N, W, A = self.T, groups_per_block, self.window_groups, self.lead_groups
        R = len(seq_lens)
        bt = block_table.to("cpu", torch.long)[:R]
        ctx_lens = [L - (query_start[r + 1] - query_start[r]) for r, L in enumerate(seq_lens)]
        n_enc = [c // T for c in ctx_lens]
        first = torch.where(torch.tensor(seq_lens) > 0, bt[:, 0], -1).tolist() if R else []
        # every request's complete groups in token order: [R, G_max], zero-padded
        col = torch.arange(max(n_enc, default=0) + 1)
        table = bt[:, (col // N).clamp(max=max(bt.shape[1] - 1, 0))] * N + col % N \
            if bt.shape[1] else torch.zeros(R, col.numel(), dtype=torch.long)
        tail, window, lead = [], [], []
        for r, ctx in enumerate(ctx_lens):
            slot = -1
            if ctx % T:
                gid = int(table[r, n_enc[r]])
                slot = self.slot_of.get(gid, -1)
                if slot < 0:
                    raise RuntimeError(
                        f"lowbit-kv: request row {r} has {ctx % T} context tokens in group {gid} "
                        "but no staging slot holds them (released or never written); refusing "
                        "to attend to missing tokens")
            tail.append(slot)
            mine = []  # the longest run of its own staged groups ending at its last complete one
            for j in range(n_enc[r] - 1, max(n_enc[r] - W, 0) - 1, -1):
                s = self._own_slot(int(table[r, j]), owners[r], j)
                if s < 0:
                    break
                mine.insert(0, s)
            window.append(mine)
            first_groups = []  # the longest run of its own staged groups from group 0 on
            for j in range(min(A, n_enc[r] - len(mine))):
                s = self._own_slot(int(table[r, j]), owners[r], j)
                if s < 0:
                    break
                first_groups.append(s)
            lead.append(first_groups)
        # each request's packed groups: its table row after the leading window
        skip = torch.tensor([len(a) for a in lead], dtype=torch.long)
        col = (torch.arange(table.shape[1]).unsqueeze(0) + skip.unsqueeze(1)).clamp(
            max=table.shape[1] - 1)
        num_groups = torch.tensor([g - len(w) - len(a) for g, w, a in zip(n_enc, window, lead)],
                                  dtype=torch.long)
        return make_read_plan(table.gather(1, col)[:, :-1], num_groups, tail, ctx_lens,
                              query_start, first, T, self.sink_tokens, window, lead)

    def _own_slot(self, gid: int, owner, index: int) -> int:
        """The slot of group ``gid`` if ``owner`` staged it itself as its group ``index``,
        else -1."""
        s = self.slot_of.get(gid, -1)
        return s if s >= 0 and self.owner_of[s] == owner and self.index_of[s] == index else -1

    def plan_writes(self, slot_mapping: torch.Tensor, positions: torch.Tensor | None = None,
                    req: torch.Tensor | None = None, first_block: torch.Tensor | None = None,
                    owners: list | None = None, seq_lens: list[int] | None = None,
                    visual: list[torch.Tensor | None] | None = None) -> WritePlan:
        """Plan one step's writes from vLLM's per-token slot mapping (CPU, -1 = padding).

        ``positions``/``req`` (per token: position in its sequence, request row) and
        ``first_block`` (per request) are needed for sinks and relevance; with them,
        ``owners`` and ``seq_lens`` (per request) for the residual window, and
        ``visual`` (per request, as in :meth:`plan_step`) for the visual-token mask.
        """
        T, W, A = self.T, self.window_groups, self.lead_groups
        windowed = W + A > 0 and positions is not None and req is not None
        require(W + A == 0 or windowed, "plan_writes arguments",
                "positions, req, owners and seq_lens with a leading or residual window", None)
        sm = slot_mapping.to("cpu", torch.long)
        tok = torch.nonzero(sm >= 0).flatten()
        if tok.numel() == 0:
            return _empty_write_plan()
        slots = sm[tok]
        gid, off = slots // T, slots % T
        ugid, inv = torch.unique(gid, return_inverse=True)
        n = ugid.numel()
        min_off = torch.full((n,), T, dtype=torch.long).scatter_reduce(0, inv, off, "amin")
        max_off = torch.full((n,), -1, dtype=torch.long).scatter_reduce(0, inv, off, "amax")
        complete = (max_off == T - 1).tolist()
        ug, mins = ugid.tolist(), min_off.tolist()
        owner, index = [None] * n, [-1] * n
        keep = [not c for c in complete]  # groups holding a slot after this step
        if req is not None and owners is not None:  # every slot records its sequence
            rrow = req.to("cpu", torch.long)[tok]
            g_req = torch.zeros(n, dtype=torch.long).scatter_(0, inv, rrow).tolist()
            owner = [owners[r] for r in g_req]
        if windowed:
            pos = positions.to("cpu", torch.long)[tok]
            g_index = torch.zeros(n, dtype=torch.long).scatter_(0, inv, pos // T).tolist()
            keep_from = [L // T - W for L in seq_lens]  # first group index still in the window
            for i in range(n):
                index[i] = g_index[i]
                keep[i] = keep[i] or index[i] >= keep_from[g_req[i]] or index[i] < A
            # groups this step moves out of their owners' windows (read by this step, so the
            # slots are reused only by writes that follow the reads in every layer)
            touched = set(ug)
            for r in sorted(set(g_req)):
                for s in list(self.owned.get(owners[r], ())):
                    if A <= self.index_of[s] < keep_from[r] and self.gid_of[s] not in touched:
                        self._release(self.gid_of[s])

        slot_for = [-1] * n  # staging slot of the groups kept staged
        src_for = [-1] * n  # earlier tokens of completed groups
        for i in range(n):
            if mins[i] > 0:  # continues a group: its earlier tokens must be staged
                s = self.slot_of.get(ug[i], -1)
                if s < 0:
                    raise RuntimeError(
                        f"lowbit-kv: group {ug[i]} continues at offset {mins[i]} but no staging "
                        "slot holds its earlier tokens (released or never written); refusing to "
                        "encode or attend to missing tokens")
                if complete[i]:
                    src_for[i] = s
                if keep[i]:
                    slot_for[i] = s
                    self._assign(s, ug[i], owner[i], index[i] if complete[i] else -1)
        # Completed groups leaving staging return their slots first (each layer encodes
        # them from the slots before staging anything), so A + W + 1 slots per request suffice.
        for i in range(n):
            if not keep[i]:
                self._release(ug[i])
        for i in range(n):
            if not keep[i] or slot_for[i] >= 0:
                continue
            s = self.slot_of.get(ug[i], -1)  # mins == 0 here
            idx = index[i] if complete[i] else -1
            if s >= 0:
                self.stale_reused += 1
                logger.warning("lowbit-kv: group %d restarts at offset 0 while holding slot %d "
                               "(its previous owner ended unreported); reusing the slot", ug[i], s)
                self._assign(s, ug[i], owner[i], idx)
            else:
                s = self._take(ug[i], owner[i], idx)
            slot_for[i] = s

        comp = torch.tensor(complete, dtype=torch.bool)
        staged = torch.tensor(keep, dtype=torch.bool)[inv]
        tok_comp = comp[inv]
        slot_t = torch.tensor(slot_for, dtype=torch.long)
        row_of = torch.cumsum(comp.long(), 0) - 1  # rows of completed groups, in ugid order
        E = int(comp.sum())
        enc_req = torch.full((E,), -1, dtype=torch.long)
        enc_start = torch.full((E,), -1, dtype=torch.long)
        enc_sink = torch.zeros(E, dtype=torch.long)
        sink_tok = sink_block = sink_pos = EMPTY_INDEX
        if positions is not None:
            pos = positions.to("cpu", torch.long)[tok]
            rows = row_of[inv[tok_comp]]
            if E:
                enc_start[rows] = pos[tok_comp] - off[tok_comp]
                if req is not None:
                    enc_req[rows] = req.to("cpu", torch.long)[tok][tok_comp]
                enc_sink = (self.sink_tokens - enc_start).clamp(min=0, max=T) * (enc_start >= 0)
            if self.sink_tokens and first_block is not None and req is not None:
                is_sink = pos < self.sink_tokens
                if bool(is_sink.any()):
                    sink_tok = tok[is_sink]
                    sink_pos = pos[is_sink]
                    sink_block = first_block[req.to("cpu", torch.long)[sink_tok]]
        enc_src_slot = torch.tensor(src_for, dtype=torch.long)[comp]
        enc_tok, enc_dest = tok[tok_comp], row_of[inv[tok_comp]] * T + off[tok_comp]
        return WritePlan(
            stage_tok=tok[staged], stage_slot=slot_t[inv[staged]], stage_off=off[staged],
            enc_gids=ugid[comp], enc_src_slot=enc_src_slot, enc_tok=enc_tok, enc_dest=enc_dest,
            enc_req=enc_req, enc_start=enc_start, enc_sink=enc_sink,
            sink_tok=sink_tok, sink_block=sink_block, sink_pos=sink_pos,
            enc_visual=_visual_mask(visual, enc_req, enc_start, T),
            enc_run=_fresh_run(enc_tok, enc_dest, enc_src_slot, T),
        )
