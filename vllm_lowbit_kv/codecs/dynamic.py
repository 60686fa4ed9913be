"""Dynamic KV quantization: EMA recorders, normalization, outlier-driven groups (seed 004).

Fan & Chen, "Efficient Multimodal Large Language Model via Dynamic KV Cache
Quantization" (seeds/004):

    eq. 7-8    K per channel c:  s = (max K_c - min K_c) / (2^B - 1), z = min K_c,
               Q(K_c) = floor((K_c - z) / s), K'_c = Q(K_c) s + z
    eq. 9-10   V per token t: the same with V_t
    eq. 11-14  recorders  mu^(t)  = lam mu^(t-1) + (1 - lam) E[X^(t)]
                          sig^(t) = lam sig^(t-1) + (1 - lam) sqrt(E[(X^(t) - mu^(t))^2])
    eq. 15-16  S = 1 / (sig + eps),  X' = (X - mu) * S   (K; eq. 18-19 for V)
    eq. 17     auto-relaxation X'' = X' alpha + beta with learned alpha, beta
    eq. 20     O_d = #{i : |X_id| > tau sig_d} / N   (outlier proportion of dim d)
    eq. 21     G_d = ceil(G_total O_d / sum_c O_c)  (groups of dim d, fixed total)

What this implementation does, per (block, head) group [T, D]:

1. Recorders (eq. 11-14) are per-channel vectors mu, sig in R^D for K and V
   alike (eq. 16/19 apply them elementwise), with E[.] over the block's
   tokens. A block is one recorder update; the paper's lam is per decoding
   step (token), so a block of T tokens uses lam_block = ``ema`` ** T
   (paper: update rate 0.01, so ``ema`` = 0.99). With no prior state the
   recorder starts at the block's own statistics; eq. 12 centres with the
   updated mu^(t), as written.
2. Normalization (eq. 15-16, 18-19) with mu and sig rounded to fp16 first and
   those fp16 values stored in the block, so decode needs nothing but the
   block's bytes: X = X'_hat (sig + eps) + mu. Safety: sig is raised to at
   least max_i |X_i - mu| / 1024 so a stale recorder (sig ~ 0, then a large
   block) cannot push normalized values or scales past fp16; normal data
   never reaches this floor.
3. Where the recorders change the result: a per-channel affine map commutes
   with per-channel min-max (the group's min and max move with it, codes are
   identical in exact arithmetic). So for ``axis="channel"`` (K, eq. 7-8)
   normalization only adds fp16 rounding and 4*D bytes; it is off by default
   (``normalize=None`` -> False) and the key codec is per-channel min-max
   with fine-grained token groups. Only groups that span several channels
   (``axis="token"``, V, eq. 9-10) are changed by the recorders:
   normalization rescales each channel before the token's shared range is
   taken, so wide channels no longer set every token's step. On by default
   there. eq. 17 needs learned alpha, beta we do not have; identity
   (alpha=1, beta=0) is used.
4. Fine-grained groups (eq. 20-21) with a fixed byte budget: each of the
   n_dims dimensions (channels for ``axis="channel"``, groups along tokens;
   tokens for ``axis="token"``, groups along channels, both as the paper's
   section 3.3 defines them) is split into groups of ``group_size``; the
   S = floor(fine_fraction * n_dims + 1/2) dimensions with the largest
   outlier proportion are split further into groups of ``fine_group_size``.
   This is eq. 21's fixed total G_total = n_dims * n_base + S * (n_fine -
   n_base) with two granularities; a 1-bit-per-dimension mask says which
   dims are fine. (Reserving bytes for the finest grouping everywhere and
   then choosing coarser groups would only lose accuracy at the same cost,
   so the budget, not the choice, is what must be fixed.)
   Outlier proportion: eq. 20 on the (normalized) block with sig_d the
   dimension's own std, centred at its own mean (|x - mean_d| > tau sig_d;
   centring makes the choice affine invariant, so it is the same with or
   without normalization on the channel axis); tau = 3 (paper: "2 to 3").
   Ties, common at 64 elements, go to the larger peak max |x - mean_d| /
   sig_d, then to the lower index. By Chebyshev at most 1/tau^2 of a
   dimension can count, so clustered spikes rank by the peak. The paper's
   "beta = 0.2 (outlier threshold)" does not fit eq. 20 as a std multiplier
   (0.2 sig would flag ~84% of Gaussian values); we use tau from eq. 20 and
   a fine budget of 0.25 of the dimensions.
5. Rounding: eq. 8/10 floor; we round to nearest as KIVI and ``quant.py`` do
   (half a step of error instead of a full one). Scale and zero are fp16,
   rounded before the codes are computed (``quant.minmax_params``). B >= 2:
   a 1-bit scale equals the range, which overflows fp16 for un-normalized
   data near +-65504.

Stored per (block, head), T tokens, D channels, B bits, in this order:
    codes   T*D*B bits, packed along channels (token-major), bitpack order
    scale   fp16 x n_groups, dimension-major: dim d's groups in order, each
            dim holding n_fine slots if masked, else n_base
    zero    fp16 x n_groups, same order
    mean    fp16 x D, only when normalizing
    std     fp16 x D (sig actually used; decode multiplies by std + eps)
    mask    n_dims bits (1 = fine groups), only when 0 < S < n_dims; last so
            that the fp16 fields stay 2-byte aligned

Defaults at T=64, D=64 (group 64, fine group 32, fine_fraction 0.25, so
S=16 and 80 groups): K (channel) 4.641 bits at B=4, 2.641 at B=2;
V (token, normalized) 5.141 / 3.141 (of which 0.5 is mean + std).

State: :meth:`BlockCodec.encode` is stateless (each block normalized by its
own statistics, i.e. a fresh recorder). :meth:`DynamicCodec.encode_stream`
takes the blocks of one sequence in order plus an explicit
:class:`RecorderState` and returns the new state; the codec object itself
holds no mutable state.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .base import FP16_MAX, BlockCodec, Layout, require, require_fp16_range
from .bitpack import from_bytes, pack_bits, packed_len, to_bytes, unpack_bits
from .quant import dequantize, minmax_params, quantize

AXES = ("channel", "token")
#: normalized magnitudes are kept below this by the sig floor (fp16 safety)
NORM_LIMIT = 1024.0


class RecorderState(NamedTuple):
    """EMA recorder (eq. 11-14) of one sequence: float32 [..., kv_heads, head_dim] each."""

    mean: torch.Tensor
    std: torch.Tensor


class DynamicCodec(BlockCodec):
    """Recorder-normalized min-max codec with outlier-driven fine groups.

    ``axis='channel'`` for keys (groups along tokens inside a channel),
    ``'token'`` for values (groups along channels inside a token).
    """

    def __init__(self, block_tokens: int, head_dim: int, bits: int = 4,
                 axis: str = "channel", ema: float = 0.99, normalize: bool | None = None,
                 group_size: int | None = None, fine_group_size: int | None = None,
                 fine_fraction: float = 0.25, tau: float = 3.0, eps: float = 1e-6):
        super().__init__(block_tokens, head_dim)
        require(bits in (2, 4, 8) and not isinstance(bits, bool), "bits", "one of (2, 4, 8)", bits)
        require(axis in AXES, "axis", f"one of {AXES}", axis)
        require(isinstance(ema, (int, float)) and not isinstance(ema, bool) and 0.0 <= ema < 1.0,
                "ema", "a float in [0, 1)", ema)
        normalize = (axis == "token") if normalize is None else normalize
        require(isinstance(normalize, bool), "normalize", "a bool or None", normalize)
        L = block_tokens if axis == "channel" else head_dim  # elements per dimension
        group_size = L if group_size is None else group_size
        require(isinstance(group_size, int) and not isinstance(group_size, bool)
                and group_size >= 1 and L % group_size == 0,
                "group_size", f"a divisor of {L}", group_size)
        if fine_group_size is None:
            fine_group_size = group_size // 2 if group_size % 2 == 0 else group_size
        require(isinstance(fine_group_size, int) and not isinstance(fine_group_size, bool)
                and fine_group_size >= 1 and group_size % fine_group_size == 0,
                "fine_group_size", f"a divisor of group_size={group_size}", fine_group_size)
        require(isinstance(fine_fraction, (int, float)) and not isinstance(fine_fraction, bool)
                and 0.0 <= fine_fraction <= 1.0, "fine_fraction", "a float in [0, 1]", fine_fraction)
        require(isinstance(tau, (int, float)) and not isinstance(tau, bool) and tau > 0
                and tau < float("inf"), "tau", "a finite float > 0", tau)
        require(isinstance(eps, (int, float)) and not isinstance(eps, bool) and 0 < eps <= 1e-2,
                "eps", "a float in (0, 0.01]", eps)
        self.bits, self.axis, self.ema, self.normalize = bits, axis, float(ema), normalize
        self.group_size, self.fine_group_size = group_size, fine_group_size
        self.fine_fraction, self.tau, self.eps = float(fine_fraction), float(tau), float(eps)
        self.n_dims = head_dim if axis == "channel" else block_tokens
        self.dim_len = L
        self.n_base, self.n_fine = L // group_size, L // fine_group_size
        n_split = int(self.fine_fraction * self.n_dims + 0.5)
        self.n_split = n_split if self.n_fine > self.n_base else 0

    # -- layout --------------------------------------------------------------
    @property
    def stores_mask(self) -> bool:
        return 0 < self.n_split < self.n_dims

    @property
    def n_groups(self) -> int:
        return self.n_dims * self.n_base + self.n_split * (self.n_fine - self.n_base)

    def layout(self) -> Layout:
        fields = [("codes", packed_len(self.block_tokens * self.head_dim, self.bits)),
                  ("scale", 2 * self.n_groups), ("zero", 2 * self.n_groups)]
        if self.normalize:
            fields += [("mean", 2 * self.head_dim), ("std", 2 * self.head_dim)]
        if self.stores_mask:  # last, so the fp16 fields stay 2-byte aligned
            fields.append(("mask", packed_len(self.n_dims, 1)))
        return Layout(tuple(fields))

    # -- recorder (eq. 11-14) --------------------------------------------------
    def update_recorder(self, x: torch.Tensor, mean: torch.Tensor | None,
                        std: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One block's EMA update: x float32 [G, T, D], prior [G, D] or None -> (mu, sig) [G, D]."""
        block_mean = x.mean(dim=1)
        if mean is None:
            mu = block_mean
            return mu, (x - mu.unsqueeze(1)).pow(2).mean(dim=1).sqrt()
        lam = self.ema ** self.block_tokens
        mu = lam * mean + (1.0 - lam) * block_mean
        spread = (x - mu.unsqueeze(1)).pow(2).mean(dim=1).sqrt()
        return mu, lam * std + (1.0 - lam) * spread

    # -- dims view: [G, T, D] <-> [G, n_dims, dim_len] ----------------------------
    def _dims(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2) if self.axis == "channel" else x

    def _undims(self, xd: torch.Tensor) -> torch.Tensor:
        return xd.transpose(1, 2) if self.axis == "channel" else xd

    def _select(self, xd: torch.Tensor) -> torch.Tensor:
        """bool [G, n_dims]: the n_split dims with most outliers (eq. 20) get fine groups."""
        G = xd.shape[0]
        if self.n_split == 0:
            return torch.zeros(G, self.n_dims, dtype=torch.bool, device=xd.device)
        if self.n_split == self.n_dims:
            return torch.ones(G, self.n_dims, dtype=torch.bool, device=xd.device)
        dev = (xd - xd.mean(dim=-1, keepdim=True)).abs()
        sd = dev.pow(2).mean(dim=-1).sqrt()
        count = (dev > self.tau * sd.unsqueeze(-1)).sum(dim=-1)
        peak = dev.amax(dim=-1) / torch.where(sd > 0, sd, torch.ones_like(sd))
        # order by (count desc, peak desc, index asc): two stable sorts
        p1 = torch.sort(peak, dim=-1, descending=True, stable=True).indices
        p2 = torch.sort(count.gather(-1, p1), dim=-1, descending=True, stable=True).indices
        top = p1.gather(-1, p2)[:, :self.n_split]
        mask = torch.zeros(G, self.n_dims, dtype=torch.bool, device=xd.device)
        return mask.scatter_(-1, top, True)

    def _slots(self, mask: torch.Tensor) -> torch.Tensor:
        """long [G, n_dims, n_fine]: metadata slot of each fine sub-group."""
        r = self.n_fine // self.n_base
        count = torch.where(mask, self.n_fine, self.n_base)
        offset = torch.cumsum(count, dim=-1) - count
        j = torch.arange(self.n_fine, device=mask.device)
        within = torch.where(mask.unsqueeze(-1), j, torch.div(j, r, rounding_mode="floor"))
        return offset.unsqueeze(-1) + within

    # -- encode / decode -------------------------------------------------------
    def encode_with(self, x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
        """float32 [G, T, D] with recorder values (mu, sig) [G, D] -> uint8 [G, nbytes].

        For backends that keep their own recorder; inputs are not range-checked here.
        """
        G, T, D = x.shape
        parts: dict[str, torch.Tensor] = {}
        xn = x
        if self.normalize:
            mu16 = mean.clamp(-FP16_MAX, FP16_MAX).half()
            centred = x - mu16.float().unsqueeze(1)
            floor = centred.abs().amax(dim=1) / NORM_LIMIT
            sd16 = torch.maximum(std, floor).clamp(max=FP16_MAX).half()
            xn = centred / (sd16.float().unsqueeze(1) + self.eps)
            parts["mean"], parts["std"] = to_bytes(mu16), to_bytes(sd16)
        xd = self._dims(xn)
        mask = self._select(xd)
        r = self.n_fine // self.n_base
        xf = xd.reshape(G, self.n_dims, self.n_fine, self.fine_group_size)
        lo_f, hi_f = xf.amin(dim=-1), xf.amax(dim=-1)
        lo_c = lo_f.reshape(G, self.n_dims, self.n_base, r).amin(dim=-1).repeat_interleave(r, dim=-1)
        hi_c = hi_f.reshape(G, self.n_dims, self.n_base, r).amax(dim=-1).repeat_interleave(r, dim=-1)
        fine = mask.unsqueeze(-1)
        scale, zero = minmax_params(torch.where(fine, lo_f, lo_c), torch.where(fine, hi_f, hi_c),
                                    self.bits)
        codes = quantize(xf, scale.unsqueeze(-1), zero.unsqueeze(-1), self.bits)
        codes = self._undims(codes.reshape(G, self.n_dims, self.dim_len))
        slot = self._slots(mask).reshape(G, -1)
        scale_s = torch.zeros(G, self.n_groups, dtype=torch.float16, device=x.device)
        zero_s = torch.zeros_like(scale_s)
        scale_s.scatter_(1, slot, scale.reshape(G, -1))
        zero_s.scatter_(1, slot, zero.reshape(G, -1))
        parts["codes"] = pack_bits(codes.reshape(G, -1), self.bits)
        parts["scale"], parts["zero"] = to_bytes(scale_s), to_bytes(zero_s)
        if self.stores_mask:
            parts["mask"] = pack_bits(mask.to(torch.uint8), 1)
        return self.layout().join(parts)

    def encode_groups(self, x, relevance=None):
        return self.encode_with(x, *self.update_recorder(x, None, None))

    def decode_groups(self, packed):
        G, T, D = packed.shape[0], self.block_tokens, self.head_dim
        f = self.layout().split(packed)
        if self.stores_mask:
            mask = unpack_bits(f["mask"], 1, self.n_dims).bool()
        else:
            mask = torch.full((G, self.n_dims), self.n_split > 0, dtype=torch.bool,
                              device=packed.device)
        slot = self._slots(mask).reshape(G, -1)
        scale = from_bytes(f["scale"], torch.float16).gather(1, slot)
        zero = from_bytes(f["zero"], torch.float16).gather(1, slot)
        shape = (G, self.n_dims, self.n_fine, 1)
        codes = self._dims(unpack_bits(f["codes"], self.bits, T * D).reshape(G, T, D))
        codes = codes.reshape(G, self.n_dims, self.n_fine, self.fine_group_size)
        xd = dequantize(codes, scale.reshape(shape), zero.reshape(shape))
        x = self._undims(xd.reshape(G, self.n_dims, self.dim_len))
        if self.normalize:
            mu = from_bytes(f["mean"], torch.float16).float().unsqueeze(1)
            sd = from_bytes(f["std"], torch.float16).float().unsqueeze(1)
            x = x * (sd + self.eps) + mu
        return x.contiguous()

    # -- streaming with explicit recorder state -------------------------------------
    def encode_stream(self, blocks: torch.Tensor, state: RecorderState | None = None
                      ) -> tuple[torch.Tensor, RecorderState]:
        """Encode consecutive blocks of one sequence (per leading index), threading the recorder.

        ``blocks``: [..., N, T, kv_heads, D], block n after block n-1;
        ``state``: the recorder after the previous block (None: fresh).
        Returns (uint8 [..., N, kv_heads, nbytes], state after block N-1). Every
        block's bytes decode alone with :meth:`decode`; with ``ema=0`` the result
        equals :meth:`encode` of each block.
        """
        T, D = self.block_tokens, self.head_dim
        require(blocks.dim() >= 4 and blocks.shape[-4] >= 1 and blocks.shape[-3] == T
                and blocks.shape[-1] == D,
                "blocks.shape", f"[..., n_blocks, {T}, kv_heads, {D}]", tuple(blocks.shape))
        x32 = blocks.float()
        require_fp16_range(x32)
        lead, N, H = x32.shape[:-4], x32.shape[-4], x32.shape[-2]
        # [..., N, T, H, D] -> [N, G, T, D] with G = prod(lead) * H
        xg = x32.movedim(-2, -3).movedim(-4, 0).reshape(N, -1, T, D)
        mean = std = None
        if state is not None:
            want = (*lead, H, D)
            ok = (isinstance(state, tuple) and len(state) == 2
                  and all(isinstance(s, torch.Tensor) and tuple(s.shape) == want for s in state))
            require(ok, "state", f"RecorderState(mean, std) of shape {want}",
                    tuple(getattr(s, "shape", s) for s in state) if isinstance(state, tuple) else state)
            mean = state[0].float().reshape(-1, D)
            std = state[1].float().reshape(-1, D)
            require(bool(torch.isfinite(mean).all() and torch.isfinite(std).all()
                         and (std >= 0).all()), "state", "finite, with std >= 0", "non-finite values")
        out = []
        for n in range(N):
            mean, std = self.update_recorder(xg[n], mean, std)
            out.append(self.encode_with(xg[n], mean, std))
        packed = torch.stack(out).reshape(N, *lead, H, self.nbytes).movedim(0, -3)
        return packed, RecorderState(mean.reshape(*lead, H, D), std.reshape(*lead, H, D))
