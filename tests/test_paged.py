"""Packed paged layout + staging + sinks + STP + attention, checked against references.

References: (1) a dense one, the same codec applied to every complete T-token
group of a sequence (fake quantization), the partial last group exact, sink
positions exact, plain causal attention with the fresh tokens in full
precision; (2) for STP, the transformers yardstick's own layer
(``hf_cache.LowBitLayer`` fed the same K/V/queries chunk by chunk): the packed
bytes must be identical.
"""

import dataclasses

import pytest
import torch

from vllm_lowbit_kv.hf_cache import LowBitLayer
from vllm_lowbit_kv.hf_cache.layer import VisualTokens
from vllm_lowbit_kv.paged import (PagedLayout, Staging, StagingAllocator, apply_writes, attend,
                                  attention_mass, forward_layer, mask_sink_rows)
from vllm_lowbit_kv.paged.write import encode_groups, stage_tokens
from vllm_lowbit_kv.schemes import get_scheme

H, HQ, D = 3, 9, 64


def make(scheme="kivi2", T=16, block_size=32, num_blocks=64, slots=8, sinks=0, q_heads=None,
         window=0, lead=0, **params):
    s = get_scheme(scheme)
    if params:
        s = s.with_params(**params)
    kc, vc = s.codecs(D, T)
    layout = PagedLayout(kc, vc, H, block_size, sinks, rotation=s.rotation(D, 0),
                         protect_first=s.protect_first)
    pages = torch.zeros(layout.page_shape(num_blocks), dtype=torch.uint8)
    staging = Staging.allocate(slots, T, H, D, torch.bfloat16, q_heads,
                               staging_dtype=s.staging_dtype)
    return layout, pages, staging, StagingAllocator(slots, T, sinks, window, lead)


def fake_quant(layout, k_seq, v_seq, sinks=0, upto=None, window=0, lead=0):
    """Every group complete within the first ``upto`` tokens (default: all) through the
    codec (group 0's sink rows replaced by copies of its first other row before encoding),
    except the last ``window`` of them (the residual window) and the first ``lead`` of the
    others (the leading window); sink positions and the rest exact."""
    T = layout.T
    L = k_seq.shape[0] if upto is None else upto
    kk, vv = k_seq.float().clone(), v_seq.float().clone()
    n = max(L // T - window, 0)
    if n:
        tk = k_seq[: n * T].float().reshape(n, T, H, D).clone()
        tv = v_seq[: n * T].float().reshape(n, T, H, D).clone()
        if 0 < sinks < T:
            tk[0, :sinks], tv[0, :sinks] = tk[0, sinks], tv[0, sinks]
        dk, dv = layout.decode(layout.encode(tk, tv))
        kk[: n * T], vv[: n * T] = dk.reshape(-1, H, D), dv.reshape(-1, H, D)
    exact = max(sinks, min(lead, n) * T)  # the leading window is read as staged, sinks too
    kk[:exact], vv[:exact] = k_seq[:exact].float(), v_seq[:exact].float()
    return kk, vv


def run_schedule(layout, pages, staging, alloc, seqs, tables, schedule, obs_window=None,
                 on_step=None, packed_attention=None, forward=forward_layer, visual=None):
    """Drive requests through steps of per-request token counts; return outputs per step
    (the packed context through ``packed_attention``, default the reference; each layer
    step through ``forward``; ``visual``: each request's visual token positions)."""
    bs = layout.block_size
    done = [0] * len(seqs)
    outs = []
    for step in schedule:
        qs, keys, vals, qrys, slots, seq_lens, rows = [0], [], [], [], [], [], []
        for r, n in enumerate(step):
            n = min(n, seqs[r][0].shape[0] - done[r])
            if n == 0:
                continue
            pos = torch.arange(done[r], done[r] + n)
            k, v, q = (x[pos] for x in seqs[r])
            keys.append(k); vals.append(v); qrys.append(q)
            slots.append(tables[r][pos // bs] * bs + pos % bs)
            done[r] += n
            seq_lens.append(done[r])
            qs.append(qs[-1] + n)
            rows.append(r)
        if not rows:
            continue
        key, value, query = torch.cat(keys), torch.cat(vals), torch.cat(qrys)
        bt = torch.stack([tables[r] for r in rows])
        wp, rp = alloc.plan_step(torch.cat(slots), seq_lens, qs, bt, layout.groups_per_block,
                                 visual=None if visual is None else [visual[r] for r in rows])
        out = torch.zeros(query.shape)
        forward(wp, rp, layout, query, key, value, pages, staging, D ** -0.5, out,
                obs_window, packed_attention)
        outs.append((rows, qs, seq_lens, out))
        if on_step:
            on_step(rows, qs, seq_lens, out)
    return done, outs


def rnd(*s):
    return torch.randn(*s).to(torch.bfloat16).float()  # bf16-valued, as vLLM's model produces


def test_page_bytes_proportional_and_aligned():
    layout, *_ = make("kivi2", T=64, block_size=128)
    kc, vc = layout.key_codec, layout.value_codec
    assert layout.page_bytes == 2 * H * (kc.nbytes + vc.nbytes)
    bf16 = 2 * H * D * 2 * 128
    eff = (kc.effective_bits + vc.effective_bits) / 2
    assert bf16 / layout.page_bytes == pytest.approx(16 / eff)
    # vidkv_stp's K+V is not a multiple of 4 bytes: padded (vLLM zeroes 4-byte words)
    lay, *_ = make("vidkv_stp", T=64, block_size=128)
    assert (lay.key_codec.nbytes + lay.value_codec.nbytes) % 4 and lay.state_bytes % 4 == 0
    assert lay.page_bytes % 4 == 0 and lay.state_bytes - lay.format.k_bytes - lay.format.v_bytes < 4
    # the sink area is counted: 2 * sinks * D bf16 per head per block
    sk, *_ = make("kivi2", T=64, block_size=128, sinks=4)
    assert sk.page_bytes - layout.page_bytes == H * 2 * 4 * D * 2
    assert sk.bits_per_element > layout.bits_per_element


def test_roundtrip_through_pages():
    layout, pages, *_ = make("vidkv_stp")
    k = torch.randn(5, layout.T, H, D)
    v = torch.randn(5, layout.T, H, D)
    gids = torch.tensor([7, 0, 33, 4, 100])
    layout.write_states(pages, gids, layout.encode(k, v))
    dk, dv = layout.decode(layout.read_states(pages, gids))
    ek, ev = layout.decode(layout.encode(k, v))
    assert torch.equal(dk, ek) and torch.equal(dv, ev)
    # the same bytes through vLLM's 4-d view of the cache
    N, C = layout.groups_per_block, layout.state_bytes
    dk4, _ = layout.decode(layout.read_states(pages.view(pages.shape[0], H, N, C), gids))
    assert torch.equal(dk4, ek)


@pytest.mark.parametrize("scheme,sinks,window,rotate,lead", [
    ("kivi2", 0, 0, "none", 0), ("kivi4", 0, 0, "none", 0), ("vidkv", 3, 0, "none", 0),
    ("kivi2", 16, 0, "none", 0), ("kivi2", 0, 2, "none", 0), ("vidkv", 3, 1, "none", 0),
    ("vidkv", 3, 3, "none", 0), ("kivi2", 0, 0, "hadamard", 0), ("vidkv", 3, 2, "hadamard", 0),
    ("vidkv", 3, 0, "none", 1), ("kivi2", 0, 1, "none", 2), ("vidkv", 3, 2, "hadamard", 1)])
def test_chunked_prefill_and_decode_match_reference(scheme, sinks, window, rotate, lead):
    """The packed groups read through the codec (rotated by the layout when it rotates:
    the reference decodes back to the model's space), the windows and tail exact (staged
    in the model dtype; int8 staging has its own test below)."""
    torch.manual_seed(0)
    layout, pages, staging, alloc = make(scheme, sinks=sinks, window=window, lead=lead,
                                         slots=3 * (window + lead + 1), rotate=rotate,
                                         staging_dtype="model")
    assert (layout.rotation is None) == (rotate == "none")
    T = layout.T
    scale = D ** -0.5
    lens = [70, 33, 5]
    perm = torch.randperm(pages.shape[0])
    tables = [perm[i * 8:(i + 1) * 8] for i in range(3)]
    seqs = [(rnd(L + 8, H, D), rnd(L + 8, H, D), rnd(L + 8, HQ, D)) for L in lens]
    schedule = [[20, 33, 5], [40, 0, 0], [10, 0, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]]

    def check(rows, qs, seq_lens, out):
        for i, r in enumerate(rows):
            L, n = seq_lens[i], qs[i + 1] - qs[i]
            k, v, q = (x[:L] for x in seqs[r])
            # the context as stored before this step: its complete groups through the
            # codec, its partial group exact (staged); the fresh tokens exact
            kk, vv = fake_quant(layout, k, v, sinks, upto=L - n, window=window, lead=lead)
            ref = attend(q[L - n:], kk, vv, L - n, scale)
            torch.testing.assert_close(out[qs[i]:qs[i + 1]], ref, atol=1e-4, rtol=0)
        assert alloc.in_use <= len(seqs) * (window + lead + 1)

    done, _ = run_schedule(layout, pages, staging, alloc, seqs, tables, schedule, on_step=check)
    # live partial groups and the windows' groups of each sequence hold slots; nothing else
    assert alloc.in_use == sum(min(window + lead, L // T) + (L % T > 0) for L in done)
    # and the pages hold every complete group, window or not
    for r, L in enumerate(done):
        if L < T:
            continue
        g = torch.arange(L // T)
        N = layout.groups_per_block
        dk, _ = layout.decode(layout.read_states(pages, tables[r][g // N] * N + g % N))
        kk, _ = fake_quant(layout, *seqs[r][:2], sinks, upto=L)
        s = min(sinks, L // T * T)
        torch.testing.assert_close(dk.reshape(-1, H, D)[s:], kk[s:L // T * T], atol=0, rtol=0)


@pytest.mark.parametrize("scheme,window,lead,sinks", [("vidkv", 0, 0, 0), ("kivi2", 1, 0, 0),
                                                      ("vidkv", 0, 1, 3), ("kivi2", 1, 1, 2)])
def test_int8_staging_reads_and_encodes_the_tokens_as_held(scheme, window, lead, sinks):
    """staging_dtype int8: the staged tokens (partial group, windows) are read as their int8
    round trip, the step's own tokens exactly, and a completing group is encoded from its
    staged tokens as held plus its fresh ones exact; the sink positions exactly from the
    sink area once group 0 is complete (packed or in the leading window); the transformers
    yardstick stores the same bytes and reads the same windows and tail."""
    from vllm_lowbit_kv.codecs.quant import absmax_int8_roundtrip
    torch.manual_seed(5)
    T = 16
    slots = window + lead + 1
    layout, pages, staging, alloc = make(scheme, T=T, slots=slots, window=window, lead=lead,
                                         sinks=sinks, staging_dtype="int8")
    assert staging.k.data.dtype == torch.int8 and staging.k.scale.shape == (slots, T, H, 1)
    L = 40
    k, v, q = rnd(L, H, D), rnd(L, H, D), rnd(L, HQ, D)
    rk, rv = absmax_int8_roundtrip(k), absmax_int8_roundtrip(v)
    assert not torch.equal(rk, k)  # the round trip moves bf16 values: the test can tell
    # tokens 0-10 staged, 11-16 written by the step completing group 0, 17-33 by the
    # one completing group 1 (tokens 16 and 33 staged again), then one token at a time
    schedule = [[11], [6], [17], [1], [1]]
    bounds = [0, 11, 17, 34, 35, 36]
    held_k, held_v = k.clone(), v.clone()  # each group as encoded: staged part rounded
    for a, b in ((0, 11), (16, 17)):
        held_k[a:b], held_v[a:b] = rk[a:b], rv[a:b]
    enc_k, enc_v = held_k[:2 * T].clone(), held_v[:2 * T].clone()
    mask_sink_rows(enc_k[:T], sinks)  # group 0 as the pages code it
    mask_sink_rows(enc_v[:T], sinks)
    dk, dv = layout.decode(layout.encode(enc_k.reshape(2, T, H, D), enc_v.reshape(2, T, H, D)))
    dk, dv = dk.reshape(-1, H, D), dv.reshape(-1, H, D)

    def check(rows, qs, seq_lens, out):
        end = seq_lens[0]
        start = bounds[bounds.index(end) - 1]
        groups = start // T  # complete before this step
        staged_from = max(groups - window, 0) * T
        lead_to = min(lead * T, staged_from)
        kk = torch.cat([rk[:lead_to], dk[lead_to:staged_from], rk[staged_from:start], k[start:end]])
        vv = torch.cat([rv[:lead_to], dv[lead_to:staged_from], rv[staged_from:start], v[start:end]])
        if staged_from:  # group 0 packed or in the leading window: the sinks exact
            kk[:sinks], vv[:sinks] = k[:sinks], v[:sinks]
        ref = attend(q[start:end], kk, vv, start, D ** -0.5)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)

    table = torch.arange(pages.shape[0])
    done, _ = run_schedule(layout, pages, staging, alloc, [(k, v, q)], [table], schedule,
                           on_step=check)
    assert done == [36]
    kc, vc = get_scheme(scheme).codecs(D, T)
    hf = LowBitLayer(0, kc, vc, T, sinks, residual_tokens=window * T, staging_dtype="int8",
                     leading_tokens=lead * T)
    for a, b in zip(bounds, bounds[1:]):
        hf.update(k[a:b].permute(1, 0, 2).unsqueeze(0), v[a:b].permute(1, 0, 2).unsqueeze(0))
    states = layout.read_states(pages, torch.arange(2))
    assert torch.equal(states[..., :layout.format.k_bytes], hf.packed_k[0])
    hk, _ = hf.decoded()
    staged_from = max(2 - window, 0) * T
    lead_to = min(lead * T, staged_from)
    for part in (slice(sinks, lead_to), slice(staged_from, 36)):
        torch.testing.assert_close(hk[0].permute(1, 0, 2)[part], rk[part], atol=0, rtol=0)
    assert torch.equal(hk[0].permute(1, 0, 2)[:sinks], k[:sinks])
    torch.testing.assert_close(hk[0].permute(1, 0, 2)[lead_to:staged_from],
                               dk[lead_to:staged_from].to(hk.dtype), atol=0, rtol=0)


def test_sinks_survive_prefix_caching():
    """A second request sharing the first block (a prefix-cache hit) reads the sinks
    from that block's page, exactly as the request that wrote them."""
    torch.manual_seed(1)
    layout, pages, staging, alloc = make("vidkv", sinks=4)
    bs = layout.block_size
    k, v, q = rnd(2 * bs + 5, H, D), rnd(2 * bs + 5, H, D), rnd(2 * bs + 5, HQ, D)
    # request A: two full blocks 3, 9 (written, encoded) then ends
    run_schedule(layout, pages, staging, alloc, [(k[:2 * bs], v[:2 * bs], q[:2 * bs])],
                 [torch.tensor([3, 9])], [[2 * bs]])
    assert alloc.in_use == 0
    # request B: hit on both blocks (ctx = 2 * bs), 5 fresh tokens in its own block 11
    fresh = slice(2 * bs, 2 * bs + 5)
    wp, rp = alloc.plan_step(11 * bs + torch.arange(5), [2 * bs + 5], [0, 5],
                             torch.tensor([[3, 9, 11]]), layout.groups_per_block)
    out = torch.zeros(5, HQ, D)
    forward_layer(wp, rp, layout, q[fresh], k[fresh], v[fresh], pages, staging, D ** -0.5, out)
    kk, vv = fake_quant(layout, k, v, sinks=4)
    kk[fresh], vv[fresh] = k[fresh], v[fresh]
    ref = attend(q[fresh], kk, vv, 2 * bs, D ** -0.5)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    assert wp.sink_tok.numel() == 0  # B wrote no sinks: they came from the cached page


def test_prefill_groups_read_as_one_slice_match_the_gather():
    """A prefill chunk's completed groups are fresh rows back to back (WritePlan.enc_run):
    encode_groups reads them as one slice, with the bytes of the general gather (staged
    tokens, then the fresh ones by index), and its sink masking leaves the step's keys
    alone; so does a chunk whose first group continues from staging (a chunk starting
    mid-group: the staged rows, then one slice)."""
    torch.manual_seed(4)
    layout, pages, staging, alloc = make("vidkv", sinks=4)
    bs, T = layout.block_size, layout.T
    n = 2 * bs + 5
    k, v = rnd(n, H, D).bfloat16(), rnd(n, H, D).bfloat16()
    k_before = k.clone()
    wp, _ = alloc.plan_step(3 * bs + torch.arange(n), [n], [0, n], torch.tensor([[3, 4, 5]]),
                            layout.groups_per_block)
    assert wp.enc_run == 0 and wp.enc_gids.numel() == 2 * bs // T
    gathered = pages.clone()
    encode_groups(wp, layout, k, v, pages, staging)
    assert torch.equal(k, k_before)
    encode_groups(dataclasses.replace(wp, enc_run=-1), layout, k, v, gathered, staging)
    assert torch.equal(pages, gathered) and bool(pages.any())
    stage_tokens(wp, k, v, staging)
    # the next chunk completes the staged group (5 staged rows) and the one after it
    k2, v2 = rnd(2 * T, H, D).bfloat16(), rnd(2 * T, H, D).bfloat16()
    wp2, _ = alloc.plan_step(5 * bs + 5 + torch.arange(2 * T), [n + 2 * T], [0, 2 * T],
                             torch.tensor([[3, 4, 5]]), layout.groups_per_block)
    assert wp2.enc_run == 0 and wp2.enc_gids.numel() == 2
    assert int(wp2.enc_src_slot[0]) >= 0 and wp2.enc_tok.numel() == 2 * T - 5
    before, gathered = pages.clone(), pages.clone()
    encode_groups(wp2, layout, k2, v2, pages, staging)
    encode_groups(dataclasses.replace(wp2, enc_run=-1), layout, k2, v2, gathered, staging)
    assert torch.equal(pages, gathered) and not torch.equal(pages, before)


@pytest.mark.parametrize("scheme,sinks,obs_window", [("vidkv", 4, None), ("vidkv_stp", 0, 8)])
def test_same_step_prefix_hit_reads_what_its_writer_encodes(scheme, sinks, obs_window):
    """vLLM caches a block when it is scheduled, so request B can hit blocks that request
    A fills in the same step: B must read them encoded (and its STP relevance must see
    them), exactly as if B had run one step later."""
    torch.manual_seed(2)
    T = 16

    def run(together: bool):
        layout, pages, staging, alloc = make(scheme, T=T, sinks=sinks,
                                             q_heads=HQ if obs_window else None)
        bs = layout.block_size
        gen = torch.Generator().manual_seed(3)
        k, v, q = (torch.randn(2 * bs + T, h, D, generator=gen).bfloat16().float()
                   for h in (H, H, HQ))
        a, b = slice(0, 2 * bs), slice(2 * bs, 2 * bs + T)  # A's prompt; B's fresh group
        steps = [dict(slots=torch.cat([3 * bs + torch.arange(bs), 9 * bs + torch.arange(bs)]),
                      seq_lens=[2 * bs], rows=a, table=[[3, 9, 0]]),
                 dict(slots=11 * bs + torch.arange(T), seq_lens=[2 * bs + T], rows=b,
                      table=[[3, 9, 11]])]
        if together:
            steps = [dict(slots=torch.cat([s["slots"] for s in steps]),
                          seq_lens=steps[0]["seq_lens"] + steps[1]["seq_lens"],
                          rows=slice(0, 2 * bs + T), table=[[3, 9, 0], [3, 9, 11]])]
        outs = []
        for st in steps:
            n = st["rows"].stop - st["rows"].start
            q_start = [0] + [2 * bs] * (len(st["seq_lens"]) == 2) + [n]
            wp, rp = alloc.plan_step(st["slots"], st["seq_lens"], q_start,
                                     torch.tensor(st["table"]), layout.groups_per_block)
            out = torch.full((n, HQ, D), float("nan"))
            forward_layer(wp, rp, layout, q[st["rows"]], k[st["rows"]], v[st["rows"]], pages,
                          staging, D ** -0.5, out, obs_window)
            outs.append(out)
        return torch.cat(outs), pages

    out_together, pages_together = run(together=True)
    out_apart, pages_apart = run(together=False)
    assert torch.equal(pages_together, pages_apart)
    torch.testing.assert_close(out_together, out_apart, atol=1e-5, rtol=0)


def test_attention_mass_matches_hf_definition():
    torch.manual_seed(2)
    layer = LowBitLayer(0, *get_scheme("vidkv_stp").codecs(D, 16), 16, relevance="attention",
                        obs_window=8)
    keys = rnd(1, H, 40, D)
    q = rnd(1, HQ, 8, D)
    layer.record_queries(q, 30, 0.125)
    want = layer._attention_mass(keys, 0, 40)[0]  # [H, 40]
    got = attention_mass(q[0].transpose(0, 1), 30, keys[0].transpose(0, 1), 0.125)
    torch.testing.assert_close(got.T, want, atol=1e-6, rtol=1e-6)


#: visual token positions of the three requests of the STP tests: an image across
#: groups, a request whose groups hold fewer visual tokens than they protect, text only
VISUAL = [torch.arange(5, 61), torch.tensor([17, 18, 40]), None]


@pytest.mark.parametrize("scheme,obs_window,visual,lead", [
    ("vidkv_stp", 8, None, 0), ("vidkv_stp", 16, None, 0), ("vidkv_stp", 8, VISUAL, 0),
    ("vidkv_visual", 8, VISUAL, 0), ("vidkv_visual", 8, None, 0), ("vidkv_stp", 8, None, 1)])
def test_stp_pages_equal_hf_yardstick(scheme, obs_window, visual, lead):
    """STP through paged (three requests batched, chunked prefill, decode) gives the very
    bytes the transformers yardstick stores for each sequence alone, with and without
    visual tokens marked (and with a leading window, which the relevance reads); marked,
    a group protects visual tokens first (vidkv_stp), or its text tokens first in the
    visual-only mode (vidkv_visual: K and V alike)."""
    torch.manual_seed(3)
    T, slots = 16, 4 + 3 * lead
    layout, pages, staging, alloc = make(scheme, T=T, slots=slots, q_heads=HQ, lead=lead)
    lens = [90, 41, 20]
    perm = torch.randperm(pages.shape[0])
    tables = [perm[i * 8:(i + 1) * 8] for i in range(3)]
    seqs = [(rnd(L, H, D), rnd(L, H, D), rnd(L, HQ, D)) for L in lens]
    schedule = [[20, 30, 3], [40, 5, 0], [3, 1, 17], [30, 1, 0]] + [[1, 1, 0]] * 18
    done, _ = run_schedule(layout, pages, staging, alloc, seqs, tables, schedule,
                           obs_window=obs_window, visual=visual)
    assert done == lens
    scale = D ** -0.5
    kc, vc = get_scheme(scheme).codecs(D, T)
    first = get_scheme(scheme).protect_first
    filled = []  # per visual request: first kind protected somewhere, other kind too
    for r, (k, v, q) in enumerate(seqs):
        marks = VisualTokens(first)
        if visual is not None and visual[r] is not None:
            is_visual = torch.zeros(1, lens[r], dtype=torch.bool)
            is_visual[0, visual[r]] = True
            marks.mark(0, is_visual)
        hf = LowBitLayer(0, kc, vc, T, relevance="attention", obs_window=obs_window,
                         visual=marks, leading_tokens=lead * T)
        pos = 0
        for step in schedule:
            n = min(step[r], lens[r] - pos)
            if n == 0:
                continue
            w = min(obs_window, n)
            # the yardstick's query hook: the forward's last w queries, [B, Hq, w, D]
            hf.record_queries(q[pos + n - w:pos + n].permute(1, 0, 2).unsqueeze(0), pos + n - w,
                              scale)
            hf.update(k[pos:pos + n].permute(1, 0, 2).unsqueeze(0),
                      v[pos:pos + n].permute(1, 0, 2).unsqueeze(0))
            pos += n
        n_groups = lens[r] // T
        g = torch.arange(n_groups)
        gids = tables[r][g // layout.groups_per_block] * layout.groups_per_block + g % layout.groups_per_block
        states = layout.read_states(pages, gids)
        ours_k = states[..., :layout.format.k_bytes]
        ours_v = states[..., layout.format.k_bytes:layout.format.k_bytes + layout.format.v_bytes]
        assert torch.equal(ours_k, hf.packed_k[0]), r
        assert torch.equal(ours_v, hf.packed_v[0]), r
        if visual is None or visual[r] is None:
            continue
        # per group and head, the kind ranked first fills the protected rows, the other
        # kind takes what is left: min(n_protect, first) and min(other, n_protect - first)
        is_vis = torch.zeros(n_groups * T, dtype=torch.bool)
        is_vis[visual[r][visual[r] < n_groups * T]] = True
        is_vis = is_vis.reshape(n_groups, 1, T)
        is_first = is_vis if first == "visual" else ~is_vis
        n_first = is_first.sum(-1).expand(-1, H)
        want_first = n_first.clamp(max=vc.n_protect)
        want_other = (T - n_first).clamp(max=vc.n_protect - want_first)
        for codec, packed in ((kc, ours_k), (vc, ours_v)):
            if not codec.n_protect:
                continue
            prot = codec.protected_tokens(packed)  # [groups, H, T]
            assert torch.equal((prot & is_first).sum(-1), want_first), r
            assert torch.equal((prot & ~is_first).sum(-1), want_other), r
        filled += [bool((want_first > 0).any()), bool((want_other > 0).any())]
    # the visual requests fill protected rows with both kinds somewhere
    assert visual is None or (any(filled[::2]) and any(filled[1::2]))


@pytest.mark.parametrize("scheme,sinks,W,A", [("kivi2", 0, 2, 0), ("vidkv", 3, 0, 1),
                                              ("kivi2", 0, 1, 2)])
def test_prefix_hit_inside_another_window_reads_the_pages(scheme, sinks, W, A):
    """B hits A's cached blocks while they are still inside A's residual (W groups) or
    leading (A groups) window: B reads their packed bytes and the sink area (only A reads
    its window copies), A keeps reading its copies."""
    torch.manual_seed(4)
    layout, pages, staging, alloc = make(scheme, sinks=sinks, window=W, lead=A,
                                         slots=2 * (W + A + 1), staging_dtype="model")
    bs, T = layout.block_size, layout.T
    L = 2 * bs
    k, v, q = rnd(L + 3, H, D), rnd(L + 3, H, D), rnd(L + 3, HQ, D)
    scale = D ** -0.5
    # A: prompt of two full blocks 3, 9 in one step; its last W groups stay staged
    wp, rp = alloc.plan_step(torch.cat([3 * bs + torch.arange(bs), 9 * bs + torch.arange(bs)]),
                             [L], [0, L], torch.tensor([[3, 9]]), layout.groups_per_block,
                             owners=["A"])
    forward_layer(wp, rp, layout, q[:L], k[:L], v[:L], pages, staging, scale,
                  torch.zeros(L, HQ, D))
    assert alloc.in_use == W + A
    # one step, both: A decodes its next token (block 12), B hits blocks 3, 9 and
    # prefills 3 tokens of its own (block 11)
    fresh = slice(L, L + 3)
    slots = torch.cat([torch.tensor([12 * bs]), 11 * bs + torch.arange(3)])
    wp, rp = alloc.plan_step(slots, [L + 1, L + 3], [0, 1, 4],
                             torch.tensor([[3, 9, 12], [3, 9, 11]]), layout.groups_per_block,
                             owners=["A", "B"])
    assert [len(x) for x in rp.window_slots] == [W, 0]
    assert [len(x) for x in rp.lead_slots] == [A, 0]
    out = torch.zeros(4, HQ, D)
    forward_layer(wp, rp, layout, torch.cat([q[L:L + 1], q[fresh]]),
                  torch.cat([k[L:L + 1], k[fresh]]), torch.cat([v[L:L + 1], v[fresh]]),
                  pages, staging, scale, out)
    kk, vv = fake_quant(layout, k[:L], v[:L], sinks)  # every group through the codec
    for rows, window, lead in ((slice(0, 1), W, A), (slice(1, 4), 0, 0)):
        ka, va = fake_quant(layout, k[:L], v[:L], sinks, window=window, lead=lead)
        n = rows.stop - rows.start
        ka = torch.cat([ka, (k[L:L + 1] if n == 1 else k[fresh])])
        va = torch.cat([va, (v[L:L + 1] if n == 1 else v[fresh])])
        ref = attend(q[L:L + 1] if n == 1 else q[fresh], ka, va, L, scale)
        torch.testing.assert_close(out[rows], ref, atol=1e-4, rtol=0)
    # B's read differs from A's window copies: the packed bytes, not bf16
    assert not torch.allclose(kk[L - W * T:], k[L - W * T:L], atol=1e-3) or not W
    assert not torch.allclose(kk[sinks:A * T], k[sinks:A * T], atol=1e-3) or not A


@pytest.mark.parametrize("W,A", [(2, 0), (0, 1), (1, 2)])
def test_window_slides_and_ended_requests_return_every_slot(W, A):
    """Decode moves groups out of the residual window (their slots return in the same
    step), the leading window's groups stay; an ended (finished, aborted or preempted)
    request returns both windows and its partial group."""
    layout, pages, staging, alloc = make("kivi2", window=W, lead=A, slots=W + A + 1)
    bs, T = layout.block_size, layout.T
    table = torch.tensor([[5, 6, 7, 8]])
    L = 0
    for n in [40, 1, 1, 30, 33, 1, 1]:  # never more than W + A + 1 slots
        pos = torch.arange(L, L + n)
        L += n
        wp, rp = alloc.plan_step(table[0][pos // bs] * bs + pos % bs, [L], [0, n], table,
                                 layout.groups_per_block, owners=["A"])
        assert alloc.in_use == min(W + A, L // T) + (L % T > 0)
    assert [alloc.index_of[s] for s in rp.lead_slots[0]] == list(range(A))
    assert alloc.release_blocks(table[0].tolist(), layout.groups_per_block) == W + A + 1
    assert alloc.in_use == 0 and alloc.owned == {}


@pytest.mark.parametrize("W,A", [(2, 0), (1, 1)])
def test_release_window_keeps_the_partial_group(W, A):
    layout, pages, staging, alloc = make("kivi2", window=W, lead=A, slots=3)
    bs = layout.block_size
    alloc.plan_step(5 * bs + torch.arange(40), [40], [0, 40], torch.tensor([[5, 6]]),
                    layout.groups_per_block, owners=["A"])
    assert alloc.in_use == 3 and alloc.release_window("A") == 2 and alloc.in_use == 1
    _, rp = alloc.plan_step(torch.tensor([5 * bs + 40]), [41], [0, 1], torch.tensor([[5, 6]]),
                            layout.groups_per_block, owners=["A"])
    assert rp.window_slots == [[]] and rp.lead_slots == [[]] and int(rp.num_groups[0]) == 2


def test_release_before_take_one_slot_per_request():
    """A request completing its partial group and starting the next in one step needs
    no second slot."""
    layout, pages, staging, alloc = make(slots=1)
    T = layout.T
    alloc.plan_writes(torch.arange(5) + 2 * layout.block_size)
    assert alloc.in_use == 1
    wp = alloc.plan_writes(torch.arange(5, T + 3) + 2 * layout.block_size)
    assert wp.enc_gids.numel() == 1 and alloc.in_use == 1


def test_bookkeeping_errors_are_hard():
    layout, pages, staging, alloc = make(slots=2)
    bs = layout.block_size
    # a group continuing at offset 3 with no staged tokens: refuse (never zeros)
    with pytest.raises(RuntimeError, match="no staging slot"):
        alloc.plan_writes(torch.arange(3, 6) + 5 * bs)
    with pytest.raises(RuntimeError, match="no staging slot"):
        alloc.plan_reads([8], [0, 1], torch.tensor([[5]]), layout.groups_per_block)
    # more partial groups than slots: refuse (never overwrite staged tokens)
    alloc.plan_writes(torch.tensor([7 * bs]))
    alloc.plan_writes(torch.tensor([9 * bs]))
    with pytest.raises(RuntimeError, match="staging pool exhausted"):
        alloc.plan_writes(torch.tensor([11 * bs]))


def test_restarted_group_reuses_stale_slot():
    layout, pages, staging, alloc = make(slots=2)
    T = layout.T
    # request A writes 3 tokens into group 0 of block 5 and ends unreported
    alloc.plan_writes(torch.arange(3) + 5 * layout.block_size)
    assert alloc.in_use == 1
    # block 5 is reused from offset 0 by another request: same slot, no leak
    alloc.plan_writes(torch.arange(2) + 5 * layout.block_size)
    assert alloc.in_use == 1 and alloc.stale_reused == 1
    # a group filled in one step needs no slot and frees nothing
    wp = alloc.plan_writes(torch.arange(T) + 11 * layout.block_size)
    assert wp.enc_gids.tolist() == [11 * layout.groups_per_block]
    assert alloc.in_use == 1


def test_release_blocks_of_ended_request():
    layout, pages, staging, alloc = make(slots=4)
    bs, N = layout.block_size, layout.groups_per_block
    # request A: 1.5 groups into block 3 (one group encoded, one staged); B: staged in block 6
    alloc.plan_writes(torch.arange(layout.T + 5) + 3 * bs)
    alloc.plan_writes(torch.arange(4) + 6 * bs)
    assert alloc.in_use == 2
    assert alloc.release_blocks([3, 12], N) == 1  # A ended
    assert alloc.in_use == 1 and alloc.free
    # B continues undisturbed
    wp = alloc.plan_writes(torch.tensor([6 * bs + 4]))
    assert wp.stage_slot.tolist() == [alloc.slot_of[6 * N]]


@pytest.mark.parametrize("window", [0, 2])
def test_release_of_a_stale_block_list_keeps_the_new_owners_slot(window):
    """vLLM frees a preempted request's blocks at once and may hand them to another
    request, which stages tokens in them; when the first request ends later (aborted while
    waiting), the runner still lists its old blocks. Their slots are the new owner's now."""
    layout, pages, staging, alloc = make("kivi2", window=window, slots=window + 2)
    bs, N = layout.block_size, layout.groups_per_block
    table = torch.tensor([[3]])

    def step(owner, start, n):
        pos = torch.arange(start, start + n)
        return alloc.plan_step(table[0][pos // bs] * bs + pos % bs, [start + n], [0, n], table,
                               N, owners=[owner])

    step("A", 0, 5)  # A stages 5 tokens in block 3, then is preempted: its slot returns
    assert alloc.release_blocks([3], N, ["A"]) == 1 and alloc.in_use == 0
    step("B", 0, 1)  # block 3 is B's now: one token staged
    assert alloc.release_blocks([3], N, ["A"]) == 0  # A aborted while waiting
    assert alloc.in_use == 1
    _, read = step("B", 1, 1)  # B reads its first token from its slot
    assert [int(s) for s in read.tail_slot] == [alloc.slot_of[3 * N]]
    assert alloc.release_blocks([3], N, ["B"]) == 1 and alloc.in_use == 0


def test_apply_writes_without_positions_still_encodes():
    """Engines without positions (no sinks, no STP) keep working."""
    layout, pages, staging, alloc = make()
    k, v = rnd(40, H, D), rnd(40, H, D)
    wp = alloc.plan_writes(torch.arange(40))
    apply_writes(wp, layout, k, v, pages, staging)
    dk, _ = layout.decode(layout.read_states(pages, torch.tensor([0, 1])))
    ek, _ = layout.decode(layout.encode(k[:32].reshape(2, 16, H, D), v[:32].reshape(2, 16, H, D)))
    assert torch.equal(dk, ek)


@pytest.mark.parametrize("scheme,params", [
    ("kivi2", {}), ("vidkv", dict(sinks=3, window=1, rotate="hadamard")),
    ("vidkv_stp", dict(q_heads=HQ)), ("quantile1", {}), ("dynamic2", {})])
def test_forward_allocates_on_the_tensors_device(scheme, params):
    """The GPU serving path runs this same code on CUDA tensors: every tensor it makes
    must go to its inputs' device (data) or stay with the plans (CPU indices), never to
    the default device. Run with the default device set to ``meta``, any such tensor
    would be a meta tensor meeting CPU data and raise; the outputs equal a plain run."""
    def run(forward):
        torch.manual_seed(0)
        layout, pages, staging, alloc = make(scheme, slots=6, **params)
        seqs = [(rnd(L, H, D), rnd(L, H, D), rnd(L, HQ, D)) for L in (78, 41)]
        tables = [torch.arange(8), torch.arange(8, 16)]
        obs = 8 if layout.key_codec.uses_relevance or layout.value_codec.uses_relevance else None
        _, outs = run_schedule(layout, pages, staging, alloc, seqs, tables,
                               [[20, 33], [40, 0], [10, 1], [1, 1]], obs, forward=forward)
        return [o for *_, o in outs], pages

    def on_meta_default(*args):
        with torch.device("meta"):
            forward_layer(*args)

    plain, plain_pages = run(forward_layer)
    meta, meta_pages = run(on_meta_default)
    assert all(torch.equal(a, b) for a, b in zip(plain, meta)) and torch.equal(plain_pages, meta_pages)


@pytest.mark.parametrize("scheme,params,sinks,window", [
    ("vidkv", {"protect": 0.25}, 4, 2), ("vidkv", {}, 4, 2), ("kivi2", {}, 0, 1)])
@pytest.mark.parametrize("a_len,sched_a,a_blocks", [
    (70, [[50]] + [[1]] * 20, range(0, 8)),  # A completes groups, in blocks B never gets
    # A never completes a group (a short chat) and B gets A's blocks, as vLLM hands them
    # back: A's sinks are in B's first block when B's first step completes groups
    (12, [[8]] + [[1]] * 4, range(8, 16))])
def test_a_request_reads_nothing_of_earlier_ones(scheme, params, sinks, window, a_len, sched_a,
                                                 a_blocks):
    """The same request gives the same outputs on fresh buffers and after another request
    used (and returned) the staging slots and blocks: nothing stale is ever read; and its
    sink area holds its own sinks, with STP too (a first step that completes groups
    encodes them in waves, which must not skip the sinks)."""
    torch.manual_seed(5)
    q_heads = HQ if params.get("protect") else None
    obs_window = 8 if q_heads else None
    a = (rnd(a_len, H, D), rnd(a_len, H, D), rnd(a_len, HQ, D))
    b = (rnd(100, H, D), rnd(100, H, D), rnd(100, HQ, D))
    table_a, table_b = torch.tensor(list(a_blocks)), torch.arange(8, 16)
    sched_b = [[40], [40], [10]] + [[1]] * 10

    def outputs(engine, seq, table, schedule):
        _, outs = run_schedule(*engine, [seq], [table], schedule, obs_window=obs_window)
        return torch.cat([o for *_, o in outs])

    fresh = make(scheme, sinks=sinks, window=window, slots=6, q_heads=q_heads, **params)
    used = make(scheme, sinks=sinks, window=window, slots=6, q_heads=q_heads, **params)
    outputs(used, a, table_a, sched_a)
    used[3].release_blocks(table_a.tolist(), used[0].groups_per_block)  # A ended
    assert torch.equal(outputs(used, b, table_b, sched_b), outputs(fresh, b, table_b, sched_b))
    if sinks:
        layout, pages = fresh[0], fresh[1]
        sk, sv = layout.read_sinks(pages, int(table_b[0]), sinks)
        assert torch.equal(sk, b[0][:sinks].float()) and torch.equal(sv, b[1][:sinks].float())


@pytest.mark.parametrize("first", ["visual", "text"])
def test_protected_visual_counts_the_rows_stp_gives_visual_tokens(first):
    """The stats' count (paged.protected_visual) equals what the codec's token mask says
    after paged.rank_protected, for groups all visual, all text and mixed, with sink rows
    (ranked last) in some."""
    from vllm_lowbit_kv.paged import SINK_RELEVANCE, protected_visual, rank_protected

    torch.manual_seed(7)
    T, E = 16, 24
    vc = get_scheme("vidkv_stp").with_params(protect=0.25).codecs(D, T)[1]
    visual = torch.rand(E, T) < torch.linspace(0, 1, E).unsqueeze(1)  # from all text to all visual
    sinks = torch.randint(0, 5, (E,)) * (torch.arange(E) % 3 == 0)
    candidates = torch.arange(T).unsqueeze(0) >= sinks.unsqueeze(1)
    relevance = rank_protected(torch.rand(E, T, H), visual, first)
    relevance[~candidates] = SINK_RELEVANCE
    prot = vc.protected_tokens(vc.encode(torch.randn(E, T, H, D), relevance))  # [E, H, T]
    got = (prot & visual.unsqueeze(1)).sum(-1)
    want = protected_visual(visual, vc.n_protect, first, candidates)
    assert torch.equal(got, want.unsqueeze(1).expand(-1, H))
    assert 0 < int(want.sum()) < int(visual.sum())


@pytest.mark.parametrize("heads", [[(0, 2), (1,)], [(0, 1), (2,)]], ids=["gap", "ranges"])
@pytest.mark.parametrize("keys_only,sinks,window", [(False, 3, 1), (True, 0, 0), (False, 0, 2)])
def test_head_split_layer_matches_per_head_reference(keys_only, sinks, window, heads):
    """Retrieval heads: a layer whose KV heads 0 and 2 (or 0 and 1: both parts one range of
    heads, read and written as views) are coded by vidkv and the other by kivi4 (keys only:
    kivi4 keys, vidkv values) reads, per query head, what a whole layer of its part's
    codecs reads; the split page holds both parts' bytes."""
    from vllm_lowbit_kv.paged import HeadSplitLayout, forward_split_layer
    torch.manual_seed(1)
    T, bs = 16, 32
    s = get_scheme("vidkv").with_params(retrieval_heads=1, retrieval_keys_only=keys_only,
                                        sink_tokens=sinks)
    pairs = [s.codecs(D, T), s.retrieval_codecs(D, T)]
    assert [type(c).__name__ for c in pairs[1]] == \
        ["KiviCodec", "TernaryValueCodec" if keys_only else "KiviCodec"]
    split = HeadSplitLayout([PagedLayout(kc, vc, len(h), bs, sinks) for (kc, vc), h
                             in zip(pairs, heads)], heads)
    whole = [PagedLayout(kc, vc, H, bs, sinks) for kc, vc in pairs]
    assert split.page_bytes == sum(p.page_bytes for p in split.parts)
    assert split.page_bytes == (2 * whole[0].page_bytes + whole[1].page_bytes) // 3
    pages = torch.full(split.page_shape(40), 0xA5, dtype=torch.uint8)
    staging = Staging.allocate(3 * (window + 1), T, H, D, torch.bfloat16)
    alloc = StagingAllocator(3 * (window + 1), T, sinks, window)
    lens = [70, 33]
    tables = [torch.arange(0, 8), torch.arange(20, 28)]
    seqs = [(rnd(L + 4, H, D), rnd(L + 4, H, D), rnd(L + 4, HQ, D)) for L in lens]
    g = HQ // H

    def check(rows, qs, seq_lens, out):
        for i, r in enumerate(rows):
            L, n = seq_lens[i], qs[i + 1] - qs[i]
            k, v, q = (x[:L] for x in seqs[r])
            for lay, hs in zip(whole, heads):
                kk, vv = fake_quant(lay, k, v, sinks, upto=L - n, window=window)
                ref = attend(q[L - n:], kk, vv, L - n, D ** -0.5)
                qh = [h * g + j for h in hs for j in range(g)]
                torch.testing.assert_close(out[qs[i]:qs[i + 1], qh], ref[:, qh], atol=1e-4, rtol=0)

    def split_forward(wp, rp, layout, query, key, value, pages, staging, scale, out, *_):
        forward_split_layer(wp, rp, split, query, key, value, pages, staging, scale, out)

    run_schedule(split, pages, staging, alloc, seqs, tables, [[30, 33], [40, 0], [1, 1], [1, 1]],
                 on_step=check, forward=split_forward)
