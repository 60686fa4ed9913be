"""Packed paged layout + staging + attention, checked against a dense reference.

The reference: the same codec applied to every complete T-token group of a
sequence (fake quantization), the partial last group exact in bf16, and plain
causal attention with the fresh tokens in full precision.
"""

import pytest
import torch

from vllm_lowbit_kv.paged import (PagedLayout, StagingAllocator, apply_writes, attend,
                                  paged_attention)
from vllm_lowbit_kv.schemes import get_scheme

H, HQ, D = 3, 9, 64


def make(scheme="kivi2", T=16, block_size=32, num_blocks=64, slots=8):
    kc, vc = get_scheme(scheme).codecs(D, T)
    layout = PagedLayout(kc, vc, H, block_size)
    pages = torch.zeros(layout.page_shape(num_blocks), dtype=torch.uint8)
    sk = torch.zeros(slots, T, H, D, dtype=torch.bfloat16)
    return layout, pages, sk, sk.clone(), StagingAllocator(slots, T)


def reference(layout, k_seq, v_seq, q, ctx, scale):
    """Fake-quantize complete groups of the whole sequence (ctx + fresh) and attend."""
    T = layout.T
    L = k_seq.shape[0]
    kk, vv = k_seq.float().clone(), v_seq.float().clone()
    kk = kk.to(torch.bfloat16).float()
    vv = vv.to(torch.bfloat16).float()
    n = L // T
    if n:
        st = layout.encode(k_seq[: n * T].float().reshape(n, T, H, D),
                           v_seq[: n * T].float().reshape(n, T, H, D))
        dk, dv = layout.decode(st)
        kk[: n * T], vv[: n * T] = dk.reshape(-1, H, D), dv.reshape(-1, H, D)
    # fresh tokens attend in full precision
    kk[ctx:], vv[ctx:] = k_seq[ctx:].float(), v_seq[ctx:].float()
    return attend(q, kk, vv, ctx, scale)


def test_page_bytes_proportional():
    layout, *_ = make("kivi2", T=64, block_size=128)
    kc, vc = layout.key_codec, layout.value_codec
    assert layout.page_bytes == 2 * H * (kc.nbytes + vc.nbytes)
    bf16 = 2 * H * D * 2 * 128
    eff = (kc.effective_bits + vc.effective_bits) / 2
    assert bf16 / layout.page_bytes == pytest.approx(16 / eff)


def test_roundtrip_through_pages():
    layout, pages, *_ = make()
    k = torch.randn(5, layout.T, H, D)
    v = torch.randn(5, layout.T, H, D)
    gids = torch.tensor([7, 0, 33, 4, 100])
    layout.write_states(pages, gids, layout.encode(k, v))
    dk, dv = layout.decode(layout.read_states(pages, gids))
    ek, ev = layout.decode(layout.encode(k, v))
    assert torch.equal(dk, ek) and torch.equal(dv, ev)


@pytest.mark.parametrize("scheme", ["kivi2", "kivi4"])
def test_chunked_prefill_and_decode_match_reference(scheme):
    torch.manual_seed(0)
    layout, pages, sk, sv, alloc = make(scheme)
    T, bs = layout.T, layout.block_size
    scale = D ** -0.5
    # three requests with their own scattered blocks and lengths
    lens = [70, 33, 5]
    perm = torch.randperm(pages.shape[0])
    tables = [perm[i * 8:(i + 1) * 8] for i in range(3)]
    # bf16-valued inputs, as vLLM's model produces
    rnd = lambda *s: torch.randn(*s).to(torch.bfloat16).float()
    seqs = [(rnd(L + 8, H, D), rnd(L + 8, H, D), rnd(L + 8, HQ, D)) for L in lens]
    done = [0, 0, 0]
    # steps: chunked prefill with uneven chunks, then decode steps
    schedule = [[20, 33, 5], [40, 0, 0], [10, 0, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]]
    for step in schedule:
        qs, keys, vals, qrys, slots, seq_lens = [0], [], [], [], [], []
        for r, n in enumerate(step):
            n = min(n, lens[r] + 8 - done[r])
            pos = torch.arange(done[r], done[r] + n)
            k, v, q = (x[pos] for x in seqs[r])
            keys.append(k); vals.append(v); qrys.append(q)
            slots.append(tables[r][pos // bs] * bs + pos % bs)
            done[r] += n
            seq_lens.append(done[r])
            qs.append(qs[-1] + n)
        key, value, query = torch.cat(keys), torch.cat(vals), torch.cat(qrys)
        bt = torch.stack(tables)
        wp = alloc.plan_writes(torch.cat(slots))
        rp = alloc.plan_reads(seq_lens, qs, bt, layout.groups_per_block)
        apply_writes(wp, layout, key, value, pages, sk, sv)
        out = torch.zeros(query.shape)
        paged_attention(rp, layout, query, key, value, pages, sk, sv, scale, out)
        for r in range(3):
            if qs[r + 1] == qs[r]:
                continue
            L = seq_lens[r]
            n = qs[r + 1] - qs[r]
            k, v, q = (x[:L] for x in seqs[r])
            ref = reference(layout, k, v, q[L - n:], L - n, scale)
            torch.testing.assert_close(out[qs[r]:qs[r + 1]], ref, atol=1e-4, rtol=0)
    # live partial groups hold slots; nothing else
    partial = sum(1 for L in done if L % T)
    assert alloc.in_use == partial


def test_restarted_group_reuses_stale_slot_and_pool_reclaims():
    layout, pages, sk, sv, alloc = make(slots=2)
    T = layout.T
    # request A writes 3 tokens into group 0 of block 5 and is aborted
    alloc.plan_writes(torch.arange(3) + 5 * layout.block_size)
    assert alloc.in_use == 1
    # block 5 is reused from offset 0 by another request: same slot, no leak
    alloc.plan_writes(torch.arange(2) + 5 * layout.block_size)
    assert alloc.in_use == 1
    # two more partial groups on a pool of 2: the idle one is reclaimed
    alloc.plan_writes(torch.tensor([7 * layout.block_size]))
    alloc.plan_writes(torch.tensor([9 * layout.block_size]))
    assert alloc.in_use == 2 and alloc.reclaimed == 1
    # a group filled in one step needs no slot and frees nothing
    wp = alloc.plan_writes(torch.arange(T) + 11 * layout.block_size)
    assert wp.enc_gids.tolist() == [11 * layout.groups_per_block]
    assert alloc.in_use == 2


def test_release_blocks_of_ended_request():
    layout, pages, sk, sv, alloc = make(slots=4)
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
