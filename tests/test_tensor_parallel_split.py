"""What one tensor-parallel rank stores and reads equals one process's share (issue #17).

vLLM's tensor parallelism gives each rank whole KV heads with their query heads
(SmolLM2 on 3 ranks: one KV head and its 3 query heads each). The packed pages must
then hold, on rank h, exactly the bytes one process stores for head h, and rank h's
attention output must be one process's output for heads 3h..3h+2: pages, sinks,
residual window, rotation and STP relevance (scored per KV head from that head's
query group) are per head, so nothing may depend on the heads a rank does not hold.
Driven through the same ``forward_layer`` the vLLM backend calls, on one layout with
all heads and on one layout per rank.
"""

import pytest
import torch

from test_paged import rnd, run_schedule
from vllm_lowbit_kv.paged import PagedLayout, Staging, StagingAllocator
from vllm_lowbit_kv.schemes import get_scheme

KV_HEADS, GQA, D, T, BLOCK = 3, 3, 64, 16, 32


def _engine(scheme, kv_heads, sinks, window, slots=12, num_blocks=32):
    kc, vc = scheme.codecs(D, T)
    layout = PagedLayout(kc, vc, kv_heads, BLOCK, sinks, rotation=scheme.rotation(D, 0))
    pages = torch.zeros(layout.page_shape(num_blocks), dtype=torch.uint8)
    staging = Staging.allocate(slots, T, kv_heads, D, torch.bfloat16, kv_heads * GQA)
    return layout, pages, staging, StagingAllocator(slots, T, sinks, window)


@pytest.mark.parametrize("name,params,sinks,window", [
    ("vidkv", {"protect": 0.25}, 4, 1),     # STP, sinks, window, Hadamard (vidkv's default)
    ("kivi2", {"rotate": "none"}, 0, 0),
])
def test_each_rank_holds_one_process_share(name, params, sinks, window):
    scheme = get_scheme(name).with_params(**params)
    torch.manual_seed(0)
    lens = [75, 40]
    tables = [torch.arange(0, 8), torch.arange(8, 16)]
    seqs = [(rnd(L, KV_HEADS, D), rnd(L, KV_HEADS, D), rnd(L, KV_HEADS * GQA, D)) for L in lens]
    schedule = [[30, 40], [45, 0], [1, 1], [1, 1]]
    obs_window = 8 if params.get("protect") else None

    whole = _engine(scheme, KV_HEADS, sinks, window)
    _, whole_outs = run_schedule(*whole, seqs, tables, schedule, obs_window=obs_window)
    for h in range(KV_HEADS):
        q_heads = slice(h * GQA, (h + 1) * GQA)
        share = [(k[:, h:h + 1], v[:, h:h + 1], q[:, q_heads]) for k, v, q in seqs]
        rank = _engine(scheme, 1, sinks, window)
        _, rank_outs = run_schedule(*rank, share, tables, schedule, obs_window=obs_window)
        assert torch.equal(rank[1][:, 0], whole[1][:, h]), f"rank {h}'s pages differ from head {h}'s"
        for (_, _, _, out_whole), (_, _, _, out_rank) in zip(whole_outs, rank_outs):
            torch.testing.assert_close(out_rank, out_whole[:, q_heads], atol=1e-5, rtol=1e-5)
