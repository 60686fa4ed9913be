"""Eviction policies (FlashCache and baselines): DCT, deviations, budgets, selection."""

import math

import pytest
import scipy.fft
import torch
from hypothesis import given
from hypothesis import strategies as st

from vllm_lowbit_kv.eviction import (POLICIES, allocate_budgets, cutoff, dct2, idct2, make_policy,
                                     outlier_analysis)


@pytest.mark.parametrize("N", [1, 2, 3, 8, 31, 64, 257])
@pytest.mark.parametrize("dim", [0, 1])
def test_dct_matches_scipy_orthonormal_dct2(N, dim):
    torch.manual_seed(N)
    x = torch.randn(N, 5, 3, dtype=torch.float64).movedim(0, dim)
    ref = scipy.fft.dct(x.numpy(), type=2, norm="ortho", axis=dim)
    c = dct2(x, dim=dim)
    assert torch.allclose(c, torch.from_numpy(ref), atol=1e-12)
    assert torch.allclose(idct2(c, dim=dim), x, atol=1e-12)
    assert torch.allclose(idct2(c, dim=dim), torch.from_numpy(
        scipy.fft.idct(ref, type=2, norm="ortho", axis=dim)), atol=1e-12)
    assert math.isclose(float(c.pow(2).sum()), float(x.pow(2).sum()), rel_tol=1e-12)  # Parseval


def _literal_reference(k, v, gamma):
    """Eqs. 6-12 written out with the cosine basis (float64)."""
    N = k.shape[0]
    i = torch.arange(N, dtype=torch.float64)
    a = torch.full((N,), math.sqrt(2 / N), dtype=torch.float64)
    a[0] = math.sqrt(1 / N)
    basis = a[:, None] * torch.cos(math.pi * i[:, None] * (2 * i[None, :] + 1) / (2 * N))  # [m, i]
    w = max(1, int(gamma * N))
    dev, ratio = 0, 0
    for x in (k.double(), v.double()):
        C = torch.einsum("mi,ihd->mhd", basis, x)  # Eq. 6
        Cf = C.clone()
        Cf[w:] = 0  # Eq. 8
        base = torch.einsum("mi,mhd->ihd", basis, Cf)  # Eq. 9
        dev = dev + (x - base).pow(2).mean(dim=(1, 2))  # Eq. 10
        P = C.pow(2)  # Eq. 11
        ratio = ratio + float(P[w:].sum() / P.sum())  # Eq. 12
    return dev, ratio


@pytest.mark.parametrize("N,gamma", [(40, 0.2), (17, 0.1), (64, 0.5), (5, 0.3)])
def test_outlier_analysis_matches_the_equations(N, gamma):
    torch.manual_seed(N)
    k, v = torch.randn(N, 3, 8), torch.randn(N, 3, 8)
    dev, ratio = outlier_analysis(k, v, gamma)
    ref_dev, ref_ratio = _literal_reference(k, v, gamma)
    assert cutoff(N, gamma) == max(1, int(gamma * N))
    assert torch.allclose(dev.double(), ref_dev, rtol=1e-4, atol=1e-6)
    assert math.isclose(ratio, ref_ratio, rel_tol=1e-4)


def test_outlier_is_the_spike_on_a_smooth_signal():
    N = 128
    t = torch.linspace(0, 1, N)
    k = torch.sin(2 * math.pi * t)[:, None, None].expand(N, 2, 4).clone()
    v = torch.cos(2 * math.pi * t)[:, None, None].expand(N, 2, 4).clone()
    k[70] += 3.0
    dev, ratio = outlier_analysis(k, v, 0.2)
    assert int(dev.argmax()) == 70
    _, smooth_ratio = outlier_analysis(torch.sin(2 * math.pi * t)[:, None, None].expand(N, 2, 4),
                                       v, 0.2)
    assert ratio > smooth_ratio


def test_budgets_follow_the_weights_exactly_when_no_bound_binds():
    b = allocate_budgets(torch.tensor([1.0, 2, 3, 4]), 100, torch.zeros(4), torch.full((4,), 100))
    assert b.tolist() == [10, 20, 30, 40]
    b = allocate_budgets(torch.tensor([1.0, 0, 0, 1]), 30, torch.full((4,), 5), torch.full((4,), 12))
    assert b.tolist() == [10, 5, 5, 10]
    b = allocate_budgets(torch.tensor([1.0, 0, 0, 1]), 40, torch.full((4,), 5), torch.full((4,), 12))
    assert b.tolist() == [12, 8, 8, 12]  # weighted layers full: the rest spreads over the others
    assert allocate_budgets(torch.zeros(3), 10, torch.zeros(3), torch.full((3,), 10)).tolist() == [4, 3, 3]


@given(st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=12), st.data())
def test_budgets_sum_to_the_global_budget_within_bounds(weights, data):
    L = len(weights)
    lo = data.draw(st.lists(st.integers(0, 20), min_size=L, max_size=L))
    hi = [a + data.draw(st.integers(0, 50)) for a in lo]
    total = data.draw(st.integers(sum(lo), sum(hi)))
    b = allocate_budgets(torch.tensor(weights, dtype=torch.float64), total, torch.tensor(lo),
                         torch.tensor(hi))
    assert int(b.sum()) == total
    assert all(lo[i] <= int(b[i]) <= hi[i] for i in range(L))
    if len(set(lo)) == 1 and len(set(hi)) == 1:  # same bounds: more weight never gets less
        for i in range(L):
            for j in range(L):
                if weights[i] > weights[j]:
                    assert int(b[i]) >= int(b[j])


def _kv(L=4, N=300, H=3, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ([torch.randn(N, H, D, generator=g) * (1 + i) for i in range(L)],
            [torch.randn(N, H, D, generator=g) for _ in range(L)])


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("retention", [0.1, 0.25, 0.5, 1.0])
def test_plans_keep_the_budget_and_the_protected_pairs(name, retention):
    keys, values = _kv()
    L, N = len(keys), keys[0].shape[0]
    plan = make_policy(name, retention, sink_tokens=4, recent_window=16).plan(keys, values)
    assert plan.total == round(retention * N * L) == int(plan.budgets.sum())
    for kept, b in zip(plan.kept, plan.budgets):
        assert kept.numel() == int(b) and 20 <= int(b) <= N
        assert bool((kept[1:] > kept[:-1]).all()) and 0 <= int(kept[0]) and int(kept[-1]) < N
        assert {0, 1, 2, 3} | set(range(N - 16, N)) <= set(kept.tolist())
    if name != "flashcache":  # uniform budgets
        assert int(plan.budgets.max()) - int(plan.budgets.min()) <= 1


def test_policies_choose_what_they_say():
    keys, values = _kv(L=2, N=200)
    keys[0][100] += 50.0  # an outlier pair in layer 0
    rec = make_policy("recency", 0.25, sink_tokens=4, recent_window=8).plan(keys, values)
    assert rec.kept[0].tolist() == [0, 1, 2, 3] + list(range(200 - 46, 200))
    fc = make_policy("flashcache", 0.25, sink_tokens=4, recent_window=8).plan(keys, values)
    assert 100 in fc.kept[0].tolist()
    dev, _ = outlier_analysis(keys[1], values[1], 0.2)
    body = torch.arange(200)[4:192]
    best = body[torch.sort(dev[4:192], descending=True, stable=True).indices[:int(fc.budgets[1]) - 12]]
    assert set(fc.kept[1].tolist()) == set(best.tolist()) | {0, 1, 2, 3} | set(range(192, 200))
    r1 = make_policy("random", 0.25, seed=1).plan(keys, values)
    assert all(torch.equal(a, b) for a, b in zip(r1.kept, make_policy("random", 0.25, seed=1)
                                                  .plan(keys, values).kept))
    assert not torch.equal(r1.kept[0], make_policy("random", 0.25, seed=2).plan(keys, values).kept[0])


def test_flashcache_budgets_follow_the_outlier_energy():
    keys, values = _kv(L=3, N=256)
    t = torch.linspace(0, 1, 256)[:, None, None]
    keys[1] = torch.sin(2 * math.pi * t).expand(256, 3, 16).clone()  # smooth: little outlier energy
    values[1] = torch.cos(2 * math.pi * t).expand(256, 3, 16).clone()
    plan = make_policy("flashcache", 0.3, sink_tokens=0, recent_window=0).plan(keys, values)
    assert int(plan.budgets[1]) < int(plan.budgets[0]) and int(plan.budgets[1]) < int(plan.budgets[2])
    assert plan.total == round(0.3 * 256 * 3)


def test_tiny_retention_keeps_the_protected_pairs_anyway():
    keys, values = _kv(L=2, N=100)
    plan = make_policy("flashcache", 0.05, sink_tokens=4, recent_window=16).plan(keys, values)
    assert plan.budgets.tolist() == [20, 20] and plan.retention_effective == 0.2


@pytest.mark.parametrize("kw,field,allowed", [
    (dict(retention=0), "retention", "(0, 1]"), (dict(retention=1.5), "retention", "(0, 1]"),
    (dict(retention=-0.2), "retention", "(0, 1]"), (dict(retention="0.2"), "retention", "(0, 1]"),
    (dict(retention=0.2, gamma=0), "gamma", "(0, 1)"), (dict(retention=0.2, gamma=1.0), "gamma", "(0, 1)"),
    (dict(retention=0.2, sink_tokens=-1), "sink_tokens", ">= 0"),
    (dict(retention=0.2, recent_window=2.5), "recent_window", ">= 0"),
])
def test_bad_parameters_name_the_field_and_the_range(kw, field, allowed):
    with pytest.raises(ValueError) as e:
        make_policy("flashcache", **kw)
    assert str(e.value).startswith(field) and allowed in str(e.value)


def test_unknown_policy_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"eviction policy must be one of \['flashcache', 'random', "
                                         r"'recency', 'uniform'\]"):
        make_policy("h2o", 0.2)


# ----------------------------------------------------------------------------- HF cache
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from vllm_lowbit_kv.hf_cache import COMPACTED_ATTENTION, LowBitKVCache  # noqa: E402
from vllm_lowbit_kv.schemes import get_scheme  # noqa: E402

HF_LAYERS, HF_HEADS, HF_DIM = 3, 2, 64


@pytest.fixture()
def tiny_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=192,
                      num_hidden_layers=HF_LAYERS, num_attention_heads=4,
                      num_key_value_heads=HF_HEADS, head_dim=HF_DIM, max_position_embeddings=1024,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def _prefill(model, cache, ids, chunk):
    with torch.no_grad():
        for s in range(0, ids.shape[1], chunk):
            logits = model(ids[:, s:s + chunk], past_key_values=cache, use_cache=True).logits
    return logits[0, -1]


def test_compaction_keeps_exactly_the_chosen_pairs_bf16(tiny_model):
    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(1))
    cache = LowBitKVCache(None, model=tiny_model, evictable=True)
    _prefill(tiny_model, cache, ids, 64)
    exact = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    plan = cache.evict(make_policy("flashcache", 0.3, sink_tokens=2, recent_window=8), tiny_model)
    assert tiny_model.config._attn_implementation == COMPACTED_ATTENTION
    assert cache.get_seq_length() == 150  # positions stay logical
    for layer, (k, v), kept in zip(cache.layers, exact, plan.kept):
        assert torch.equal(layer.keys, k[:, :, kept]) and torch.equal(layer.values, v[:, :, kept])
        assert torch.equal(layer.key_pos, kept)
    assert cache.memory_report()["stored_tokens"] == plan.total


@pytest.mark.parametrize("scheme", ["kivi2", "vidkv"])
def test_compaction_quantizes_the_kept_exact_pairs_in_groups(tiny_model, scheme):
    # retrieval heads split layers, which eviction refuses (tested apart)
    sch = get_scheme(scheme).with_params(block_tokens=16, rotate="none", retrieval_heads=0)
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(2))
    cache = LowBitKVCache(sch, model=tiny_model, sink_tokens=4, evictable=True, relevance="none")
    _prefill(tiny_model, cache, ids, 50)
    exact = [layer.exact() for layer in cache.layers]
    plan = cache.evict(make_policy("random", 0.4, sink_tokens=4, recent_window=5), tiny_model)
    for layer, (k, v), kept in zip(cache.layers, exact, plan.kept):
        kk, vv = k[:, :, kept].float(), v[:, :, kept].float()
        n = kept.numel()
        groups = n // 16
        m = groups * 16
        dk, dv = layer.decoded()
        assert dk.shape[-2] == n and layer.n_blocks == groups
        assert torch.equal(dk[:, :, :4].float(), kk[:, :, :4])  # sinks exact
        assert torch.equal(dk[:, :, m:].float(), kk[:, :, m:])  # tail exact
        kc, vc = sch.codecs(HF_DIM, 16)
        coded = k[:, :, kept[:m]].clone()  # group 0 coded with the sink rows at its row 4
        coded[:, :, :4] = coded[:, :, 4:5]
        blocks = coded.float().reshape(1, HF_HEADS, groups, 16, HF_DIM).permute(0, 2, 3, 1, 4)
        ref = kc.decode(kc.encode(blocks)).permute(0, 3, 1, 2, 4).reshape(1, HF_HEADS, m, HF_DIM)
        assert torch.allclose(dk[:, :, 4:m].float(), ref[:, :, 4:], atol=1e-2, rtol=1e-2)
        assert layer.exact_k == []  # the exact copy is gone


def test_decode_after_eviction_matches_attention_over_the_kept_set(tiny_model):
    """Reference: a DynamicCache holding each layer's kept pairs, decoded at logical positions."""
    ids = torch.randint(0, 128, (1, 180), generator=torch.Generator().manual_seed(3))
    cache = LowBitKVCache(None, model=tiny_model, evictable=True)
    _prefill(tiny_model, cache, ids, 60)
    exact = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    plan = cache.evict(make_policy("flashcache", 0.25, sink_tokens=4, recent_window=8), tiny_model)
    assert len(set(plan.budgets.tolist())) > 1  # layers of different lengths
    ref = DynamicCache()
    for i, ((k, v), kept) in enumerate(zip(exact, plan.kept)):
        ref.update(k[:, :, kept], v[:, :, kept], i)
    nxt = torch.tensor([[7, 9, 11, 13]])
    with torch.no_grad():
        chunk = tiny_model(nxt, past_key_values=cache, use_cache=True).logits[0]
        steps = []
        for t in range(nxt.shape[1]):  # the reference decodes token by token (no mask needed)
            pos = torch.tensor([[180 + t]])
            steps.append(tiny_model(nxt[:, t:t + 1], past_key_values=ref, use_cache=True,
                                    position_ids=pos).logits[0, -1])
    assert torch.allclose(chunk, torch.stack(steps), atol=1e-4, rtol=1e-4)


def test_eviction_refuses_what_it_cannot_do(tiny_model):
    cache = LowBitKVCache(None, model=tiny_model)
    _prefill(tiny_model, cache, torch.tensor([[1, 2, 3, 4]]), 4)
    with pytest.raises(ValueError, match="evictable=True"):
        cache.evict(make_policy("recency", 0.5, sink_tokens=1, recent_window=1), tiny_model)
    cache = LowBitKVCache(None, model=tiny_model, evictable=True)
    _prefill(tiny_model, cache, torch.tensor([[1, 2, 3, 4]]), 4)
    cache.evict(make_policy("recency", 0.5, sink_tokens=1, recent_window=1), tiny_model)
    with pytest.raises(ValueError, match="not evicted yet"):
        cache.evict(make_policy("recency", 0.5, sink_tokens=1, recent_window=1), tiny_model)


def test_stp_relevance_after_eviction_runs_on_original_positions(tiny_model):
    sch = get_scheme("vidkv_stp").with_params(block_tokens=16)
    cache = LowBitKVCache(sch, model=tiny_model, evictable=True, obs_window=8)
    ids = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(4))
    _prefill(tiny_model, cache, ids, 40)
    plan = cache.evict(make_policy("flashcache", 0.5, sink_tokens=4, recent_window=8), tiny_model)
    assert all(layer.n_blocks == int(b) // 16 for layer, b in zip(cache.layers, plan.budgets))
    with torch.no_grad():  # decode across a group boundary: the new group's relevance too
        for t in range(20):
            logits = tiny_model(torch.tensor([[t + 1]]), past_key_values=cache, use_cache=True).logits
            assert bool(torch.isfinite(logits).all())
    assert cache.get_seq_length() == 140


# ----------------------------------------------------------------------------- paged layout
from vllm_lowbit_kv.eviction.paged import (compact_request, compacted_read_plan,  # noqa: E402
                                           paged_geometry)
from vllm_lowbit_kv.paged import (PagedLayout, Staging, StagingAllocator, attend,  # noqa: E402
                                  forward_layer)

PH, PD, PT, PBS = 3, 64, 16, 32


def test_plan_for_pages_keeps_the_tail_and_whole_groups():
    keys, values = _kv(L=3, N=150, H=3, D=16)
    pol = make_policy("flashcache", 0.2, sink_tokens=4, recent_window=8)
    geo = paged_geometry(150, PBS, PT, pol, 2.0)
    assert (geo.keep_from, geo.region_cap, geo.kept_blocks) == (128, 64, 2)
    assert list(geo.freed_blocks) == [2, 3]
    plan = pol.plan(keys, values, keep_from=geo.keep_from, max_layer_budget=geo.max_layer_budget,
                    group=PT)
    for kept in plan.kept:
        region = kept[kept < 128]
        assert region.numel() % PT == 0 and region.numel() <= geo.region_cap
        assert set(range(128, 150)) <= set(kept.tolist()) and {0, 1, 2, 3} <= set(kept.tolist())


def _paged_request(scheme, N, sinks, seed=0, layers=2, chunk=40):
    """One request prefilled through the real write path, ``layers`` layers (pages and
    staging of their own, one StagingAllocator: vLLM's builder plans once for all)."""
    kc, vc = get_scheme(scheme).codecs(PD, PT)
    layout = PagedLayout(kc, vc, PH, PBS, sinks)
    alloc = StagingAllocator(4, PT, sinks)
    g = torch.Generator().manual_seed(seed)
    table = torch.tensor([5, 1, 7, 3, 9, 2, 8, 4])  # block ids in logical order
    state = []
    for _ in range(layers):
        pages = torch.zeros(layout.page_shape(12), dtype=torch.uint8)
        staging = Staging.allocate(4, PT, PH, PD, torch.bfloat16)
        k = torch.randn(N + 4, PH, PD, generator=g).bfloat16().float()
        v = torch.randn(N + 4, PH, PD, generator=g).bfloat16().float()
        state.append((pages, staging, k, v))
    for s in range(0, N, chunk):
        pos = torch.arange(s, min(N, s + chunk))
        wp, rp = alloc.plan_step(table[pos // PBS] * PBS + pos % PBS, [int(pos[-1]) + 1],
                                 [0, pos.numel()], table[None], layout.groups_per_block)
        for pages, staging, k, v in state:
            out = torch.zeros(pos.numel(), PH, PD)
            forward_layer(wp, rp, layout, k[pos], k[pos], v[pos], pages, staging, PD ** -0.5, out)
    return layout, alloc, table, state


@pytest.mark.parametrize("reference_arithmetic", [False, True])
@pytest.mark.parametrize("scheme,sinks", [("kivi4", 4), ("vidkv", 0)])
def test_paged_compaction_and_decode_match_the_kept_set(monkeypatch, scheme, sinks,
                                                        reference_arithmetic):
    """Compaction writes the kept pairs as the write path would encode them: by the C++
    encoder (where it runs), by the codecs with ``reference_arithmetic``."""
    import vllm_lowbit_kv.paged.layout as paged_layout
    from vllm_lowbit_kv.ops import cpu

    N = 150
    layout, alloc, table, state = _paged_request(scheme, N, sinks)
    encoder_calls = []
    monkeypatch.setattr(paged_layout, "encode_states",
                        lambda *a: encoder_calls.append(1) or cpu.encode_states(*a))
    pol = make_policy("flashcache", 0.25, sink_tokens=4, recent_window=8)
    geo = paged_geometry(N, PBS, PT, pol, 2.0)
    n_enc = N // PT
    slot = alloc.slot_of[int(table[n_enc // 2]) * 2 + n_enc % 2]
    from vllm_lowbit_kv.eviction.paged import request_context
    before = [request_context(layout, p, s, table.tolist(), N, slot) for p, s, _, _ in state]
    plan = pol.plan([k for k, _ in before], [v for _, v in before], keep_from=geo.keep_from,
                    max_layer_budget=geo.max_layer_budget, group=PT)
    kept = compact_request(geo, pol, [(layout, p, s) for p, s, _, _ in state], table.tolist(), slot,
                           reference_arithmetic)
    assert bool(encoder_calls) == (cpu.load_library() is None and not reference_arithmetic)
    # decode one token at position N: one plan for all layers, then each layer's compacted reads
    wp, rp = alloc.plan_step(table[N // PBS:N // PBS + 1] * PBS + N % PBS, [N + 1], [0, 1],
                             table[None], layout.groups_per_block)
    for (pages, staging, k, v), (ck, cv), pos, n in zip(state, before, plan.kept, kept):
        region = pos[pos < geo.keep_from]
        assert n == region.numel()
        # compaction keeps exactly the chosen pairs: the first n/T groups hold them, encoded
        tk = ck[region].reshape(-1, PT, PH, PD).clone()
        tv = cv[region].reshape(-1, PT, PH, PD).clone()
        if 0 < sinks < PT:
            tk[0, :sinks], tv[0, :sinks] = tk[0, sinks], tv[0, sinks]
        ref_k, ref_v = layout.decode(layout.encode(tk, tv, cpp=not reference_arithmetic))
        ref_k, ref_v = ref_k.reshape(-1, PH, PD), ref_v.reshape(-1, PH, PD)
        ref_k[:sinks], ref_v[:sinks] = ck[:sinks], cv[:sinks]
        for b in geo.freed_blocks:  # given back: whatever lands there is never read
            pages[int(table[b])] = 255
        g = torch.arange(n // PT)
        lrp = compacted_read_plan(rp, {0: (geo.keep_from, n, table[g // 2] * 2 + g % 2)}, layout)
        assert lrp.ctx_len == [n + N - geo.keep_from]
        q = torch.randn(1, PH, PD)
        out = torch.zeros(1, PH, PD)
        forward_layer(wp, lrp, layout, q, k[N:N + 1], v[N:N + 1], pages, staging, PD ** -0.5, out)
        keys = torch.cat([ref_k, ck[geo.keep_from:], k[N:N + 1]])
        vals = torch.cat([ref_v, cv[geo.keep_from:], v[N:N + 1]])
        expect = attend(q, keys, vals, keys.shape[0] - 1, PD ** -0.5)
        assert torch.allclose(out, expect, atol=1e-5, rtol=1e-5)
