"""Packed paged KV layout, bf16 staging of partial groups, and reference attention.

Pure PyTorch; nothing here imports vLLM, so the layout and the attention math
are tested alone (tests/test_paged.py) and reused by any engine.

Terms
-----
group  ``T = codec.block_tokens`` consecutive tokens of one sequence: the unit a
       codec encodes (per-channel statistics run over these T tokens).
block  vLLM's allocation unit of ``block_size`` tokens; ``block_size`` is a
       multiple of T, so a block holds ``N = block_size // T`` groups.
page   the bytes of one block of one layer, viewed as ``uint8 [H, N, C]`` with
       ``C = key_codec.nbytes + value_codec.nbytes``: for every KV head and every
       group, the K codes+metadata followed by the V codes+metadata. A layer's
       cache is ``uint8 [num_blocks, H, N, C]``.
gid    global group id ``= block_id * N + group_in_block``; a token in vLLM slot
       ``s`` (``= block_id * block_size + offset``) lies in group ``s // T`` at
       offset ``s % T``.

A group is encoded into its page in the step that writes its last token
(offset T-1). Until then its tokens live in bf16 in a *staging slot*: a fixed
pool of ``num_slots`` slots per layer (sized once at start-up), handed out by
:class:`StagingAllocator`. The allocator's bookkeeping is done once per step
(for all layers) by :meth:`StagingAllocator.plan_writes`; each layer then
applies the same :class:`WritePlan` to its own pages and staging buffers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .codecs.base import BlockCodec, require

logger = logging.getLogger("vllm.lowbit_kv.paged")


class PagedLayout:
    """Byte layout of a packed page and the codec calls that fill and read it."""

    def __init__(self, key_codec: BlockCodec, value_codec: BlockCodec, num_kv_heads: int,
                 block_size: int):
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
        self.key_codec, self.value_codec = key_codec, value_codec
        self.T, self.D, self.H = T, key_codec.head_dim, num_kv_heads
        self.block_size = block_size
        self.groups_per_block = block_size // T
        self.k_bytes, self.v_bytes = key_codec.nbytes, value_codec.nbytes
        self.state_bytes = self.k_bytes + self.v_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer (K and V of all heads, all groups)."""
        return self.H * self.groups_per_block * self.state_bytes

    @property
    def bytes_per_token(self) -> float:
        """Per layer, K and V together."""
        return self.page_bytes / self.block_size

    def page_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        return (num_blocks, self.H, self.groups_per_block, self.state_bytes)

    # -- codec ----------------------------------------------------------------
    def encode(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """K, V [G, T, H, D] -> uint8 states [G, H, C]."""
        return torch.cat([self.key_codec.encode(k), self.value_codec.encode(v)], dim=-1)

    def decode(self, states: torch.Tensor, dtype: torch.dtype = torch.float32
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 states [G, H, C] -> K, V [G, T, H, D]."""
        kb, vb = states.split([self.k_bytes, self.v_bytes], dim=-1)
        return (self.key_codec.decode(kb.contiguous(), dtype),
                self.value_codec.decode(vb.contiguous(), dtype))

    # -- page addressing --------------------------------------------------------
    def read_states(self, pages: torch.Tensor, gids: torch.Tensor) -> torch.Tensor:
        """pages uint8 [B, H, N, C], gids [G] -> states [G, H, C]."""
        N = self.groups_per_block
        return pages[gids // N, :, gids % N]

    def write_states(self, pages: torch.Tensor, gids: torch.Tensor, states: torch.Tensor) -> None:
        N = self.groups_per_block
        pages[gids // N, :, gids % N] = states


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

    @property
    def empty(self) -> bool:
        return self.stage_tok.numel() == 0 and self.enc_gids.numel() == 0


@dataclass
class ReadPlan:
    """What each request attends to besides its fresh tokens."""

    page_gids: torch.Tensor  # [G] encoded groups of all requests, request-major
    page_start: list[int]  # [R+1] request r's groups are page_gids[page_start[r]:page_start[r+1]]
    tail_slot: list[int]  # [R] staging slot holding the partial group in the context, -1: none
    ctx_len: list[int]  # [R] tokens before this step's fresh tokens
    q_start: list[int]  # [R+1] fresh tokens of request r: rows q_start[r]:q_start[r+1]


_EMPTY = torch.empty(0, dtype=torch.long)


class StagingAllocator:
    """Maps incomplete groups (gid) to staging slots; bookkeeping only, on the CPU.

    A slot is taken when a group's first token is written and returned when its
    last token is written (the group is then encoded), or when the engine
    reports the request finished, aborted or preempted (:meth:`release_blocks`).
    As a safety net, a group restarted at offset 0 by its block's next owner
    reuses its stale slot, and a full pool reclaims the slot written least
    recently (logged).
    """

    def __init__(self, num_slots: int, group_tokens: int):
        require(isinstance(num_slots, int) and num_slots >= 1, "num_slots", "an int >= 1", num_slots)
        self.num_slots, self.T = num_slots, group_tokens
        self.slot_of: dict[int, int] = {}
        self.gid_of = [-1] * num_slots
        self.last_step = [0] * num_slots
        self.free = list(range(num_slots - 1, -1, -1))
        self.step = 0
        self.reclaimed = 0

    @property
    def in_use(self) -> int:
        return self.num_slots - len(self.free)

    def _take(self, gid: int, busy: set[int]) -> int:
        if self.free:
            slot = self.free.pop()
        else:
            cands = [s for s in range(self.num_slots) if s not in busy]
            if not cands:
                raise RuntimeError(
                    f"lowbit-kv staging pool exhausted: {self.num_slots} slots all used by "
                    "this step; raise the staging size or lower max_num_seqs")
            slot = min(cands, key=lambda s: self.last_step[s])
            self.slot_of.pop(self.gid_of[slot], None)
            self.reclaimed += 1
            logger.warning("lowbit-kv: staging pool full, reclaimed slot %d (group %d, idle %d steps)",
                           slot, self.gid_of[slot], self.step - self.last_step[slot])
        self.slot_of[gid] = slot
        self.gid_of[slot] = gid
        return slot

    def _release(self, gid: int) -> None:
        slot = self.slot_of.pop(gid, None)
        if slot is not None:
            self.gid_of[slot] = -1
            self.free.append(slot)

    def release_blocks(self, block_ids, groups_per_block: int) -> int:
        """Free the slots of every staged group in these blocks (their request ended).

        Call before the step's :meth:`plan_writes`; safe for blocks already handed
        to a new owner, whose writes only start in that step, at offset 0.
        """
        freed = 0
        for b in block_ids:
            for g in range(b * groups_per_block, (b + 1) * groups_per_block):
                if g in self.slot_of:
                    self._release(g)
                    freed += 1
        return freed

    def plan_writes(self, slot_mapping: torch.Tensor) -> WritePlan:
        """Plan one step's writes from vLLM's per-token slot mapping (CPU, -1 = padding)."""
        self.step += 1
        T = self.T
        sm = slot_mapping.to("cpu", torch.long)
        tok = torch.nonzero(sm >= 0).flatten()
        if tok.numel() == 0:
            return WritePlan(_EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY)
        slots = sm[tok]
        gid, off = slots // T, slots % T
        ugid, inv = torch.unique(gid, return_inverse=True)
        n = ugid.numel()
        min_off = torch.full((n,), T, dtype=torch.long).scatter_reduce(0, inv, off, "amin")
        max_off = torch.full((n,), -1, dtype=torch.long).scatter_reduce(0, inv, off, "amax")
        complete = (max_off == T - 1).tolist()
        ug, mins = ugid.tolist(), min_off.tolist()

        slot_for = [-1] * n  # staging slot of incomplete groups
        src_for = [-1] * n  # earlier tokens of completed groups
        busy: set[int] = set()
        # Continuing groups first: they own their slots already.
        for i in range(n):
            if mins[i] > 0:
                s = self.slot_of.get(ug[i], -1)
                if s < 0:
                    logger.warning("lowbit-kv: group %d continues at offset %d but has no staged "
                                   "tokens (reclaimed or never written); they count as zeros",
                                   ug[i], mins[i])
                if complete[i]:
                    src_for[i] = s
                elif s >= 0:
                    slot_for[i] = s
                if s >= 0:
                    busy.add(s)
        for i in range(n):
            if complete[i] or slot_for[i] >= 0:
                continue
            # A group (re)starting at offset 0 reuses a stale slot of the same gid.
            s = self.slot_of.get(ug[i], -1) if mins[i] == 0 else -1
            if s < 0:
                s = self._take(ug[i], busy)
            slot_for[i] = s
            busy.add(s)
        for i in range(n):
            if complete[i]:
                self._release(ug[i])
            else:
                self.last_step[slot_for[i]] = self.step

        comp = torch.tensor(complete, dtype=torch.bool)
        tok_comp = comp[inv]
        slot_t = torch.tensor(slot_for, dtype=torch.long)
        # rows of completed groups, in ugid order
        row_of = torch.cumsum(comp.long(), 0) - 1
        return WritePlan(
            stage_tok=tok[~tok_comp], stage_slot=slot_t[inv[~tok_comp]], stage_off=off[~tok_comp],
            enc_gids=ugid[comp], enc_src_slot=torch.tensor(src_for, dtype=torch.long)[comp],
            enc_tok=tok[tok_comp], enc_row=row_of[inv[tok_comp]], enc_off=off[tok_comp],
        )

    def plan_reads(self, seq_lens: list[int], query_start: list[int], block_table: torch.Tensor,
                   groups_per_block: int) -> ReadPlan:
        """After :meth:`plan_writes` of the same step: the context of every request."""
        T, N = self.T, groups_per_block
        gids, page_start, tail, ctx_lens = [], [0], [], []
        bt = block_table.to("cpu")
        for r, L in enumerate(seq_lens):
            q = query_start[r + 1] - query_start[r]
            ctx = L - q
            n_g = -(-ctx // T)
            n_enc = min(n_g, L // T)
            if n_g:
                g = torch.arange(n_g)
                rg = bt[r, g // N].long() * N + g % N
                gids.append(rg[:n_enc])
                if n_g > n_enc:
                    tail.append(self.slot_of.get(int(rg[-1]), -1))
                else:
                    tail.append(-1)
            else:
                tail.append(-1)
            page_start.append(page_start[-1] + n_enc)
            ctx_lens.append(ctx)
        page_gids = torch.cat(gids) if gids else _EMPTY
        return ReadPlan(page_gids, page_start, tail, ctx_lens, list(query_start))


def apply_writes(plan: WritePlan, layout: PagedLayout, key: torch.Tensor, value: torch.Tensor,
                 pages: torch.Tensor, stage_k: torch.Tensor, stage_v: torch.Tensor) -> None:
    """Write one layer's fresh K/V [tokens, H, D]: encode completed groups, stage the rest.

    Completed groups are encoded first: they read staging slots that this very
    step may hand to a new group.
    """
    E = plan.enc_gids.numel()
    if E:
        T, H, D = layout.T, layout.H, layout.D
        tk = torch.zeros(E, T, H, D, dtype=torch.float32)
        tv = torch.zeros_like(tk)
        has = plan.enc_src_slot >= 0
        if bool(has.any()):
            rows, src = torch.nonzero(has).flatten(), plan.enc_src_slot[has]
            tk[rows] = stage_k[src].float()
            tv[rows] = stage_v[src].float()
        tk[plan.enc_row, plan.enc_off] = key[plan.enc_tok].float()
        tv[plan.enc_row, plan.enc_off] = value[plan.enc_tok].float()
        layout.write_states(pages, plan.enc_gids, layout.encode(tk, tv))
    if plan.stage_tok.numel():
        stage_k[plan.stage_slot, plan.stage_off] = key[plan.stage_tok].to(stage_k.dtype)
        stage_v[plan.stage_slot, plan.stage_off] = value[plan.stage_tok].to(stage_v.dtype)


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


def paged_attention(plan: ReadPlan, layout: PagedLayout, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, pages: torch.Tensor, stage_k: torch.Tensor,
                    stage_v: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """Every request: its fresh tokens in full precision + its context from pages/staging.

    Call after :func:`apply_writes` of the same step. Writes ``out[:tokens]``.
    """
    H, D = layout.H, layout.D
    dk = dv = None
    if plan.page_gids.numel():
        dk, dv = layout.decode(layout.read_states(pages, plan.page_gids))
    for r, ctx in enumerate(plan.ctx_len):
        qs, qe = plan.q_start[r], plan.q_start[r + 1]
        if qe == qs:
            continue
        ks, vs = [], []
        a, b = plan.page_start[r], plan.page_start[r + 1]
        if b > a:
            ks.append(dk[a:b].reshape(-1, H, D))
            vs.append(dv[a:b].reshape(-1, H, D))
        if plan.tail_slot[r] >= 0:
            ks.append(stage_k[plan.tail_slot[r]].float())
            vs.append(stage_v[plan.tail_slot[r]].float())
        if ctx > 0:
            kc, vc = torch.cat(ks)[:ctx], torch.cat(vs)[:ctx]
            if kc.shape[0] < ctx:
                raise RuntimeError(f"lowbit-kv: request {r} context has {kc.shape[0]} of {ctx} tokens")
            k_all = torch.cat([kc, key[qs:qe].float()])
            v_all = torch.cat([vc, value[qs:qe].float()])
        else:
            k_all, v_all = key[qs:qe], value[qs:qe]
        out[qs:qe] = attend(query[qs:qe], k_all, v_all, ctx, scale).to(out.dtype)
