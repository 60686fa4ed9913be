"""One layer of the transformers cache: sinks, packed blocks, leading and residual windows
and tail."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from ..codecs.base import BlockCodec, require
from ..codecs.quant import absmax_int8_roundtrip, require_staging_dtype
from ..paged import SINK_RELEVANCE, attention_mass, mask_sink_rows, rank_protected
from ..retrieval_heads import query_heads
from ..rotation import HadamardRotation
from .hooks import RelevanceFn

class VisualTokens:
    """Which positions of each sequence are visual (image, video-frame) tokens, marked
    before the forward that feeds them, and which kind STP protects first (the scheme's
    ``protect_first``); one record shared by a cache's layers."""

    def __init__(self, protect_first: str = "visual") -> None:
        self.mask: torch.Tensor | None = None  # bool [B, positions marked so far]
        self.protect_first = protect_first

    def mark(self, start: int, mask: torch.Tensor) -> None:
        """``mask`` [B, S] bool: positions start..start+S-1 (unmarked ones stay text)."""
        B, S = mask.shape
        old = self.mask if self.mask is not None else torch.zeros(B, 0, dtype=torch.bool)
        if old.shape[1] < start + S:
            old = torch.cat([old, old.new_zeros(B, start + S - old.shape[1])], dim=1)
        old[:, start:start + S] = mask.to("cpu", torch.bool)
        self.mask = old

    def between(self, start: int, end: int, batch: int) -> torch.Tensor:
        """bool [batch, end - start]: positions start..end-1."""
        out = torch.zeros(batch, end - start, dtype=torch.bool)
        if self.mask is not None:
            part = self.mask[:, start:end]
            out[:, :part.shape[1]] = part
        return out


class LowBitLayer(DynamicLayer):
    """One layer's K/V: sinks and tail in the model dtype, full blocks packed by codecs."""

    is_croppable = False

    def __init__(self, layer_idx: int, key_codec: BlockCodec | None, value_codec: BlockCodec | None,
                 block_tokens: int, sink_tokens: int = 0, relevance: str | RelevanceFn = "none",
                 obs_window: int = 32, attend_new_exact: bool = True, evictable: bool = False,
                 residual_tokens: int = 0, rotation: HadamardRotation | None = None,
                 visual: VisualTokens | None = None, staging_dtype: str = "model",
                 leading_tokens: int = 0):
        super().__init__()
        require_staging_dtype(staging_dtype)
        #: the tail and window are held as the pages' staging holds them (int8: rounded once)
        self.staging_dtype = staging_dtype
        #: the cache's visual-token marks: STP protects visual tokens first
        self.visual = visual
        require(isinstance(residual_tokens, int) and residual_tokens >= 0
                and (residual_tokens == 0 or residual_tokens % block_tokens == 0), "residual_tokens",
                f"a multiple of block_tokens ({block_tokens}), >= 0", residual_tokens)
        #: complete groups of the residual window, read exactly instead of their codes
        self.window_groups = residual_tokens // block_tokens if residual_tokens else 0
        require(isinstance(leading_tokens, int) and leading_tokens >= 0
                and (leading_tokens == 0 or leading_tokens % block_tokens == 0), "leading_tokens",
                f"a multiple of block_tokens ({block_tokens}), >= 0", leading_tokens)
        #: the first groups, read as staged instead of their codes (the leading window)
        self.lead_groups = leading_tokens // block_tokens if leading_tokens else 0
        self.rotation = rotation
        self.layer_idx = layer_idx
        self.evictable = evictable
        self.key_codec, self.value_codec = key_codec, value_codec
        self.skip = key_codec is None
        self.block_tokens, self.sink_tokens = block_tokens, sink_tokens
        self.obs_window, self.attend_new_exact = obs_window, attend_new_exact
        needs = not self.skip and (key_codec.uses_relevance or value_codec.uses_relevance)
        self.relevance = relevance if needs else "none"
        self.wants_queries = self.relevance == "attention"
        self._reset_state()

    def _reset_state(self) -> None:
        self.length = 0
        self.sink_k = self.sink_v = None
        self.packed_k = self.packed_v = None  # uint8 [B, n_blocks, H, nbytes]
        self.window_k = self.window_v = None  # exact copies of the last window_groups blocks
        self.lead_k = self.lead_v = None  # staged copies of the first lead_groups blocks
        self.q_obs: torch.Tensor | None = None  # float32 [B, Hq, w, D]
        self.q_first = 0
        self.q_scale = 1.0
        self.stream_state: dict[str, Any] = {"k": None, "v": None}  # encode_stream recorders
        self.exact_k: list[torch.Tensor] = []  # exact K/V of every token until eviction
        self.exact_v: list[torch.Tensor] = []
        self.key_pos: torch.Tensor | None = None  # logical position of each stored pair, once evicted

    # -- transformers layer API --------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        B, H, _, D = key_states.shape
        if not self.skip:
            require(D == self.key_codec.head_dim, "head_dim", f"{self.key_codec.head_dim} (the codecs')", D)
        empty = key_states.new_zeros(B, H, 0, D)
        self.keys, self.values = empty, value_states.new_zeros(B, H, 0, value_states.shape[-1])
        self.sink_k, self.sink_v = empty.clone(), self.values.clone()

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        super().reset()
        self._reset_state()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("LowBitKVCache cannot crop: packed blocks are not re-openable")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if not self.is_initialized:
            return
        idx = beam_idx.to(self.device)
        self.keys, self.values = self.keys.index_select(0, idx), self.values.index_select(0, idx)
        self.sink_k, self.sink_v = self.sink_k.index_select(0, idx), self.sink_v.index_select(0, idx)
        if self.packed_k is not None:
            self.packed_k = self.packed_k.index_select(0, idx)
            self.packed_v = self.packed_v.index_select(0, idx)
        for name in ("window_k", "window_v", "lead_k", "lead_v"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).index_select(0, idx))
        if self.q_obs is not None:
            self.q_obs = self.q_obs.index_select(0, idx)
        self.exact_k = [t.index_select(0, idx) for t in self.exact_k]
        self.exact_v = [t.index_select(0, idx) for t in self.exact_v]
        for name, st in self.stream_state.items():
            if st is not None:
                vals = [t.index_select(0, idx) for t in st]
                self.stream_state[name] = type(st)(*vals) if hasattr(st, "_fields") else tuple(vals)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        idx = torch.as_tensor(indices, device=self.device)
        self.reorder_cache(idx.nonzero().flatten() if idx.dtype == torch.bool else idx.flatten())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            B = self.keys.shape[0]
            self.reorder_cache(torch.arange(B, device=self.device).repeat_interleave(repeats))

    def offload(self):
        raise NotImplementedError("LowBitKVCache does not support offloading")

    # -- queries for the observation window ----------------------------------------
    def record_queries(self, q: torch.Tensor, first_pos: int, scale: float) -> None:
        q = q.float()
        if self.q_obs is None or self.q_obs.shape[0] != q.shape[0]:
            self.q_obs, self.q_first = q, first_pos
        else:
            prev_end = self.q_first + self.q_obs.shape[2]
            if prev_end != first_pos:  # a gap (a new chunk longer than the window): restart
                self.q_obs, self.q_first = q, first_pos
            else:
                self.q_obs = torch.cat([self.q_obs, q], dim=2)
                drop = max(self.q_obs.shape[2] - self.obs_window, 0)
                self.q_obs, self.q_first = self.q_obs[:, :, drop:], self.q_first + drop
        self.q_scale = scale

    def _attention_mass(self, keys: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Attention mass of the observation window on tokens start:end -> [B, H, end - start]
        (:func:`~vllm_lowbit_kv.paged.attention_mass`, the pages' definition)."""
        if self.q_obs is None:
            raise RuntimeError(
                f"layer {self.layer_idx}: relevance='attention' but no queries were recorded; "
                "create the cache with model=... (installs the query hooks) or call "
                "install_query_hooks(model), or use relevance='keynorm'")
        mass = torch.stack([attention_mass(q.transpose(0, 1), self.q_first, k.transpose(0, 1),
                                           self.q_scale, self.key_pos)
                            for q, k in zip(self.q_obs, keys)])  # [B, N, H]
        return mass[:, start:end].transpose(1, 2)

    def _relevance(self, keys: torch.Tensor, values: torch.Tensor, start: int, end: int) -> torch.Tensor | None:
        """Relevance of tokens start:end as [B, end - start, H], or None."""
        mode = self.relevance
        if mode == "none":
            return None
        if callable(mode):
            return mode(self.layer_idx, keys, values, start, end)
        if mode == "keynorm":
            return -keys[:, :, start:end].float().norm(dim=-1).transpose(1, 2)
        return self._attention_mass(keys, start, end).transpose(1, 2)

    # -- blocks <-> [B, H, S, D] ------------------------------------------------
    def _encode(self, which: str, codec: BlockCodec, x: torch.Tensor, rel: torch.Tensor | None) -> torch.Tensor:
        if self.rotation is not None:
            x = self.rotation.rotate(x.float())
        B, H, S, D = x.shape
        n, T = S // self.block_tokens, self.block_tokens
        blocks = x.reshape(B, H, n, T, D).permute(0, 2, 3, 1, 4)  # [B, n, T, H, D]
        if hasattr(codec, "encode_stream") and rel is None:
            # codecs with per-sequence state (e.g. EMA recorders) thread it block to block
            packed, self.stream_state[which] = codec.encode_stream(blocks, self.stream_state[which])
            return packed
        if rel is not None:
            rel = rel.reshape(B, n, T, H)
        return codec.encode(blocks, rel)

    def _decode(self, codec: BlockCodec, packed: torch.Tensor) -> torch.Tensor:
        B, n, H, _ = packed.shape
        x = codec.decode(packed, self.dtype if self.rotation is None else torch.float32)
        if self.rotation is not None:
            x = self.rotation.unrotate(x).to(self.dtype)
        return x.permute(0, 3, 1, 2, 4).reshape(B, H, n * self.block_tokens, codec.head_dim)

    @property
    def n_window(self) -> int:
        """Encoded blocks read from their exact copies (the residual window)."""
        return 0 if self.window_k is None else self.window_k.shape[-2] // self.block_tokens

    @property
    def n_lead(self) -> int:
        """Encoded blocks read from their staged copies at the start (the leading window;
        blocks the residual window holds are its)."""
        held = 0 if self.lead_k is None else self.lead_k.shape[-2] // self.block_tokens
        return min(held, self.n_blocks - self.n_window)

    def decoded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every cached token as attention sees it: the leading window's blocks as staged
        ++ decode(blocks between the windows) ++ the residual window's blocks as staged ++
        tail as staged; the sink positions exact once group 0 is read from its packed block
        or the leading window (before, they are read as staged, as the pages' read plans
        do: ``skip_tokens``)."""
        ks, vs = [], []
        a = self.n_lead
        if a:
            ks.append(self.lead_k[:, :, :a * self.block_tokens])
            vs.append(self.lead_v[:, :, :a * self.block_tokens])
        n_packed = self.n_blocks - self.n_window - a
        if n_packed:
            ks.append(self._decode(self.key_codec, self.packed_k[:, a:a + n_packed]))
            vs.append(self._decode(self.value_codec, self.packed_v[:, a:a + n_packed]))
        if self.n_window:
            ks.append(self.window_k)
            vs.append(self.window_v)
        ks.append(self.keys)
        vs.append(self.values)
        k, v = torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)
        if n_packed or a:  # group 0 complete: sink positions read from their exact copies
            n = self.sink_k.shape[-2]
            k[:, :, :n], v[:, :, :n] = self.sink_k, self.sink_v
        return k, v

    @property
    def n_blocks(self) -> int:
        return 0 if self.packed_k is None else self.packed_k.shape[1]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        S = key_states.shape[-2]
        if self.key_pos is not None:
            self.key_pos = torch.cat([self.key_pos, torch.arange(self.length, self.length + S)])
        elif self.evictable and not self.skip:
            self.exact_k.append(key_states)
            self.exact_v.append(value_states)
        self.length += S
        return self._store(key_states, value_states)

    def _store(self, key_states: torch.Tensor, value_states: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append pairs after the stored ones; what attention sees (stored ++ new, exact)."""
        if self.skip:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            return self.keys, self.values
        # 1. the first tokens are also kept exactly, as sinks
        n_sink = min(max(self.sink_tokens - self.sink_k.shape[-2], 0), key_states.shape[-2])
        if n_sink:
            self.sink_k = torch.cat([self.sink_k, key_states[:, :, :n_sink]], dim=-2)
            self.sink_v = torch.cat([self.sink_v, value_states[:, :, :n_sink]], dim=-2)
        # 2. everything joins the tail; what attention sees now (new tokens exact), and what
        #    staging keeps of the tail (the new tokens as staged)
        old_k, old_v = self.keys, self.values
        self.keys = torch.cat([old_k, key_states], dim=-2)
        self.values = torch.cat([old_v, value_states], dim=-2)
        kept_k, kept_v = self.keys, self.values
        if self.staging_dtype == "int8":
            kept_k = torch.cat([old_k, absmax_int8_roundtrip(key_states).to(old_k.dtype)], dim=-2)
            kept_v = torch.cat([old_v, absmax_int8_roundtrip(value_states).to(old_v.dtype)],
                               dim=-2)
        full_k, full_v = self.decoded()
        # 3. encode every full block of the tail
        n_full = self.keys.shape[-2] // self.block_tokens
        if n_full:
            m = n_full * self.block_tokens
            start = self.n_blocks * self.block_tokens
            rel = self._relevance(full_k, full_v, start, start + m)
            if rel is not None and self.visual is not None:
                B, n = rel.shape[0], m // self.block_tokens  # ranked per group, as the pages
                vis = self.visual.between(start, start + m, B).reshape(B * n, -1)
                rel = rank_protected(rel.reshape(B * n, self.block_tokens, -1), vis.to(rel.device),
                                     self.visual.protect_first).reshape(rel.shape)
            keys, values = self.keys[:, :, :m], self.values[:, :, :m]
            s = min(self.sink_tokens, self.block_tokens)
            if start == 0 and s:  # group 0, as the pages code it: sink rows never count
                keys, values = keys.clone(), values.clone()
                mask_sink_rows(keys[:, :, :self.block_tokens], s, dim=-2)
                mask_sink_rows(values[:, :, :self.block_tokens], s, dim=-2)
                if rel is not None:
                    rel = rel.clone()
                    rel[:, :s] = SINK_RELEVANCE
            pk = self._encode("k", self.key_codec, keys, rel if self.key_codec.uses_relevance else None)
            pv = self._encode("v", self.value_codec, values,
                              rel if self.value_codec.uses_relevance else None)
            self.packed_k = pk if self.packed_k is None else torch.cat([self.packed_k, pk], dim=1)
            self.packed_v = pv if self.packed_v is None else torch.cat([self.packed_v, pv], dim=1)
            if self.window_groups:
                keep = self.window_groups * self.block_tokens
                self.window_k = torch.cat([x for x in (self.window_k, kept_k[:, :, :m])
                                           if x is not None], dim=-2)[:, :, -keep:].clone()
                self.window_v = torch.cat([x for x in (self.window_v, kept_v[:, :, :m])
                                           if x is not None], dim=-2)[:, :, -keep:].clone()
            # an evicted layer's later groups lie past the leading window (key_pos: evicted)
            lead = min(m, self.lead_groups * self.block_tokens - start) \
                if self.key_pos is None else 0
            if lead > 0:
                self.lead_k = torch.cat([x for x in (self.lead_k, kept_k[:, :, :lead])
                                         if x is not None], dim=-2).clone()
                self.lead_v = torch.cat([x for x in (self.lead_v, kept_v[:, :, :lead])
                                         if x is not None], dim=-2).clone()
            kept_k, kept_v = kept_k[:, :, m:].clone(), kept_v[:, :, m:].clone()
        self.keys, self.values = kept_k, kept_v
        if n_full and not self.attend_new_exact:
            full_k, full_v = self.decoded()
        return full_k, full_v

    # -- eviction ----------------------------------------------------------------
    def exact(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact K/V [B, H, length, D] of every token written so far (before eviction)."""
        require(self.key_pos is None, f"layer {self.layer_idx} state", "not evicted yet", "evicted")
        if self.skip:
            return self.keys, self.values
        require(self.evictable, f"layer {self.layer_idx}", "made with evictable=True to evict", False)
        return torch.cat(self.exact_k, dim=-2), torch.cat(self.exact_v, dim=-2)

    def compact(self, kept: torch.Tensor) -> None:
        """Keep only the pairs at sorted positions ``kept``, stored as if written in order."""
        k, v = self.exact()
        kept = kept.to(torch.long).cpu()
        require(kept.numel() == 0 or (int(kept.min()) >= 0 and int(kept.max()) < self.length
                                      and bool((kept[1:] > kept[:-1]).all())),
                "kept positions", f"sorted, unique, in [0, {self.length})", kept.tolist()[:16])
        k, v = k[:, :, kept.to(k.device)], v[:, :, kept.to(k.device)]
        if self.skip:
            self.keys, self.values = k, v
        else:
            length, queries = self.length, (self.q_obs, self.q_first, self.q_scale)
            self._reset_state()
            self.lazy_initialization(k[:, :, :0], v[:, :, :0])
            self.length = length
            self.q_obs, self.q_first, self.q_scale = queries
            # before _store: relevance is causal by original position, and the rewritten
            # groups do not refill the leading window
            self.key_pos = kept
            self._store(k, v)
            # rewritten groups are read from their codes, as the vLLM backend does after
            # compacting (its window slots are released); later groups refill the residual
            # window, never the leading one (their positions are past it)
            self.window_k = self.window_v = None
        self.key_pos = kept
        self.exact_k, self.exact_v = [], []

    # -- accounting ------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """Bytes held by this layer (K and V together), and their bf16 equivalents."""
        if not self.is_initialized:
            return dict(tokens=0, stored_tokens=0, packed_tokens=0, packed_bytes=0, full_precision_bytes=0,
                        total_bytes=0, bf16_bytes=0, packed_bf16_bytes=0)
        B, H = self.keys.shape[:2]
        D = self.keys.shape[-1]
        packed_tokens = self.n_blocks * self.block_tokens
        packed = 0 if self.packed_k is None else self.packed_k.numel() + self.packed_v.numel()
        fp = sum(t.numel() * t.element_size() for t in (self.sink_k, self.sink_v, self.keys, self.values,
                                                         self.window_k, self.window_v,
                                                         self.lead_k, self.lead_v)
                 if t is not None)
        stored = packed_tokens + self.keys.shape[-2]
        return dict(tokens=self.length, stored_tokens=stored, packed_tokens=packed_tokens, packed_bytes=packed,
                    full_precision_bytes=fp, total_bytes=packed + fp,
                    bf16_bytes=B * H * D * 2 * 2 * self.length,
                    packed_bf16_bytes=B * H * D * 2 * 2 * packed_tokens)


class HeadSplitLayer(DynamicLayer):
    """A layer whose KV heads are coded by different codec pairs (retrieval heads,
    :mod:`vllm_lowbit_kv.retrieval_heads`): one :class:`LowBitLayer` per part over its KV
    heads (``heads[i]``), K/V split by head on the way in and put back in head order on
    the way out; the vLLM pages hold the same parts (``paged.HeadSplitLayout``)."""

    is_croppable = False

    def __init__(self, parts: list[LowBitLayer], heads: list[tuple[int, ...]]):
        super().__init__()
        self.parts, self.heads = parts, [tuple(h) for h in heads]
        #: STP parts score relevance with their own query heads
        self.wants_queries = any(part.wants_queries for part in parts)
        self.obs_window = parts[0].obs_window
        order = torch.tensor([h for hs in self.heads for h in hs])
        self._index = [torch.tensor(h) for h in self.heads]
        self._inverse = torch.argsort(order)  # concatenated parts -> head order

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        self.is_initialized = True
        outs = [part.update(key_states[:, idx.to(key_states.device)],
                            value_states[:, idx.to(value_states.device)])
                for part, idx in zip(self.parts, self._index)]
        inv = self._inverse.to(key_states.device)
        return (torch.cat([k for k, _ in outs], dim=1)[:, inv],
                torch.cat([v for _, v in outs], dim=1)[:, inv])

    def record_queries(self, q: torch.Tensor, first_pos: int, scale: float) -> None:
        """q [B, Hq, S, D]: each part records the query heads of its KV heads (GQA)."""
        group = q.shape[1] // sum(len(h) for h in self.heads)
        for part, idx in zip(self.parts, self._index):
            if part.wants_queries:
                part.record_queries(q[:, query_heads(idx, group).to(q.device)], first_pos, scale)

    def get_seq_length(self) -> int:
        return self.parts[0].get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        for part in self.parts:
            part.reset()

    def crop(self, tokens_to_remove: int) -> None:
        self.parts[0].crop(tokens_to_remove)

    def exact(self):
        require(False, "retrieval_heads", "0 to evict (eviction plans whole layers)", len(self.parts))

    def memory(self) -> dict[str, int]:
        per_part = [part.memory() for part in self.parts]
        out = {k: sum(m[k] for m in per_part) for k in per_part[0]}
        out["tokens"], out["stored_tokens"], out["packed_tokens"] = (
            per_part[0]["tokens"], per_part[0]["stored_tokens"], per_part[0]["packed_tokens"])
        return out
