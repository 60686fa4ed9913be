"""Group states written by a kernel against the codecs' (the reference store): the Triton
store kernel (tests/test_triton_ops.py) and the C++ encoder (tests/test_cpu_encoder.py).

Fields the codecs compute without a sum over tokens (min-max codes, scales and zeros, the
channel and token masks) must be bit-identical; the fields whose thresholds are float32
means (VidKV 1-bit components, ternary values) must have identical codes except at
elements within float32 rounding of their threshold, and their fp16 levels within one step.
RVQ (a greedy nearest-code search): the fp16 std within one step, and a token's indices
identical up to the first stage where the two chosen codes' distances tie within float32
rounding (the rest of that token's search follows from the other residual).
"""

import torch

from vllm_lowbit_kv.codecs.bitpack import unpack_bits
from vllm_lowbit_kv.codecs.rvq import RVQCodec, channel_groups
from vllm_lowbit_kv.codecs.vidkv import rfft_unique

EXACT_FIELDS = {"codes", "scale", "zero", "chan_mask", "scale2", "zero2", "codes2",
                "tok_mask", "prot_codes", "prot_scale", "prot_zero"}


def fields(codec, states):
    return codec.layout().split(states.reshape(-1, states.shape[-1])[:, :codec.nbytes].cpu())


def tie_margin_ok(name, codec, x, mismatch, rel=None):
    """Every differing code lies within float32 rounding of its threshold: the reference's
    decision value recomputed in float64 (x: the group's float input [G, T, D])."""
    G, T, D = x.shape
    x = x.double()
    if name == "trits":
        n_p = codec.n_protect
        if n_p:  # the unprotected tokens, in order (the reference's token permutation)
            order = torch.sort(rel.double(), dim=-1, descending=True, stable=True).indices
            keep = torch.zeros(G, T, dtype=torch.bool).scatter(1, order[:, :n_p], True)
            x = torch.stack([x[g][~keep[g]] for g in range(G)])
        a = x.abs()
        margin = a - codec.gamma * a.mean(1, keepdim=True)  # trit != 0 iff margin > 0
        scale = a.amax(1, keepdim=True)
    else:  # codes1: the 1-bit components, split by the codec's one_bit mode
        rng = x.amax(1) - x.amin(1)
        two = torch.zeros(G, D, dtype=torch.bool).scatter(
            1, torch.sort(rng, dim=1, descending=True, stable=True).indices[:, :codec.n2], True)
        y = torch.stack([x[g][:, ~two[g]] for g in range(G)])
        if codec.fft_active:
            y = rfft_unique(y)
        if codec.one_bit == "sign":  # bit = y > 0
            margin = y
        elif codec.one_bit == "minmax":  # bit = round((y - lo) / (hi - lo)), fp16 levels
            lo = y.amin(1, keepdim=True).half().double()
            hi = y.amax(1, keepdim=True).half().double()
            margin = y - (lo + hi) / 2
        else:  # "mean": bit = y > mean
            margin = y - y.mean(1, keepdim=True)
        scale = y.abs().amax(1, keepdim=True)
    where = mismatch.reshape(margin.shape)
    return bool((margin.abs() <= 1e-5 * scale)[where].all())


def assert_rvq_agree(codec, a, b, xg):
    """RVQ fields a (reference), b (kernel) of groups xg [G, T, D] (module doc)."""
    sa = a["std"].contiguous().view(torch.float16).float()
    sb = b["std"].contiguous().view(torch.float16).float()
    assert bool(((sa - sb).abs() <= sa.abs() * 2.0 ** -10).all()), "std: more than one fp16 step"
    G, T, D = xg.shape
    K, n, d = codec.num_codebooks, codec.n_groups, codec.group_size
    ia, ib = (unpack_bits(f["codes"], codec.index_bits, T * n * K).long().reshape(-1, K)
              for f in (a, b))
    std_moved = (sa != sb).reshape(-1).repeat_interleave(n)  # its rows' residuals all differ
    rows = (ia != ib).any(1)
    flips = int((rows | std_moved).sum())  # rare: at most 0.1% of the rows (2 in a small sample)
    assert flips <= max(2, 1e-3 * rows.numel()), f"codes: {flips} of {rows.numel()} rows differ"
    rows &= ~std_moved
    if not rows.any():
        return
    books = codec.codewords.double()
    s = sa.double().reshape(G, T, 1)
    z = channel_groups(xg.double() / torch.where(s > 0, s, torch.ones_like(s)), d,
                       codec.grouping).reshape(-1, d)
    for r in rows.nonzero()[:, 0].tolist():
        res = z[r].clone()
        for k in range(K):
            ca, cb = books[k][ia[r, k]], books[k][ib[r, k]]
            if ia[r, k] != ib[r, k]:  # a tie within float32 rounding of the distances
                gap = float((res - cb).square().sum() - (res - ca).square().sum())
                scale = float(res.square().sum() + ca.square().sum() + cb.square().sum())
                assert abs(gap) <= 1e-5 * scale, f"codes: row {r} stage {k} not at a tie"
                break
            res -= ca


def assert_states_agree(layout, ref, got, k, v, rel):
    """Field-by-field comparison of reference and kernel states [E, H, C] (module doc)."""
    kb = layout.format.k_bytes
    for codec, lo, hi, x in ((layout.key_codec, 0, kb, k), (layout.value_codec, kb, None, v)):
        a, b = fields(codec, ref[..., lo:hi]), fields(codec, got[..., lo:hi])
        xg = x.float().permute(0, 2, 1, 3).reshape(-1, layout.T, layout.D)  # [E*H, T, D]
        if isinstance(codec, RVQCodec):
            assert_rvq_agree(codec, a, b, xg)
            continue
        rg = None if rel is None else rel.permute(0, 2, 1).reshape(-1, layout.T)
        moved = None  # [G, columns]: components / channels in which a code flipped at a tie
        for name in sorted(a, key=lambda f: f not in ("codes1", "trits")):  # codes first
            if name in EXACT_FIELDS:
                assert torch.equal(a[name], b[name]), f"{type(codec).__name__}.{name} differs"
            elif name in ("codes1", "trits"):
                if name == "codes1":
                    ca = ((a[name].unsqueeze(-1) >> torch.arange(8)) & 1).flatten(1)
                    cb = ((b[name].unsqueeze(-1) >> torch.arange(8)) & 1).flatten(1)
                    rows, cols = layout.T, codec.n1
                else:
                    p3 = 3 ** torch.arange(5)
                    ca = ((a[name].long().unsqueeze(-1) // p3) % 3).flatten(1)
                    cb = ((b[name].long().unsqueeze(-1) // p3) % 3).flatten(1)
                    rows, cols = codec.n_low, layout.D
                mismatch = ca[:, :rows * cols] != cb[:, :rows * cols]
                flips = int(mismatch.sum())  # rare: at most 0.1% (2 in a small sample)
                assert flips <= max(2, 1e-3 * mismatch.numel()), f"{name}: {flips} codes differ"
                if mismatch.any():
                    assert tie_margin_ok(name, codec, xg, mismatch, rg), f"{name}: not at ties"
                moved = mismatch.reshape(-1, rows, cols).any(1)
            else:  # fp16 levels: lo1/hi1/s1/alpha, from the codes of their column
                fa = a[name].contiguous().view(torch.float16).float()
                fb = b[name].contiguous().view(torch.float16).float()
                # float32 rounding of the sums moves a level by up to ~1e-5 of the group's
                # largest magnitude (components are bounded by it), one fp16 step beyond
                noise = 1e-5 * xg.abs().amax((1, 2)).unsqueeze(1).expand_as(fa)
                if moved is not None:  # a code that flipped at a tie moves its column's level
                    fa, fb, noise = fa[~moved], fb[~moved], noise[~moved]
                step = torch.maximum(fa.abs(), fb.abs()) * 2.0 ** -10 + 2.0 ** -24 + noise
                assert bool(((fa - fb).abs() <= step).all()), f"{name}: more than one fp16 step"
                # rare (a level's last float32 bit rounding to the other fp16 neighbour)
                differ = int((fa != fb).sum())
                assert differ <= max(1, 0.02 * fa.numel()), f"{name}: {differ} levels differ"
