"""Packed paged KV layout, bf16 staging of partial groups, sinks, STP relevance, attention.

Pure PyTorch; nothing here imports vLLM, so the layout and the attention math
are tested alone (tests/test_paged.py) and reused by any engine.

Terms
-----
group  ``T = codec.block_tokens`` consecutive tokens of one sequence, starting at
       a position multiple of T: the unit a codec encodes (per-channel
       statistics run over these T tokens).
block  vLLM's allocation unit of ``block_size`` tokens; ``block_size`` is a
       multiple of T, so a block holds ``N = block_size // T`` groups.
page   the bytes of one block of one layer, per KV head ``P = S + N * C`` bytes:
       an optional sink area of ``S`` bytes, then for every group the K
       codes+metadata followed by the V codes+metadata (``C = key_codec.nbytes +
       value_codec.nbytes`` rounded up to 4 bytes). A layer's cache is ``uint8 [num_blocks, H, P]``
       (vLLM views it as ``[num_blocks, H, N, C]`` when S = 0, else
       ``[num_blocks, H, 1, P]``).
gid    global group id ``= block_id * N + group_in_block``; a token in vLLM slot
       ``s`` (``= block_id * block_size + offset``) lies in group ``s // T`` at
       offset ``s % T``.

Staging. A group is encoded into its page in the step that writes its last
token (offset T-1). Until then its tokens live in the model dtype in a
*staging slot*: a fixed pool of slots per layer (sized once at start-up),
handed out by :class:`StagingAllocator`. A running request has at most one
partial group (its last), so ``max_num_seqs`` slots always suffice: slots of
groups completed in a step are returned before new groups take theirs, and the
engine returns the slots of finished, aborted and preempted requests
(:meth:`StagingAllocator.release_blocks`) before the next step is planned.
Anything else (a group continuing without its staged tokens, an exhausted
pool) is a bookkeeping bug and raises: never attend to made-up values.

Sinks. With ``sink_tokens = s > 0`` (s <= T) the first s tokens of every
sequence are also kept exactly, in the model dtype, in the sink area of the
sequence's first block (every page carries the area, used only in a
sequence's first block: that is what makes it survive prefix caching, where a
cached first block is shared as bytes). The group holding them (group 0) is
still encoded when it fills, with the sink rows replaced by the per-channel
mean of its other rows so they do not stretch its statistics (and never win
STP protection); reads take positions < s from the sink area.

Relevance (STP). For codecs with ``uses_relevance``: the relevance of a token is
the attention mass it receives from the *observation window*, the last
``obs_window`` queries of its sequence up to the last token written in the step
that completes its group: softmax over every key the sequence has (context as
stored + fresh tokens exact, causal mask), summed over the window's queries and
over the query heads sharing the KV head. This is the definition of
:mod:`vllm_lowbit_kv.hf_cache` (forward = the request's chunk in this step).
With ``obs_window <= T`` the window's queries from earlier steps always belong
to the group being completed, so the staging slot keeps each staged token's
query alongside its K and V.

Each step: :meth:`StagingAllocator.plan_step` (once, for all layers) gives a
:class:`ReadPlan` (each request's context, as stored before this step) and a
:class:`WritePlan` (where the fresh tokens go); each layer then runs
:func:`forward_layer`: attention (and relevance) first, writes second.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .codecs.base import BlockCodec, require
from .rotation import HadamardRotation

logger = logging.getLogger("vllm.lowbit_kv.paged")

#: byte alignment of a group's state (and so of every page)
STATE_ALIGN = 4
#: relevance given to sink rows of group 0: below any attention mass (never protected)
SINK_RELEVANCE = -1.0


class PagedLayout:
    """Byte layout of a packed page and the codec calls that fill and read it."""

    def __init__(self, key_codec: BlockCodec, value_codec: BlockCodec, num_kv_heads: int,
                 block_size: int, sink_tokens: int = 0, sink_dtype: torch.dtype = torch.bfloat16,
                 rotation: HadamardRotation | None = None):
        T = key_codec.block_tokens
        require(value_codec.block_tokens == T, "value codec block_tokens",
                f"equal to the key codec's ({T})", value_codec.block_tokens)
        require(value_codec.head_dim == key_codec.head_dim, "value codec head_dim",
                f"equal to the key codec's ({key_codec.head_dim})", value_codec.head_dim)
        require(isinstance(block_size, int) and block_size > 0 and block_size % T == 0,
                "block_size", f"a positive multiple of the scheme's block_tokens ({T})",
                block_size)
        require(isinstance(num_kv_heads, int) and num_kv_heads >= 1, "num_kv_heads",
                "an int >= 1", num_kv_heads)
        require(isinstance(sink_tokens, int) and 0 <= sink_tokens <= T, "sink_tokens",
                f"an int in [0, block_tokens={T}] (the sinks live in a sequence's first group)",
                sink_tokens)
        self.key_codec, self.value_codec = key_codec, value_codec
        self.T, self.D, self.H = T, key_codec.head_dim, num_kv_heads
        self.block_size = block_size
        self.groups_per_block = block_size // T
        self.k_bytes, self.v_bytes = key_codec.nbytes, value_codec.nbytes
        #: K then V bytes of one group of one head, padded to a multiple of 4 bytes
        #: (vLLM zeroes new blocks in 4-byte words and needs 4-byte page strides)
        self.state_bytes = -(-(self.k_bytes + self.v_bytes) // STATE_ALIGN) * STATE_ALIGN
        self.pad_bytes = self.state_bytes - self.k_bytes - self.v_bytes
        self.sink_tokens, self.sink_dtype = sink_tokens, sink_dtype
        #: K and V head vectors are rotated before encoding (codec space = rotated space)
        self.rotation = rotation
        self._elt = torch.empty(0, dtype=sink_dtype).element_size()
        #: bytes of the sink area per head: K rows [s, D] then V rows [s, D]
        self.sink_bytes = 2 * sink_tokens * self.D * self._elt
        #: bytes of one block of one KV head
        self.head_bytes = self.sink_bytes + self.groups_per_block * self.state_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer (all heads: sink area and groups)."""
        return self.H * self.head_bytes

    @property
    def bytes_per_token(self) -> float:
        """Per layer, K and V together, sink area included."""
        return self.page_bytes / self.block_size

    @property
    def bits_per_element(self) -> float:
        """Every byte of a page over the K and V elements of its tokens."""
        return self.page_bytes * 8 / (self.block_size * self.H * self.D * 2)

    def page_shape(self, num_blocks: int) -> tuple[int, int, int]:
        return (num_blocks, self.H, self.head_bytes)

    # -- codec ----------------------------------------------------------------
    def encode(self, k: torch.Tensor, v: torch.Tensor, relevance: torch.Tensor | None = None
               ) -> torch.Tensor:
        """K, V [G, T, H, D] (+ relevance [G, T, H]) -> uint8 states [G, H, C] (rotated
        first when the layout has a rotation)."""
        if self.rotation is not None:
            k, v = self.rotation.rotate(k), self.rotation.rotate(v)
        kb, vb = self.key_codec.encode(k, relevance), self.value_codec.encode(v, relevance)
        parts = [kb, vb]
        if self.pad_bytes:
            parts.append(kb.new_zeros(*kb.shape[:-1], self.pad_bytes))
        return torch.cat(parts, dim=-1)

    def decode_codes(self, states: torch.Tensor, dtype: torch.dtype = torch.float32
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 states [G, H, C] -> K, V [G, T, H, D] as the codecs stored them (rotated
        when the layout rotates): what packed attention reads, with a rotated query."""
        kb, vb, _ = states.split([self.k_bytes, self.v_bytes, self.pad_bytes], dim=-1)
        return (self.key_codec.decode(kb.contiguous(), dtype),
                self.value_codec.decode(vb.contiguous(), dtype))

    def decode(self, states: torch.Tensor, dtype: torch.dtype = torch.float32
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 states [G, H, C] -> K, V [G, T, H, D] in the model's space."""
        k, v = self.decode_codes(states, dtype)
        if self.rotation is not None:
            k, v = self.rotation.unrotate(k), self.rotation.unrotate(v)
        return k, v

    # -- page addressing --------------------------------------------------------
    def _flat(self, pages: torch.Tensor) -> torch.Tensor:
        """Any vLLM view of a layer's cache -> ``[B, H, P]`` sharing its memory."""
        flat = pages.view(pages.shape[0], self.H, -1)  # raises rather than copy
        require(flat.shape[-1] == self.head_bytes, "page bytes per head",
                f"{self.head_bytes} (the layout's)", flat.shape[-1])
        return flat

    def _groups(self, pages: torch.Tensor) -> torch.Tensor:
        """``[B, H, N, C]`` view of the group states."""
        flat = self._flat(pages)
        return flat[:, :, self.sink_bytes:].view(flat.shape[0], self.H, self.groups_per_block,
                                                  self.state_bytes)

    def _sinks(self, pages: torch.Tensor) -> torch.Tensor:
        """``[B, 2, s, H, D * elt]`` byte view of the sink areas (K then V)."""
        flat = self._flat(pages)
        return (flat[:, :, :self.sink_bytes]
                .view(flat.shape[0], self.H, 2, self.sink_tokens, self.D * self._elt)
                .permute(0, 2, 3, 1, 4))

    def read_states(self, pages: torch.Tensor, gids: torch.Tensor) -> torch.Tensor:
        """pages, gids [G] -> states [G, H, C]."""
        N = self.groups_per_block
        return self._groups(pages)[gids // N, :, gids % N]

    def write_states(self, pages: torch.Tensor, gids: torch.Tensor, states: torch.Tensor) -> None:
        N = self.groups_per_block
        self._groups(pages)[gids // N, :, gids % N] = states

    def write_sinks(self, pages: torch.Tensor, blocks: torch.Tensor, pos: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor) -> None:
        """Tokens at positions ``pos`` (< sink_tokens) of sequences whose first block is
        ``blocks``: K, V [n, H, D] -> the sink areas, in the model dtype."""
        sv = self._sinks(pages)
        to_bytes = lambda x: x.to(self.sink_dtype).contiguous().view(torch.uint8)  # noqa: E731
        sv[blocks, 0, pos] = to_bytes(k)
        sv[blocks, 1, pos] = to_bytes(v)

    def read_sinks(self, pages: torch.Tensor, block: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` sink tokens of the sequence whose first block is ``block``:
        K, V [n, H, D] float32."""
        k, v = self.read_sinks_batch(pages, torch.tensor([block]), n)
        return k[0], v[0]

    def read_sinks_batch(self, pages: torch.Tensor, blocks: torch.Tensor, n: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` sink tokens of each sequence whose first block is in ``blocks``:
        K, V [B, n, H, D] float32."""
        kv = self._sinks(pages)[blocks, :, :n].contiguous().view(self.sink_dtype)
        return kv[:, 0].float(), kv[:, 1].float()


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
    enc_row: torch.Tensor  # ... their row in [E] ...
    enc_off: torch.Tensor  # ... and their offset in the group
    enc_req: torch.Tensor  # [E] request (row of the step) owning the group, -1: unknown
    enc_start: torch.Tensor  # [E] position of the group's first token, -1: unknown
    enc_sink: torch.Tensor  # [E] leading rows that are sink tokens (group 0), else 0
    # fresh sink tokens -> sink area of their sequence's first block
    sink_tok: torch.Tensor
    sink_block: torch.Tensor
    sink_pos: torch.Tensor

    @property
    def empty(self) -> bool:
        return self.stage_tok.numel() == 0 and self.enc_gids.numel() == 0


@dataclass
class ReadPlan:
    """What each request attends to besides its fresh tokens: its context as stored
    before this step's writes."""

    page_gids: torch.Tensor  # [G] encoded groups of all requests, request-major
    page_start: list[int]  # [R+1] request r's groups are page_gids[page_start[r]:page_start[r+1]]
    tail_slot: list[int]  # [R] staging slot holding the partial group in the context, -1: none
    window_slots: list[list[int]]  # [R] slots of the residual window's groups, token order
    ctx_len: list[int]  # [R] tokens before this step's fresh tokens
    q_start: list[int]  # [R+1] fresh tokens of request r: rows q_start[r]:q_start[r+1]
    first_block: list[int]  # [R] the request's first block (sink area), -1: none
    # the packed context as the packed-attention contract takes it (vllm_lowbit_kv.ops)
    group_table: torch.Tensor  # int64 [R, G_max]: request r's groups, token order
    num_groups: torch.Tensor  # int64 [R]
    skip_tokens: torch.Tensor  # int64 [R]: sink positions read from the sink area instead
    q_start_t: torch.Tensor  # int64 [R+1]: q_start as a tensor
    exact: list["ExactBatch"]  # the exact parts, requests batched by query length


@dataclass
class ExactBatch:
    """Requests whose fresh rows attend together to their exact keys: their sinks (sink
    area), the staged run of their context (residual window, then partial group) and
    their fresh tokens (causal). Planned once per step, used by every layer."""

    rows: torch.Tensor  # int64 [B, Q]: the fresh rows of each request
    sink_blocks: torch.Tensor  # int64 [B]: first block (sink area) of each request
    sinks: int  # sink positions read per request (the batch's largest skip_tokens)
    tail_slots: torch.Tensor  # int64 [B, S]: staging slots of the staged run, token order
    tail: int  # staged tokens read per request (the batch's largest)
    bias: torch.Tensor  # float32 [B, 1, Q, sinks + tail + Q]: 0 = attend, -inf = not


_EMPTY = torch.empty(0, dtype=torch.long)


def _empty_write_plan() -> WritePlan:
    return WritePlan(*([_EMPTY] * 14))


def make_read_plan(table: torch.Tensor, num_groups: torch.Tensor, tail_slot: list[int],
                   ctx_len: list[int], query_start: list[int], first_block: list[int], T: int,
                   sink_tokens: int, window_slots: list[list[int]] | None = None) -> ReadPlan:
    """A :class:`ReadPlan` from each request's packed groups (``table`` int64 [R, G_max] in
    token order, valid up to ``num_groups[r]``), the slots of its residual window's groups
    (read instead of the pages: they follow the packed groups), tail and context length;
    adds the flat group list and the batched exact parts."""
    window_slots = window_slots or [[] for _ in ctx_len]
    valid = torch.arange(table.shape[1]) < num_groups.unsqueeze(1)
    page_start = [0] + torch.cumsum(num_groups, 0).tolist()
    skip = torch.clamp(num_groups * T, max=sink_tokens)
    staged = [w + ([t] if c % T else []) for w, t, c in zip(window_slots, tail_slot, ctx_len)]
    exact = plan_exact(query_start, ctx_len, skip.tolist(), staged, first_block, T)
    return ReadPlan(table[valid], page_start, list(tail_slot), window_slots, list(ctx_len),
                    list(query_start), list(first_block), table * valid, num_groups, skip,
                    torch.tensor(query_start, dtype=torch.long), exact)


class StagingAllocator:
    """Maps staged groups (gid) to staging slots; bookkeeping only, on the CPU.

    A slot holds one group of one sequence in the model dtype: its partial last
    group, and (with ``window_groups = W > 0``) its last W complete groups, the
    residual window, which that sequence reads instead of their pages. The pages are
    written as groups fill, whatever the window: a cached block is always valid
    packed bytes, so another sequence sharing it through the prefix cache reads the
    pages. A slot records its *owner* (the sequence that wrote it, a key the engine
    gives per request row) and the group's index in that sequence; only the owner
    reads a window slot.

    A slot is taken when a group's first token is written; a complete group keeps
    it while it is among its sequence's last W complete groups, and returns it in
    the step that moves it out (or at once with W = 0); the engine returns the
    slots of finished, aborted and preempted requests (:meth:`release_blocks`). So
    ``W + 1`` slots per running sequence always suffice: a step returns the slots
    it moves out of windows before it hands out new ones. A group restarted at
    offset 0 whose gid still holds a slot (its block's previous owner ended
    unreported) reuses that slot: the new owner writes from offset 0 and reads only
    what it wrote (counted in ``stale_reused``). A group continuing without staged
    tokens, or a full pool, raises.
    """

    def __init__(self, num_slots: int, group_tokens: int, sink_tokens: int = 0,
                 window_groups: int = 0):
        require(isinstance(num_slots, int) and num_slots >= 1, "num_slots", "an int >= 1", num_slots)
        require(isinstance(window_groups, int) and window_groups >= 0, "window_groups",
                "an int >= 0", window_groups)
        self.num_slots, self.T, self.sink_tokens = num_slots, group_tokens, sink_tokens
        self.window_groups = window_groups
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
                f"{self.window_groups + 1} per running request): groups "
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

    def release_blocks(self, block_ids, groups_per_block: int) -> int:
        """Free the slots of every staged group in these blocks (their request ended).

        Call before the step is planned; safe for blocks already handed to a new
        owner, whose writes only start in that step, at offset 0.
        """
        freed = 0
        for b in block_ids:
            for g in range(b * groups_per_block, (b + 1) * groups_per_block):
                if g in self.slot_of:
                    self._release(g)
                    freed += 1
        return freed

    def release_window(self, owner) -> int:
        """Free ``owner``'s complete groups (its window; e.g. its pages were rewritten by
        eviction). Its partial group keeps its slot."""
        done = [self.gid_of[s] for s in self.owned.get(owner, ()) if self.index_of[s] >= 0]
        for gid in done:
            self._release(gid)
        return len(done)

    # -- one step ---------------------------------------------------------------
    def plan_step(self, slot_mapping: torch.Tensor, seq_lens: list[int], query_start: list[int],
                  block_table: torch.Tensor, groups_per_block: int, owners: list | None = None
                  ) -> tuple[WritePlan, ReadPlan]:
        """Plan one step: the context each request reads (as stored before the step),
        then where the fresh tokens go. ``slot_mapping`` [tokens] (-1 = padding),
        ``seq_lens`` [R], ``query_start`` [R+1], ``block_table`` [R, max_blocks];
        ``owners`` [R]: a key per request row that stays the request's for its life
        (vLLM's request id; default its first block, which prefix caching may share)."""
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
                                 owners=owners, seq_lens=seq_lens)
        return write, read

    def plan_reads(self, seq_lens: list[int], query_start: list[int], block_table: torch.Tensor,
                   groups_per_block: int, owners: list | None = None) -> ReadPlan:
        """The context of every request as stored *before* this step's writes: its
        complete groups from the pages, except its residual window (the last
        ``window_groups`` complete groups it staged itself, read from their slots), and
        its partial group from its staging slot. Call before :meth:`plan_writes` of the
        same step."""
        T, N, W = self.T, groups_per_block, self.window_groups
        R = len(seq_lens)
        bt = block_table.to("cpu", torch.long)[:R]
        ctx_lens = [L - (query_start[r + 1] - query_start[r]) for r, L in enumerate(seq_lens)]
        n_enc = [c // T for c in ctx_lens]
        rows = torch.arange(R)
        first = torch.where(torch.tensor(seq_lens) > 0, bt[:, 0], -1).tolist() if R else []
        # every request's complete groups in token order: [R, G_max], zero-padded
        col = torch.arange(max(n_enc, default=0) + 1)
        table = bt[:, (col // N).clamp(max=max(bt.shape[1] - 1, 0))] * N + col % N \
            if bt.shape[1] else torch.zeros(R, col.numel(), dtype=torch.long)
        tail, window = [], []
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
                s = self.slot_of.get(int(table[r, j]), -1)
                if s < 0 or self.owner_of[s] != owners[r] or self.index_of[s] != j:
                    break
                mine.insert(0, s)
            window.append(mine)
        num_groups = torch.tensor([g - len(w) for g, w in zip(n_enc, window)], dtype=torch.long)
        return make_read_plan(table[:, :-1], num_groups, tail, ctx_lens, query_start, first, T,
                              self.sink_tokens, window)

    def plan_writes(self, slot_mapping: torch.Tensor, positions: torch.Tensor | None = None,
                    req: torch.Tensor | None = None, first_block: torch.Tensor | None = None,
                    owners: list | None = None, seq_lens: list[int] | None = None) -> WritePlan:
        """Plan one step's writes from vLLM's per-token slot mapping (CPU, -1 = padding).

        ``positions``/``req`` (per token: position in its sequence, request row) and
        ``first_block`` (per request) are needed for sinks and relevance; with them,
        ``owners`` and ``seq_lens`` (per request) for the residual window.
        """
        T, W = self.T, self.window_groups
        windowed = W > 0 and positions is not None and req is not None
        require(W == 0 or windowed, "plan_writes arguments",
                "positions, req, owners and seq_lens with a residual window", None)
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
        if windowed:
            pos = positions.to("cpu", torch.long)[tok]
            rrow = req.to("cpu", torch.long)[tok]
            g_index = torch.zeros(n, dtype=torch.long).scatter_(0, inv, pos // T).tolist()
            g_req = torch.zeros(n, dtype=torch.long).scatter_(0, inv, rrow).tolist()
            keep_from = [L // T - W for L in seq_lens]  # first group index still in the window
            for i in range(n):
                owner[i], index[i] = owners[g_req[i]], g_index[i]
                keep[i] = keep[i] or index[i] >= keep_from[g_req[i]]
            # groups this step moves out of their owners' windows (read by this step, so the
            # slots are reused only by writes that follow the reads in every layer)
            touched = set(ug)
            for r in sorted(set(g_req)):
                for s in list(self.owned.get(owners[r], ())):
                    if 0 <= self.index_of[s] < keep_from[r] and self.gid_of[s] not in touched:
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
        # them from the slots before staging anything), so W + 1 slots per request suffice.
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
        sink_tok = sink_block = sink_pos = _EMPTY
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
        return WritePlan(
            stage_tok=tok[staged], stage_slot=slot_t[inv[staged]], stage_off=off[staged],
            enc_gids=ugid[comp], enc_src_slot=torch.tensor(src_for, dtype=torch.long)[comp],
            enc_tok=tok[tok_comp], enc_row=row_of[inv[tok_comp]], enc_off=off[tok_comp],
            enc_req=enc_req, enc_start=enc_start, enc_sink=enc_sink,
            sink_tok=sink_tok, sink_block=sink_block, sink_pos=sink_pos,
        )


@dataclass
class Staging:
    """One layer's staging buffers: K, V [S, T, H, D] and, for STP, queries [S, T, Hq, D]."""

    k: torch.Tensor
    v: torch.Tensor
    q: torch.Tensor | None = None

    @classmethod
    def allocate(cls, num_slots: int, T: int, H: int, D: int, dtype: torch.dtype,
                 num_q_heads: int | None = None, device=None) -> "Staging":
        k = torch.zeros(num_slots, T, H, D, dtype=dtype, device=device)
        q = None
        if num_q_heads:
            q = torch.zeros(num_slots, T, num_q_heads, D, dtype=dtype, device=device)
        return cls(k, torch.zeros_like(k), q)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.q) if t is not None)


def mask_sink_rows(group: torch.Tensor, sinks: int, dim: int = 0) -> torch.Tensor:
    """Set the first ``sinks`` rows (along ``dim``) of a sequence's group 0 to the mean of
    its other rows, in place, and return it: the sinks are read exactly from elsewhere, so
    they must not stretch the group's statistics. A group of sinks only is left as is."""
    T = group.shape[dim]
    if 0 < sinks < T:
        rows = group.narrow(dim, 0, sinks)
        rows.copy_(group.narrow(dim, sinks, T - sinks).mean(dim, keepdim=True).expand_as(rows))
    return group


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
                  rows: torch.Tensor | None = None) -> None:
    """Encode the completed groups ``rows`` (indices into ``plan.enc_gids``, default all;
    ``relevance`` [E, T, H] is indexed the same way) into their pages, and, with all
    rows, write the step's sink tokens into their sink areas.

    Runs before :func:`stage_tokens` of the same step: completed groups read their
    earlier tokens from staging slots that this very step may hand to a new group.
    """
    E = plan.enc_gids.numel()
    if rows is None and plan.sink_tok.numel():
        layout.write_sinks(pages, plan.sink_block, plan.sink_pos, key[plan.sink_tok],
                           value[plan.sink_tok])
    if E == 0 or (rows is not None and rows.numel() == 0):
        return
    T, H, D = layout.T, layout.H, layout.D
    tk = torch.zeros(E, T, H, D, dtype=torch.float32)
    tv = torch.zeros_like(tk)
    has = plan.enc_src_slot >= 0
    if bool(has.any()):
        src_rows, src = torch.nonzero(has).flatten(), plan.enc_src_slot[has]
        tk[src_rows] = staging.k[src].float()
        tv[src_rows] = staging.v[src].float()
    tk[plan.enc_row, plan.enc_off] = key[plan.enc_tok].float()
    tv[plan.enc_row, plan.enc_off] = value[plan.enc_tok].float()
    if plan.enc_sink.numel() and bool((plan.enc_sink > 0).any()):
        relevance = None if relevance is None else relevance.clone()
        for e in torch.nonzero(plan.enc_sink > 0).flatten().tolist():
            s = int(plan.enc_sink[e])
            mask_sink_rows(tk[e], s)
            mask_sink_rows(tv[e], s)
            if relevance is not None:
                relevance[e, :s] = SINK_RELEVANCE
    if rows is not None:
        tk, tv = tk[rows], tv[rows]
        relevance = None if relevance is None else relevance[rows]
    gids = plan.enc_gids if rows is None else plan.enc_gids[rows]
    layout.write_states(pages, gids, layout.encode(tk, tv, relevance))


def stage_tokens(plan: WritePlan, key: torch.Tensor, value: torch.Tensor, staging: Staging,
                 query: torch.Tensor | None = None) -> None:
    """Copy the fresh tokens of groups still incomplete into their staging slots."""
    if plan.stage_tok.numel():
        staging.k[plan.stage_slot, plan.stage_off] = key[plan.stage_tok].to(staging.k.dtype)
        staging.v[plan.stage_slot, plan.stage_off] = value[plan.stage_tok].to(staging.v.dtype)
        if staging.q is not None and query is not None:
            staging.q[plan.stage_slot, plan.stage_off] = query[plan.stage_tok].to(staging.q.dtype)


def attend(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int, scale: float
           ) -> torch.Tensor:
    """Causal attention of ``q`` fresh queries at positions ctx_len.. over keys 0..ctx_len+q-1.

    query [q, Hq, D]; k, v [S, Hkv, D] with S = ctx_len + q -> [q, Hq, D] float32.
    """
    q_len, S = query.shape[0], k.shape[0]
    qi = torch.arange(q_len).unsqueeze(1) + ctx_len
    mask = torch.arange(S).unsqueeze(0) <= qi
    out = F.scaled_dot_product_attention(
        query.float().transpose(0, 1).unsqueeze(0), k.float().transpose(0, 1).unsqueeze(0),
        v.float().transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale,
        enable_gqa=query.shape[1] != k.shape[1])
    return out.squeeze(0).transpose(0, 1)


def attention_mass(q_win: torch.Tensor, first_pos: int, keys: torch.Tensor, scale: float
                   ) -> torch.Tensor:
    """Attention mass of the window on every key: hf_cache's ``_attention_mass``.

    q_win [w, Hq, D] (queries at positions first_pos..first_pos+w-1), keys [S, H, D]
    -> [S, H]: softmax over the keys each query may see (causal), summed over the
    window's queries and the query heads of each KV head (head h*G+g uses KV head h).
    """
    w, Hq, D = q_win.shape
    S, H = keys.shape[0], keys.shape[1]
    G = Hq // H
    qg = q_win.float().permute(1, 0, 2).reshape(H, G * w, D)
    scores = torch.matmul(qg, keys.float().permute(1, 2, 0)) * scale  # [H, G*w, S]
    qpos = (first_pos + torch.arange(w)).repeat(G)
    scores = scores.masked_fill(torch.arange(S)[None, :] > qpos[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1).sum(dim=-2).transpose(0, 1)


def plan_exact(q_start: list[int], ctx_len: list[int], skip: list[int], staged: list[list[int]],
               first_block: list[int], T: int) -> list[ExactBatch]:
    """The exact parts of one step: all single-row (decode) requests in one batch, every
    multi-row request (a prefill chunk) in its own. ``staged[r]``: the slots of request
    r's staged run (window groups, then the partial group), the last ``len * T - (T -
    ctx % T) % T`` tokens of its context."""
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
        S, P = int(sinks.max()), int(tails.max())
        slots = torch.zeros(len(reqs), max(max(len(staged[r]) for r in reqs), 1), dtype=torch.long)
        for i, r in enumerate(reqs):
            slots[i, :len(staged[r])] = torch.tensor(staged[r], dtype=torch.long)
        attend = torch.cat([
            (torch.arange(S) < sinks.unsqueeze(1)).unsqueeze(1).expand(-1, Q, -1),
            (torch.arange(P) < tails.unsqueeze(1)).unsqueeze(1).expand(-1, Q, -1),
            torch.ones(Q, Q, dtype=torch.bool).tril().expand(len(reqs), -1, -1)], dim=-1)
        bias = torch.zeros(attend.shape).masked_fill_(~attend, float("-inf")).unsqueeze(1)
        out.append(ExactBatch(
            rows, torch.tensor([max(first_block[r], 0) for r in reqs]), S, slots, P, bias))
    return out


def staged_tokens(slots: list[int], ctx_len: int, T: int) -> int:
    """Tokens of a staged run of ``slots`` ending at the context's end: whole window
    groups, the last one partial when the context ends inside a group."""
    return len(slots) * T - (T - ctx_len % T) % T if slots else 0


def read_staged(buf: torch.Tensor, slots: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` tokens of the runs ``slots`` [..., S] of staging ``buf`` [slots, T,
    ...] (slot after slot): [..., n, ...] float32."""
    run = buf[slots]  # [..., S, T, H, D]
    lead = slots.dim() - 1
    return run.reshape(*run.shape[:lead], -1, *run.shape[lead + 2:])[..., :n, :, :].float()


def attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 attention with an additive mask, and its log-sum-exp.

    q [B, Q, Hq, D]; k, v [B, E, H, D]; bias [B, 1, Q, E] (every row attends to one key
    at least) -> out [B, Q, Hq, D], lse [B, Q, Hq].
    """
    G = q.shape[2] // k.shape[2]
    q = q.float().transpose(1, 2)
    k = k.float().repeat_interleave(G, dim=2).transpose(1, 2)
    v = v.float().repeat_interleave(G, dim=2).transpose(1, 2)
    if q.device.type == "cpu":  # fused, no [Q, E] score matrix (prefill chunks)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias, scale=scale)
    else:
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale + bias
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v)
    return out.transpose(1, 2), lse.transpose(1, 2)


def exact_attention(rplan: ReadPlan, layout: PagedLayout, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, pages: torch.Tensor, staging: Staging, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every fresh row over its request's exact keys (:class:`ExactBatch`): out
    [n, Hq, D] float32 and lse [n, Hq], to merge with the packed part."""
    n, Hq, D = query.shape[0], query.shape[1], query.shape[2]
    out = torch.empty(n, Hq, D, dtype=torch.float32, device=query.device)
    lse = torch.empty(n, Hq, dtype=torch.float32, device=query.device)
    for b in rplan.exact:
        ks, vs = [], []
        if b.sinks:
            sk, sv = layout.read_sinks_batch(pages, b.sink_blocks, b.sinks)
            ks.append(sk)
            vs.append(sv)
        if b.tail:
            ks.append(read_staged(staging.k, b.tail_slots, b.tail))
            vs.append(read_staged(staging.v, b.tail_slots, b.tail))
        ks.append(key[b.rows].float())
        vs.append(value[b.rows].float())
        o, l = attend_with_lse(query[b.rows], torch.cat(ks, 1), torch.cat(vs, 1),
                               b.bias.to(query.device), scale)
        out[b.rows] = o
        lse[b.rows] = l
    return out, lse


def context_keys(rplan: ReadPlan, r: int, layout: PagedLayout, pages: torch.Tensor,
                 staging: Staging) -> torch.Tensor:
    """Request r's context keys as read before this step: [ctx, H, D] float32 (packed
    groups decoded, sink positions from the sink area, the staged window and tail)."""
    H, D, T = layout.H, layout.D, layout.T
    g = int(rplan.num_groups[r])
    parts = []
    if g:
        dk, _ = layout.decode(layout.read_states(pages, rplan.group_table[r, :g]))
        dk = dk.reshape(g * T, H, D)
        s = int(rplan.skip_tokens[r])
        if s:
            dk[:s] = layout.read_sinks(pages, rplan.first_block[r], s)[0]
        parts.append(dk)
    part = rplan.ctx_len[r] - g * T
    if part:
        slots = rplan.window_slots[r] + ([rplan.tail_slot[r]] if rplan.ctx_len[r] % T else [])
        parts.append(read_staged(staging.k, torch.tensor(slots), part))
    return torch.cat(parts) if parts else torch.empty(0, H, D)


def forward_layer(wplan: WritePlan, rplan: ReadPlan, layout: PagedLayout, query: torch.Tensor,
                  key: torch.Tensor, value: torch.Tensor, pages: torch.Tensor, staging: Staging,
                  scale: float, out: torch.Tensor, obs_window: int | None = None,
                  packed_attention=None) -> None:
    """One layer, one step: encode the groups this step completes (with STP relevance
    when ``obs_window`` is given and the codecs use it) and write sink tokens; then every
    request attends to its context (pages + staged tail + sinks) and its fresh tokens in
    full precision; then the fresh tokens of incomplete groups are staged. Writes
    ``out[:tokens]``.

    Pages are written before anyone reads them because vLLM's prefix cache can hand a
    request, in the same step, a block another request is filling (blocks are cached
    when scheduled): the reader must see it encoded. A request's own completed groups
    are never in its context, and staging is written last, so writing first changes
    nothing for the writer. Relevance is computed from the context as stored, so a
    request reading another's completed groups has its own encoded after them
    (:func:`_encode_in_dependency_order`).

    The packed groups go through ``packed_attention`` (an implementation of the
    contract of :mod:`vllm_lowbit_kv.ops`, default its PyTorch reference), which reads
    packed bytes only (with a rotating layout: the query rotated, the output
    un-rotated, :mod:`vllm_lowbit_kv.rotation`); the exact keys are attended by
    :func:`exact_attention`; the two parts are merged by log-sum-exp. Only steps that complete a group of an STP
    request decode that request's context (its relevance needs the attention mass
    over every key)."""
    from .ops import merge_attention, packed_attention_reference

    n = rplan.q_start[-1]
    _encode_in_dependency_order(wplan, rplan, layout, query, key, value, pages, staging, scale,
                                obs_window)
    if n:
        res, res_lse = exact_attention(rplan, layout, query[:n], key, value, pages, staging,
                                       scale)
        if rplan.page_gids.numel():
            rot = layout.rotation
            p_out, p_lse = (packed_attention or packed_attention_reference)(
                query[:n] if rot is None else rot.rotate(query[:n].float()), rplan.q_start_t, pages,
                layout, rplan.group_table, rplan.num_groups, rplan.skip_tokens, scale)
            if rot is not None:
                p_out = rot.unrotate(p_out)
            res, _ = merge_attention(p_out, p_lse, res, res_lse)
        out[:n] = res.to(out.dtype)
    stage_tokens(wplan, key, value, staging, query)


def _encode_in_dependency_order(wplan: WritePlan, rplan: ReadPlan, layout: PagedLayout,
                                query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                pages: torch.Tensor, staging: Staging, scale: float,
                                obs_window: int | None) -> None:
    """Encode the step's completed groups. Without relevance: all at once. With it, in
    waves: a request's groups once every completed group its context reads is encoded
    (a same-step prefix-cache hit reads groups its writer completes in this step)."""
    E = wplan.enc_gids.numel()
    if obs_window is None or E == 0:
        encode_groups(wplan, layout, key, value, pages, staging)
        return
    require(staging.q is not None, "staging.q", "allocated for relevance", None)
    enc_req = wplan.enc_req
    require(bool((enc_req >= 0).all()), "WritePlan.enc_req", "known for relevance",
            enc_req.tolist())
    rel = torch.zeros(E, layout.T, layout.H)
    encode_groups(wplan, layout, key, value, pages, staging, rows=_EMPTY)  # sinks only
    done = torch.zeros(E, dtype=torch.bool)
    while not bool(done.all()):
        pending = wplan.enc_gids[~done]
        ready = [r for r in sorted(set(enc_req[~done].tolist()))
                 if not bool(torch.isin(rplan.page_gids[rplan.page_start[r]:rplan.page_start[r + 1]],
                                        pending).any())]
        if not ready:
            raise RuntimeError("lowbit-kv: completed groups read each other in one step; "
                               "refusing to encode with relevance from unwritten pages")
        for r in ready:
            _fill_relevance(rel, r, wplan, rplan, layout, query, key, pages, staging, scale,
                            obs_window)
        wave = ~done & torch.isin(enc_req, torch.tensor(ready))
        encode_groups(wplan, layout, key, value, pages, staging, rel, torch.nonzero(wave).flatten())
        done |= wave


def _fill_relevance(rel: torch.Tensor, r: int, wplan: WritePlan, rplan: ReadPlan,
                    layout: PagedLayout, query: torch.Tensor, key: torch.Tensor,
                    pages: torch.Tensor, staging: Staging, scale: float, obs_window: int) -> None:
    """``rel`` rows of request r's completed groups: the attention mass its observation
    window puts on each of their tokens."""
    T = layout.T
    qs, qe, ctx = rplan.q_start[r], rplan.q_start[r + 1], rplan.ctx_len[r]
    k_all = torch.cat([context_keys(rplan, r, layout, pages, staging), key[qs:qe].float()])
    p = ctx + (qe - qs) - 1  # last position written in this step
    w0 = max(0, p - obs_window + 1)
    qw = [query[qs + max(0, w0 - ctx):qe]]
    if w0 < ctx:  # earlier queries of the window: staged with the partial group
        gstart = ctx - ctx % T
        require(w0 >= gstart and rplan.tail_slot[r] >= 0, "obs_window",
                f"<= block_tokens ({T})", obs_window)
        qw.insert(0, staging.q[rplan.tail_slot[r], w0 - gstart:ctx - gstart])
    mass = attention_mass(torch.cat(qw), w0, k_all, scale)  # [S, H]
    for e in torch.nonzero(wplan.enc_req == r).flatten().tolist():
        s0 = int(wplan.enc_start[e])
        rel[e] = mass[s0:s0 + T]


def paged_attention(plan: ReadPlan, layout: PagedLayout, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, pages: torch.Tensor, staging: Staging, scale: float,
                    out: torch.Tensor, packed_attention=None) -> None:
    """Attention only (no writes): :func:`forward_layer` with an empty write plan."""
    forward_layer(_empty_write_plan(), plan, layout, query, key, value, pages, staging, scale, out,
                  packed_attention=packed_attention)
