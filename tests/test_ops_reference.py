"""The packed-attention reference (vllm_lowbit_kv.ops) that every kernel is checked
against: packed part + exact part merged by log-sum-exp equals plain causal
attention over the decoded context (paged.attend)."""

import pytest
import torch

from vllm_lowbit_kv.ops import merge_attention, packed_attention_reference
from vllm_lowbit_kv.paged import PagedLayout, attend
from vllm_lowbit_kv.schemes import get_scheme


def _exact_part(q, k, v, scale):
    """Attention of q [n, Hq, D] over all of k, v [S, H, D] with its lse."""
    G = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,shd->hqs", q, k.repeat_interleave(G, 1)) * scale
    out = torch.einsum("hqs,shd->qhd", torch.softmax(s, -1), v.repeat_interleave(G, 1))
    return out, torch.logsumexp(s, -1).T


@pytest.mark.parametrize("scheme,H,Hq,block_size", [("vidkv", 3, 9, 128), ("kivi2", 2, 2, 64),
                                                     ("vidkv_stp", 1, 4, 192)])
def test_packed_plus_exact_equals_full_attention(scheme, H, Hq, block_size):
    torch.manual_seed(0)
    kc, vc = get_scheme(scheme).codecs(64)
    layout = PagedLayout(kc, vc, H, block_size)
    T, N = layout.T, layout.groups_per_block
    pages = torch.full(layout.page_shape(16), 0xAB, dtype=torch.uint8)  # poisoned
    n_groups = [5, 0, 1]
    gids = torch.randperm(16 * N)[:sum(n_groups)]
    k, v = torch.randn(len(gids), T, H, 64), torch.randn(len(gids), T, H, 64)
    rel = torch.rand(len(gids), T, H)
    layout.write_states(pages, gids, layout.encode(k, v, rel))
    table = torch.zeros(3, max(n_groups), dtype=torch.int32)
    starts = [0, 5, 5]
    for r, g in enumerate(n_groups):
        table[r, :g] = gids[starts[r]:starts[r] + g].int()
    q_start = torch.tensor([0, 2, 3, 4])  # two query rows for request 0
    query = torch.randn(4, Hq, 64)
    skip = torch.tensor([3, 0, T])  # request 2 skips its whole group
    out, lse = packed_attention_reference(query, q_start, pages, layout, table,
                                          torch.tensor(n_groups), skip, 0.125)
    assert torch.isinf(lse[2:]).all() and (out[2:] == 0).all()  # no packed keys
    dk, dv = layout.decode(layout.read_states(pages, gids[:5]))
    ctx_k, ctx_v = dk.reshape(-1, H, 64)[3:], dv.reshape(-1, H, 64)[3:]
    fresh_k, fresh_v = torch.randn(2, H, 64), torch.randn(2, H, 64)
    ref = attend(query[:2], torch.cat([ctx_k, fresh_k]), torch.cat([ctx_v, fresh_v]),
                 ctx_k.shape[0], 0.125)
    # exact part with the causal mask of the fresh rows: row 0 sees fresh 0, row 1 both
    parts = [_exact_part(query[i:i + 1], fresh_k[:i + 1], fresh_v[:i + 1], 0.125) for i in (0, 1)]
    eo, el = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    merged, _ = merge_attention(out[:2], lse[:2], eo, el)
    torch.testing.assert_close(merged, ref, atol=2e-6, rtol=1e-5)


def test_merge_with_empty_part_is_identity():
    out, lse = torch.randn(3, 2, 8), torch.randn(3, 2)
    none = torch.full_like(lse, float("-inf"))
    merged, mlse = merge_attention(out, lse, torch.randn_like(out), none)
    assert torch.equal(merged, out) and torch.equal(mlse, lse)
    both_empty, else_ = merge_attention(out, none, out, none)
    assert (both_empty == 0).all() and torch.isinf(else_).all()
