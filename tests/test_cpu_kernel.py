"""The C++ CPU kernel (csrc/cpu/, vllm_lowbit_kv.ops.cpu) against the reference.

The kernel is built here on first use (JIT, ~20 s, cached under the project
cache). Every comparison runs on fresh random pages with the kernel's outputs
poisoned (NaN) before the call.

Tolerances: both the kernel and ``packed_attention_reference`` widen the query
exactly to float32 (fp32, bf16 and fp16 queries alike) and work in float32;
they differ in summation order (the kernel folds the query into each group's
metadata and sums per group with an online softmax), so outputs agree to
``OUT_TOL`` (atol 5e-5, rtol 1e-4 on softmax-weighted values of unit scale)
and log-sum-exps to ``LSE_TOL`` (atol 5e-5) for every query dtype; ternary and 2-
and 4-bit KIVI values to that plus the bound of their fixed-point probabilities
(``fixed_point_out_tol``).
"""

from __future__ import annotations

import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_lowbit_kv.ops import (merge_attention, packed_attention_reference, select_implementation,
                                unsupported_reason)
from vllm_lowbit_kv.codecs.kivi import KiviCodec
from vllm_lowbit_kv.codecs.vidkv import TernaryValueCodec
from vllm_lowbit_kv.ops import cpu
from vllm_lowbit_kv.paged import PagedLayout
from vllm_lowbit_kv.schemes import get_scheme

from test_paged import make, rnd, run_schedule

OUT_TOL = dict(atol=5e-5, rtol=1e-4)
LSE_TOL = dict(atol=5e-5, rtol=0)
#: bf16 pair tiles (prefill chunks with bf16 queries, the dense kernel's bf16 inputs, on a
#: CPU with AVX-512 BF16): decoded K and V and the probabilities rounded to bf16 (relative
#: 2^-9 each) for bf16 products with float32 sums, as vLLM's and GPU flash attention's bf16
#: paths do
BF16_OUT_TOL = dict(atol=2.5e-2, rtol=0)
BF16_LSE_TOL = dict(atol=2.5e-2, rtol=0)


def fixed_point_out_tol(layout, values: torch.Tensor) -> dict:
    """OUT_TOL widened for value rows summed two at a time (AVX-512 VNNI, head_dim 64 or
    128: trits, and 2- and 4-bit KIVI codes): a group's probabilities (KIVI per token: times
    each token's scale) in 32767 steps of their largest, each off by at most half a step,
    move its value sums by at most T / 65534 of that largest times a code's reach (a trit's
    alpha: max|v|; a KIVI code's levels times its scale: a token's or channel's range,
    2 max|v|), and the output, normalized by a sum that holds every group's largest
    probability, by at most as much. ``layout``: a PagedLayout or PageFormat; ``values``:
    the pages' decoded values or the values they were encoded from."""
    codec = layout.value_codec
    reach = (1 if isinstance(codec, TernaryValueCodec)
             else 2 if isinstance(codec, KiviCodec) and codec.bits <= 4 else 0)
    if not reach or not values.numel():
        return OUT_TOL
    bound = layout.T * reach * float(values.abs().max()) / 65534
    return dict(atol=OUT_TOL["atol"] + bound, rtol=OUT_TOL["rtol"])


DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: (scheme, overrides): the three the issue names, the other servable formats, and
#: codec variants that change the page format the kernel reads
FORMATS = [
    ("vidkv", {}), ("vidkv_stp", {}), ("kivi2", {}), ("kivi4", {}), ("vidkv_k2v2", {}),
    ("vidkv_k15v2", {}), ("vidkv", {"fft": False}), ("vidkv", {"one_bit": "sign"}),
    ("vidkv", {"one_bit": "minmax", "k": 0.75}), ("kivi2", {"group_size": 16}),
    ("vidkv_stp", {"protect": 0.3}), ("vidkv_visual", {}),
    # value codes per token in groups, decoded a vector at a time: 4- and 8-bit words
    ("kivi4", {"group_size": 16}), ("kivi4", {"bits": 8, "group_size": 16}),
]
#: RVQ pages (seeded random codebooks): the paper's 11-bit indices and 8-bit ones; keys in
#: strided channel groups, values in contiguous ones
RVQ_SCHEMES = ["rvq", "rvq8x256", "rvq2x256"]


@pytest.fixture(scope="module", autouse=True)
def built():
    reason = cpu.load_library()
    assert reason is None, reason  # CI must build the kernel, not skip it


def layout_for(scheme, params, H, T, block_size, sinks=0, D=64):
    s = get_scheme(scheme)
    s = s.with_params(D, **params) if params else s
    kc, vc = s.codecs(D, T, layer=0)
    return PagedLayout(kc, vc, H, block_size, sinks)


def random_case(layout, n_groups, q_rows, Hq, seed, num_blocks=None, key_scale=2.0):
    """Pages with every request's groups encoded from random K/V (the rest random bytes),
    a group table, queries."""
    g = torch.Generator().manual_seed(seed)
    T, H, D, N = layout.T, layout.H, layout.D, layout.groups_per_block
    total = sum(n_groups)
    num_blocks = num_blocks or max(1, -(-total // N) + 2)
    pages = torch.randint(0, 256, layout.page_shape(num_blocks), dtype=torch.uint8, generator=g)
    gids = torch.randperm(num_blocks * N, generator=g)[:total]
    if total:
        k = torch.randn(total, T, H, D, generator=g) * key_scale
        v = torch.randn(total, T, H, D, generator=g)
        rel = torch.rand(total, T, H, generator=g)
        layout.write_states(pages, gids, layout.encode(k, v, rel))
    table = torch.zeros(len(n_groups), max(n_groups + [1]), dtype=torch.int64)
    at = 0
    for r, n in enumerate(n_groups):
        table[r, :n] = gids[at:at + n]
        at += n
    q_start = torch.tensor([0] + q_rows).cumsum(0)
    query = torch.randn(int(q_start[-1]), Hq, D, generator=g)
    return pages, table, torch.tensor(n_groups), q_start, query


def check(layout, pages, table, num_groups, q_start, query, skip, scale=0.125, out_tol=None,
          lse_tol=LSE_TOL, rotation=None):
    want_out, want_lse = packed_attention_reference(query, q_start, pages, layout, table,
                                                    num_groups, skip, scale, rotation=rotation)
    if out_tol is None:
        gids = torch.cat([table[r, :int(n)] for r, n in enumerate(num_groups)])
        values = layout.decode(layout.read_states(pages, gids))[1] if gids.numel() else gids
        out_tol = fixed_point_out_tol(layout, values)
    n, Hq, D = query.shape
    out = torch.full((n, Hq, D), float("nan"))
    lse = torch.full((n, Hq), float("nan"))
    got_out, got_lse = cpu.packed_attention(query, q_start, pages, layout, table, num_groups,
                                            skip, scale, out=out, lse=lse, rotation=rotation)
    assert got_out is out and got_lse is lse
    torch.testing.assert_close(got_out, want_out, **out_tol)
    torch.testing.assert_close(got_lse, want_lse, **lse_tol)  # -inf where no packed key


@pytest.mark.parametrize("scheme,params", FORMATS, ids=lambda x: str(x))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_matches_reference(scheme, params, dtype):
    """Requests with several rows (a prefill chunk), none, a single group, a long context,
    a context emptied by skip_tokens, and sink positions skipped inside a group."""
    layout = layout_for(scheme, params, H=3, T=32, block_size=96, sinks=4)
    n_groups = [5, 0, 1, 24, 1, 3]
    q_rows = [3, 1, 1, 1, 2, 0]
    pages, table, ng, q_start, query = random_case(layout, n_groups, q_rows, Hq=9, seed=1)
    skip = torch.tensor([4, 0, 32, 0, 7, 0])  # request 2 skips its only group
    check(layout, pages, table, ng, q_start, query.to(dtype), skip)


@pytest.mark.parametrize("scheme", RVQ_SCHEMES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_reads_rvq_pages(scheme, dtype, rvq_codebook_file):
    """RVQ pages, decoded group by group from the layer's codebooks (seeded random codes):
    the cases of test_kernel_matches_reference, and the kernel is what ``auto`` picks."""
    layout = layout_for(scheme, {"codebook": str(rvq_codebook_file(scheme))}, H=3, T=32,
                        block_size=96, sinks=4)
    pages, table, ng, q_start, query = random_case(layout, [5, 0, 1, 24, 1, 3], [3, 1, 1, 1, 2, 0],
                                                   Hq=9, seed=11)
    check(layout, pages, table, ng, q_start, query.to(dtype), torch.tensor([4, 0, 32, 0, 7, 0]))
    assert select_implementation(layout.format, "cpu", gqa=3)[0] == "cpp"


@pytest.mark.parametrize("group_size", [8, 64])
def test_kernel_reads_rvq_pages_of_any_group_size(group_size, rvq_codebook_file):
    """Channel groups beside the decode's vector paths (groups of 32 channels, keys in two
    strided groups zipped by shuffles): 8 channels, shorter than a vector, with 8 strided
    key groups put back channel by channel; and one group of all 64 channels."""
    path = rvq_codebook_file("rvq4x256", group_size=group_size)
    layout = layout_for("rvq4x256", {"codebook": str(path), "group_size": group_size}, H=3,
                        T=32, block_size=96, sinks=4)
    pages, table, ng, q_start, query = random_case(layout, [5, 0, 3], [3, 1, 1], Hq=9, seed=2)
    check(layout, pages, table, ng, q_start, query, torch.tensor([4, 0, 0]))


def test_kernel_reads_rvq_values_beside_other_keys(rvq_codebook_file):
    """The retrieval heads of an RVQ scheme with retrieval_keys_only: kivi4 keys, RVQ
    values (the kernel's codebooks the values' alone), decode rows and a prefill chunk
    (tiles), and the encoder writes the same bytes as the codecs."""
    from test_cpu_encoder import check_store, kv

    scheme = get_scheme("rvq4x256").with_params(
        codebook=str(rvq_codebook_file("rvq4x256")), retrieval_heads=1,
        retrieval_keys_only=True)
    kc, vc = scheme.retrieval_codecs(64, 32, layer=0)
    assert (type(kc).__name__, type(vc).__name__) == ("KiviCodec", "RVQValueCodec")
    layout = PagedLayout(kc, vc, 3, 96, 4)
    pages, table, ng, q_start, query = random_case(layout, [5, 0, 3], [3, 1, 90], Hq=9,
                                                   seed=4)
    check(layout, pages, table, ng, q_start, query, torch.tensor([4, 0, 0]))
    check_store(layout, *kv(3, 32, 3, 64, torch.bfloat16, seed=4))


@pytest.mark.parametrize("scheme", RVQ_SCHEMES)
def test_rvq_tables_match_reference(scheme, rvq_codebook_file):
    """Long contexts, where the kernel reads RVQ codes through per-query tables (scores as
    sums of q . codeword entries, values as weights per codeword multiplied out at the end;
    where building them pays, rvq_tables_pay: every scheme at 3 query vectors but `rvq`'s
    2048-code books below ~2.4K tokens; at 6, rvq4x256 and rvq8x256): 3 and 6 query vectors
    (4- and one-vector table rows), sink positions skipped, a short request beside them
    that decodes its groups instead, and one long request alone (its context split over
    items, merged by log-sum-exp)."""
    layout = layout_for(scheme, {"codebook": str(rvq_codebook_file(scheme))}, H=3, T=64,
                        block_size=128, sinks=4)
    pages, table, ng, q_start, query = random_case(layout, [120, 120, 2, 60], [1, 2, 1, 1],
                                                   Hq=9, seed=5)
    check(layout, pages, table, ng, q_start, query.bfloat16(), torch.tensor([4, 0, 0, 64]))
    pages, table, ng, q_start, query = random_case(layout, [200], [1], Hq=9, seed=6)
    check(layout, pages, table, ng, q_start, query, torch.tensor([0]))


@pytest.mark.parametrize("group_size", [8, 32])
def test_rvq_tables_put_strided_value_groups_back(group_size, rvq_codebook_file):
    """The tables' value fold puts each group's channels back by the grouping: values in
    strided groups (values default to contiguous ones), of 8 channels (shorter than a
    vector) and of 32, over a context long enough for the tables."""
    fields = {"group_size": group_size, "grouping": "strided"}
    layout = layout_for("rvq4x256", {"codebook": str(rvq_codebook_file("rvq4x256", **fields)),
                                     **fields}, H=3, T=64, block_size=128, sinks=4)
    pages, table, ng, q_start, query = random_case(layout, [120, 2], [1, 1], Hq=9, seed=7)
    check(layout, pages, table, ng, q_start, query, torch.tensor([4, 0]))


@settings(max_examples=25, deadline=None)
@given(scheme=st.sampled_from(["vidkv", "vidkv_stp", "kivi2"]),
       T=st.sampled_from([16, 32, 64]), blocks_per=st.integers(1, 3),
       heads=st.sampled_from([(1, 1), (1, 4), (2, 8), (3, 9), (4, 4)]),
       n_groups=st.lists(st.integers(0, 12), min_size=1, max_size=5),
       rows=st.lists(st.integers(0, 3), min_size=5, max_size=5),
       skip=st.lists(st.integers(0, 40), min_size=5, max_size=5),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_kernel_matches_reference_random_shapes(scheme, T, blocks_per, heads, n_groups, rows,
                                                skip, dtype, seed):
    H, Hq = heads
    layout = layout_for(scheme, {}, H=H, T=T, block_size=T * blocks_per)
    R = len(n_groups)
    pages, table, ng, q_start, query = random_case(layout, n_groups, rows[:R], Hq, seed)
    check(layout, pages, table, ng, q_start, query.to(dtype), torch.tensor(skip[:R]))


#: (scheme, overrides, head_dim, block_tokens) taking each path of the kernel's code
#: readers: rows of key codes byte-aligned (transposed 16 rows at a time by byte permutes
#: with AVX-512 VBMI) or not (vidkv k=0.4: 26 two-bit and 38 one-bit channels; 8-bit rows
#: of 128 bytes: repacked); 1-bit (and with AVX-512 2-bit) columns read through lookup
#: tables, others converted (so are columns whose bits leave the last table group part
#: empty, as k=0.4 at 48: 19 two-bit and 29 one-bit channels);
#: value codes decoded in registers (2, 4, 8 bits; per token, per channel, STP rows);
#: head_dim of 1 to 4 vectors per channel block; groups of 16 to 48 tokens, not all
#: multiples of 16 (the last row block part empty)
CODE_PATHS = [
    ("kivi2", {}, 16, 24), ("kivi2", {}, 48, 32), ("kivi4", {}, 128, 16),
    ("kivi2", {"bits": 8}, 128, 32), ("kivi2", {"bits": 8}, 64, 40), ("vidkv", {"k": 0.4}, 64, 32),
    ("vidkv", {}, 128, 48), ("vidkv_stp", {}, 96, 40), ("vidkv_visual", {}, 64, 24),
    ("vidkv_k15v2", {}, 80, 32), ("vidkv", {"k": 0.25}, 64, 16), ("vidkv_k2v2", {}, 32, 24),
    ("vidkv", {"k": 0.4}, 48, 24),
]


@pytest.mark.parametrize("scheme,params,D,T", CODE_PATHS, ids=lambda x: str(x))
@pytest.mark.parametrize("heads", [(1, 1), (2, 6), (3, 9), (1, 7)], ids=str)
def test_kernel_code_paths(scheme, params, D, T, heads):
    """Fresh random pages per case, ragged contexts (one empty, one emptied by skip_tokens,
    one skipping into its second group), several GQA ratios, a decode row and a chunk of
    rows, bf16 queries; outputs poisoned before the call (check)."""
    H, Hq = heads
    layout = layout_for(scheme, params, H=H, T=T, block_size=2 * T, sinks=2, D=D)
    seed = zlib.crc32(f"{scheme}{params}{D}{T}{heads}".encode())
    n_groups = [7, 0, 1, 3, 2]
    pages, table, ng, q_start, query = random_case(layout, n_groups, [1, 1, 1, 4, 1], Hq,
                                                   seed=seed)
    skip = torch.tensor([0, 0, T, T + 3, 1])
    check(layout, pages, table, ng, q_start, query.to(torch.bfloat16), skip, scale=D ** -0.5)


def test_long_context_single_request_splits():
    """One request, one KV head: the context is split over work items and merged."""
    layout = layout_for("vidkv", {}, H=1, T=64, block_size=128)
    pages, table, ng, q_start, query = random_case(layout, [96], [1], Hq=3, seed=5)
    check(layout, pages, table, ng, q_start, query, torch.tensor([0]))


def test_decode_calls_in_turn_keep_their_scratch_apart():
    """Decode calls keep each thread's scratch per page format between calls: calls that
    alternate two formats of the same sizes (a layer's retrieval heads and the rest) and
    grow and shrink their query vectors each match the reference."""
    layouts = [layout_for("vidkv", {}, H=2, T=32, block_size=64),
               layout_for("kivi2", {}, H=2, T=32, block_size=64)]
    for i, q_rows in enumerate([[1, 1], [1, 1], [40, 30], [1, 2], [30, 40], [1, 1]]):
        layout = layouts[i % 2]
        pages, table, ng, q_start, query = random_case(layout, [3, 2], q_rows, Hq=6, seed=40 + i)
        check(layout, pages, table, ng, q_start, query, torch.tensor([0, 0]))


def test_rows_outside_requests_and_no_requests():
    layout = layout_for("kivi2", {}, H=2, T=16, block_size=32)
    pages, table, ng, _, query = random_case(layout, [3], [1], Hq=4, seed=6)
    # 3 query rows, the only request owns row 0: rows 1-2 get 0 / -inf
    check(layout, pages, table, ng, torch.tensor([0, 1]), torch.randn(3, 4, 64),
          torch.tensor([0]))
    out, lse = cpu.packed_attention(torch.randn(2, 4, 64), torch.tensor([0]), pages, layout,
                                    torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                                    torch.zeros(0, dtype=torch.long), 0.1)
    assert (out == 0).all() and torch.isinf(lse).all()


def test_corrupt_masks_and_bad_tables_are_errors():
    layout = layout_for("vidkv", {}, H=1, T=16, block_size=16)
    pages, table, ng, q_start, query = random_case(layout, [2], [1], Hq=1, seed=7)
    at = 0
    for name, size in layout.key_codec.layout().fields:
        if name == "chan_mask":
            break
        at += size
    gid = table[0, 1:2]
    state = layout.read_states(pages, gid)
    state[..., at] ^= 1  # one channel more or less at 2 bits: the count no longer matches
    bad = pages.clone()
    layout.write_states(bad, gid, state)
    with pytest.raises(RuntimeError, match="chan_mask has"):
        cpu.packed_attention(query, q_start, bad, layout, table, ng, torch.tensor([0]), 0.1)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu.packed_attention(query, q_start, pages, layout, table + 10**6, ng, torch.tensor([0]),
                             0.1)


PORTABLE_CHECK = """
import sys, time
import torch
from vllm_lowbit_kv.ops import cpu
from test_cpu_kernel import CODE_PATHS, FORMATS, check, layout_for, random_case
started = time.monotonic()
assert cpu.load_library() is None
print(f"built in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
cases = [(s, p, 64, 32) for s, p in FORMATS] + CODE_PATHS
for i, (scheme, params, D, T) in enumerate(cases):
    layout = layout_for(scheme, params, H=2, T=T, block_size=2 * T, sinks=2, D=D)
    pages, table, ng, q_start, query = random_case(layout, [3, 9, 0], [2, 1, 1], 6, seed=i)
    check(layout, pages, table, ng, q_start, query.bfloat16(), torch.tensor([2, 0, 0]))
    print(f"{scheme} {params} D={D} T={T} ok", file=sys.stderr, flush=True)
# the prefill tile path (decoded groups, micro-GEMM) and the dense kernel in this build:
# float32 queries in float32 tiles, bf16 ones as bf16 pairs where it has AVX-512 BF16
from test_cpu_kernel import BF16_LSE_TOL, BF16_OUT_TOL
for i, (scheme, params) in enumerate(FORMATS):
    layout = layout_for(scheme, params, H=1, T=32, block_size=64, sinks=2)
    pages, table, ng, q_start, query = random_case(layout, [3, 2], [90, 1], 3, seed=i)
    check(layout, pages, table, ng, q_start, query, torch.tensor([2, 0]))
    check(layout, pages, table, ng, q_start, query.bfloat16(), torch.tensor([2, 0]),
          out_tol=BF16_OUT_TOL, lse_tol=BF16_LSE_TOL)
from test_cpu_kernel import dense_reference
q = torch.randn(50, 4, 48)
out, lse = cpu.dense_attention(q.bfloat16(), q[:, :2].bfloat16(), q[:, 2:].bfloat16(), 0.1,
                               causal=True)
want_out, want_lse = dense_reference(q.bfloat16(), q[:, :2].bfloat16(), q[:, 2:].bfloat16(),
                                     0.1, 0)
torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=0)
# a prefill chunk's packed context as dense rows (decode_groups: keys read from their codes;
# 30 tokens: not a whole number of VidKV keys' token blocks)
for i, (scheme, params) in enumerate(FORMATS):
    layout = layout_for(scheme, params, H=2, T=30, block_size=60)
    pages, table, _, _, _ = random_case(layout, [4], [1], 2, seed=i)
    want = [x.reshape(-1, 2, 64) for x in layout.decode(layout.read_states(pages, table[0]))]
    got = [torch.empty_like(x) for x in want]
    cpu.decode_groups(pages, layout, table[0], 0, *got)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
# decode rows' exact part read in place (int8 staging, sinks, a window) in this build
from test_cpu_kernel import exact_decode_both_ways
(got, want), ran = exact_decode_both_ways("vidkv", 4, 1)
assert ran
for a, b in zip(got, want):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
# the query and output rotation in this build's vector width (the output's lane sums)
m, _ = torch.linalg.qr(torch.randn(64, 64, generator=torch.Generator().manual_seed(1)))
layout = layout_for("vidkv", {}, H=2, T=32, block_size=64, sinks=2)
pages, table, ng, q_start, query = random_case(layout, [3, 1], [2, 1], 6, seed=5)
check(layout, pages, table, ng, q_start, query.bfloat16(), torch.tensor([2, 0]), rotation=m)
# the encoder in this build (RVQ: the float32 search where it lacks AVX-512 BF16, vdpbf16ps
# where it has it without AMX)
import os, tempfile
from test_cpu_encoder import FORMATS as ENCODED, check_store, kv
from vllm_lowbit_kv.codecs.base import ModelIdentity
from vllm_lowbit_kv.codecs.rvq import RVQCodebooks, RVQSettings
g = torch.Generator().manual_seed(0)
books = RVQCodebooks(*(torch.randn(1, 4, 256, 32, generator=g) * 0.3 for _ in range(2)),
                     ModelIdentity("test", 1, 2, 64), RVQSettings(4, 256, 32, "strided",
                                                                  "contiguous"), {})
path = str(books.save(os.path.join(tempfile.mkdtemp(), "books.safetensors")))
for i, (scheme, params) in enumerate(ENCODED + [("rvq4x256", {"codebook": path})]):
    layout = layout_for(scheme, params, H=2, T=32, block_size=64)
    check_store(layout, *kv(3, 32, 2, 64, torch.float32, seed=i))
# RVQ pages through the kernel's per-query tables (contexts long enough to build them;
# 3 and 18 query vectors: 4- and 16-lane rows)
layout = layout_for("rvq4x256", {"codebook": path}, H=2, T=32, block_size=64)
pages, table, ng, q_start, query = random_case(layout, [48, 48, 48, 2], [1, 6, 1, 1], 6, seed=0)
check(layout, pages, table, ng, q_start, query.bfloat16(), torch.tensor([0, 0, 0, 0]))
print("ok")
"""


def _check_build(tmp_path, march):
    """PORTABLE_CHECK against the kernel built with -march=``march`` in its own process
    (its own build folder under tmp_path: no lock or library left by another run)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, LOWBIT_KV_CPU_MARCH=march, VLLM_LOWBIT_KV_CACHE=str(tmp_path),
               OMP_NUM_THREADS=str(torch.get_num_threads()),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent),
                                           os.environ.get("PYTHONPATH", "")]))
    stderr = tmp_path / "stderr.txt"
    with stderr.open("w") as err:
        try:
            run = subprocess.run([sys.executable, "-c", PORTABLE_CHECK], env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=err, timeout=900)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{march} build check timed out; its progress:\n" + stderr.read_text())
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), stderr.read_text()[-3000:]


def cpu_flags() -> set[str]:
    """This CPU's feature flags (empty off x86 Linux)."""
    import os
    from pathlib import Path

    if os.uname().machine != "x86_64" or not Path("/proc/cpuinfo").exists():
        return set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v2"])
def test_portable_build_without_avx512(tmp_path, march):
    """The kernel built without AVX-512 matches the reference too (FORMATS and CODE_PATHS,
    RVQ's per-query tables), and so does the encoder (RVQ's float32 search): for AVX2
    (x86-64-v3: the AVX2 fused trits, AVX2 int8/code/fp16 conversions, repacked code rows,
    1-bit key columns through pair tables, narrower vectors) and for SSE4 only (x86-64-v2:
    the scalar trit table and generic conversions, the path of any other CPU). On an AVX2 CPU without
    AVX-512 the native build every other test checks is the x86-64-v3 one: not built twice."""
    import os

    if os.uname().machine != "x86_64":
        pytest.skip(f"{march} is an x86 target")
    flags = cpu_flags()
    if march == "x86-64-v3" and "avx512f" not in flags and {"avx2", "f16c", "fma"} <= flags:
        pytest.skip("the native build is this CPU's AVX2 build: every other kernel test checks it")
    _check_build(tmp_path, march)


def test_avx512_build_without_vbmi(tmp_path):
    """The kernel built for AVX-512 without VBMI (Skylake-SP: AVX-512 conversions and masked
    tails and nibble tables, but AVX2 fused trits and repacked code rows, no byte-permute
    paths) matches the reference too; skipped where this CPU cannot run AVX-512
    BW/VL/DQ/CD."""
    flags = cpu_flags()
    need = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
    if not need <= flags:
        pytest.skip(f"this CPU lacks {sorted(need - flags)}")
    _check_build(tmp_path, "skylake-avx512")


def test_avx512_bf16_build_without_amx(tmp_path):
    """The kernel built for AVX-512 BF16 without AMX (Cooper Lake; Zen 4 likewise: the RVQ
    encoder's bf16 search by vdpbf16ps for every group, the prefill's pair products on
    vectors) matches the reference too; skipped where this CPU lacks AVX-512 BF16."""
    flags = cpu_flags()
    need = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16"}
    if not need <= flags:
        pytest.skip(f"this CPU lacks {sorted(need - flags)}")
    _check_build(tmp_path, "cooperlake")


def test_dispatch_per_layout():
    """cpp for the formats it reads, the reference for the others; a forced
    implementation that cannot run is refused with the reason."""
    vidkv = layout_for("vidkv", {}, H=3, T=64, block_size=128)
    quantile = layout_for("quantile1", {}, H=3, T=64, block_size=128)
    assert select_implementation(vidkv, "cpu")[0] == "cpp"
    assert select_implementation(quantile, "cpu")[0] == "torch"
    assert "QuantileCodec" in unsupported_reason("cpp", quantile, "cpu")
    assert select_implementation(vidkv, "cpu", "torch")[1] is packed_attention_reference
    with pytest.raises(ValueError, match="attention_impl 'cpp' cannot run .*QuantileCodec"):
        select_implementation(quantile, "cpu", "cpp")
    with pytest.raises(ValueError, match="'cuda' cannot run .*runs on CUDA devices, not cpu"):
        select_implementation(vidkv, "cpu", "cuda")
    with pytest.raises(ValueError, match=r"attention_impl must be one of \('auto'"):
        select_implementation(vidkv, "cpu", "gpu")


def test_environment_variable_chooses(monkeypatch):
    layout = layout_for("vidkv", {}, H=3, T=64, block_size=128)
    monkeypatch.setenv("LOWBIT_KV_ATTENTION_IMPL", "torch")
    assert select_implementation(layout, "cpu")[0] == "torch"
    assert select_implementation(layout, "cpu", "cpp")[0] == "cpp"  # the config wins
    monkeypatch.setenv("LOWBIT_KV_ATTENTION_IMPL", "fast")
    with pytest.raises(ValueError, match="LOWBIT_KV_ATTENTION_IMPL must be one of"):
        select_implementation(layout, "cpu")


@pytest.mark.parametrize("scheme,sinks,obs_window", [("vidkv", 3, None), ("kivi2", 16, None),
                                                     ("vidkv_stp", 0, 8)])
def test_forward_layer_cpp_equals_torch(scheme, sinks, obs_window):
    """The serving path (paged.forward_layer: packed part + exact part merged) with the
    kernel gives the reference's outputs and writes the same bytes (STP relevance
    included), through chunked prefill and decode of three batched requests."""
    torch.manual_seed(11)
    HQ, D = 9, 64
    lens = [90, 41, 20]
    seqs = [(rnd(L, 3, D), rnd(L, 3, D), rnd(L, HQ, D)) for L in lens]
    schedule = [[20, 30, 3], [40, 5, 0], [3, 1, 17], [30, 1, 0]] + [[1, 1, 0]] * 8
    runs = {}
    for impl in ("torch", "cpp"):
        layout, pages, staging, alloc = make(scheme, T=16, block_size=32, sinks=sinks,
                                             q_heads=HQ if obs_window else None)
        tables = [torch.arange(i * 8, (i + 1) * 8).flip(0) for i in range(3)]
        fn = packed_attention_reference if impl == "torch" else cpu.packed_attention
        _, outs = run_schedule(layout, pages, staging, alloc, seqs, tables, schedule,
                               obs_window=obs_window, packed_attention=fn)
        runs[impl] = (outs, pages)
    tol = fixed_point_out_tol(layout, torch.cat([v.flatten() for _, v, _ in seqs]))
    for (_, _, _, a), (_, _, _, b) in zip(runs["torch"][0], runs["cpp"][0]):
        torch.testing.assert_close(b, a, **tol)
    assert torch.equal(runs["torch"][1], runs["cpp"][1])


def exact_decode_both_ways(scheme, sinks, window):
    """forward_layer's outputs through chunked prefill and decode of three requests (one
    shorter than the sinks), the decode rows' exact part read in place by the C++ kernel
    and gathered by PyTorch; and whether the kernel took every decode batch."""
    import vllm_lowbit_kv.paged.attention as attention

    torch.manual_seed(5)
    HQ, D = 9, 64
    lens = [75, 44, 3]
    seqs = [(rnd(L, 3, D), rnd(L, 3, D), rnd(L, HQ, D)) for L in lens]
    schedule = [[30, 37, 2], [40, 0, 0]] + [[1, 1, 1]] * 6
    in_place = attention.exact_decode_attention
    calls, runs = [], []
    try:
        for read_in_place in (True, False):
            attention.exact_decode_attention = (
                (lambda *a: calls.append(in_place(*a)) or calls[-1]) if read_in_place
                else (lambda *a: False))
            layout, pages, staging, alloc = make(scheme, T=16, block_size=32, sinks=sinks,
                                                 window=window, slots=12)
            tables = [torch.arange(i * 8, (i + 1) * 8) for i in range(3)]
            runs.append([o[3] for o in run_schedule(layout, pages, staging, alloc, seqs, tables,
                                                    schedule,
                                                    packed_attention=cpu.packed_attention)[1]])
    finally:
        attention.exact_decode_attention = in_place
    return runs, bool(calls) and all(calls)


@pytest.mark.parametrize("scheme,sinks,window", [("vidkv", 4, 1), ("kivi2", 0, 0),
                                                 ("kivi2", 3, 2)])
def test_decode_exact_part_read_in_place_equals_gathered(scheme, sinks, window):
    """Decode rows' exact part (sinks, staged window and partial group, fresh token) by the
    C++ kernel, which reads each key where it lives, equals the float32 attention over the
    gathered copies it replaces: requests with different sink counts, tails and window
    runs in one batch; int8 (vidkv) and bf16 (kivi2) staging."""
    (got, want), kernel_ran = exact_decode_both_ways(scheme, sinks, window)
    assert kernel_ran
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **DENSE_TOL)


@pytest.mark.parametrize("staging_dtype", ["int8", "model"])
@pytest.mark.parametrize("D,Hq,H", [(64, 9, 3), (192, 9, 1), (16, 4, 4)])
def test_decode_exact_part_equals_float64_attention(D, Hq, H, staging_dtype):
    """The exact part of decode rows equals float64 attention over the same keys and values
    (int8 staging widened by its scales): head_dims of one, four and twelve vectors (more
    than one pass of score channels), query heads per KV head 1, 3 and 9 (more than one
    pass of value sums), runs of 0-300 staged tokens with holes (-inf bias) and a request
    with no live key; the other rows poisoned and left alone."""
    from vllm_lowbit_kv.paged.write import StagedTokens

    g = torch.Generator().manual_seed(D + Hq)
    B, T, sinks, slots_each = 4, 64, 2, 5
    E = sinks + slots_each * T + 1
    n = B + 2  # rows 0 and 5 belong to no request
    rows = torch.arange(1, B + 1)
    q = torch.randn(n, Hq, D, generator=g, dtype=torch.bfloat16)
    k = torch.randn(n, H, D, generator=g, dtype=torch.bfloat16)
    v = torch.randn(n, H, D, generator=g, dtype=torch.bfloat16)
    staged_k = StagedTokens.allocate((B * slots_each, T, H, D), torch.bfloat16, staging_dtype)
    staged_v = StagedTokens.allocate((B * slots_each, T, H, D), torch.bfloat16, staging_dtype)
    for staged in (staged_k, staged_v):
        if staged.scale is None:
            staged.data.copy_(torch.randn(staged.data.shape, generator=g).bfloat16())
        else:
            staged.data.copy_(torch.randint(-127, 128, staged.data.shape, generator=g))
            staged.scale.copy_(torch.rand(staged.scale.shape, generator=g) / 64)
    sink_kv = torch.randn(B + 1, 2, sinks, H, D, generator=g).bfloat16()
    sink_blocks = torch.tensor([3, 0, 4, 1])
    tail_slots = torch.randperm(B * slots_each, generator=g).reshape(B, slots_each)
    bias = torch.zeros(B, E)
    lengths = [300, 17, 0, 161]  # staged tokens per request
    for b, length in enumerate(lengths):
        bias[b, sinks + length:E - 1] = float("-inf")
        bias[b, torch.rand(E, generator=g) < 0.1] = float("-inf")  # holes anywhere
    bias[2] = float("-inf")  # no live key
    out = torch.full((n, Hq, D), float("nan"))
    lse = torch.full((n, Hq), float("nan"))
    assert cpu.exact_decode_attention(q, rows, bias, sink_kv, sink_blocks, sinks, staged_k,
                                      staged_v, tail_slots, k, v, 0.125, out, lse)
    run_k = staged_k.read_run(tail_slots, slots_each * T).double()
    run_v = staged_v.read_run(tail_slots, slots_each * T).double()
    for b in range(B):
        r = int(rows[b])
        keys = torch.cat([sink_kv[sink_blocks[b], 0].double(), run_k[b], k[r:r + 1].double()])
        values = torch.cat([sink_kv[sink_blocks[b], 1].double(), run_v[b], v[r:r + 1].double()])
        live = bias[b] == 0
        for qh in range(Hq):
            h = qh // (Hq // H)
            if not live.any():
                assert torch.equal(out[r, qh], torch.zeros(D))
                assert lse[r, qh] == float("-inf")
                continue
            scores = 0.125 * keys[live, h] @ q[r, qh].double()
            want_lse = torch.logsumexp(scores, 0)
            want = torch.softmax(scores, 0) @ values[live, h]
            torch.testing.assert_close(out[r, qh].double(), want, **DENSE_TOL)
            torch.testing.assert_close(lse[r, qh].double(), want_lse, **DENSE_TOL)
    assert out[[0, n - 1]].isnan().all() and lse[[0, n - 1]].isnan().all()


def test_decode_exact_part_refuses_indices_outside_its_buffers():
    """A sink block or staging slot outside the buffers is an error naming it, not a read
    of whatever memory lies there."""
    from vllm_lowbit_kv.paged.write import StagedTokens

    q, k = torch.randn(2, 6, 64), torch.randn(2, 3, 64)
    staged = StagedTokens.allocate((4, 16, 3, 64), torch.float32, "int8")
    sinks = torch.zeros(5, 2, 2, 3, 64)
    out, lse = torch.empty(2, 6, 64), torch.empty(2, 6)
    bias = torch.zeros(2, 2 + 16 + 1)
    good = dict(sink_blocks=torch.tensor([0, 4]), tail_slots=torch.tensor([[1], [3]]))
    for field, bad in (("sink_blocks", torch.tensor([0, 5])),
                       ("tail_slots", torch.tensor([[1], [4]]))):
        args = {**good, field: bad}
        with pytest.raises(RuntimeError, match=field):
            cpu.exact_decode_attention(q, torch.tensor([0, 1]), bias, sinks, args["sink_blocks"],
                                       2, staged, staged, args["tail_slots"], k, k, 0.125, out, lse)
    assert cpu.exact_decode_attention(q, torch.tensor([0, 1]), bias, sinks, good["sink_blocks"],
                                      2, staged, staged, good["tail_slots"], k, k, 0.125, out, lse)


@pytest.mark.parametrize("staging_dtype", ["int8", "model"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_staging_writes_equal_the_pytorch_ones(staging_dtype, dtype, monkeypatch):
    """The C++ staging write stores what StagedTokens.store's PyTorch path stores, bit for
    bit: absmax_int8's codes and scales (halves rounded to even, an all-zero row at scale
    1) or the model dtype, through a head view of the buffers as a split layer stages."""
    import vllm_lowbit_kv.paged.write as write

    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, 3, 64, generator=g) * 3
    x[4] = 0
    x[5, 1] = 0
    x[5, 1, :8] = torch.tensor([127, 0.5, 1.5, 2.5, -0.5, -1.5, 3.5, -2.5])  # scale 1: ties
    x = x.to(dtype)
    rows = torch.tensor([0, 4, 5, 7, 19, 11])
    slot, off = torch.tensor([0, 0, 1, 2, 2, 3]), torch.tensor([0, 5, 3, 0, 1, 15])
    in_cpp = write.stage_rows
    ran, stored = [], []
    for cpp in (True, False):
        monkeypatch.setattr(write, "stage_rows", (lambda *a: ran.append(in_cpp(*a)) or ran[-1])
                            if cpp else (lambda *a: False))
        staging = write.Staging.allocate(4, 16, 5, 64, torch.bfloat16, staging_dtype=staging_dtype)
        staging.heads(1, 4, 3).k.store(slot, off, x, rows)
        stored.append((staging.k.data, staging.k.scale))
    assert ran == [True]
    (data, scale), (want_data, want_scale) = stored
    assert torch.equal(data, want_data)
    assert (scale is None and want_scale is None) or torch.equal(scale, want_scale)


@pytest.mark.parametrize("staging_dtype", ["int8", "model"])
def test_staged_reads_equal_the_pytorch_ones(staging_dtype, monkeypatch):
    """The C++ staged read (StagedTokens.read_run) returns what the PyTorch path does, bit
    for bit: runs of slots cut at n tokens (a whole run, inside a slot, one slot), batched
    runs, through a head view as a split layer reads; slots outside the staging and runs
    longer than their slots are refused by name."""
    import vllm_lowbit_kv.paged.write as write

    g = torch.Generator().manual_seed(5)
    staging = write.Staging.allocate(6, 16, 5, 64, torch.bfloat16, staging_dtype=staging_dtype)
    x = (torch.randn(96, 5, 64, generator=g) * 3).bfloat16()
    staging.k.store(torch.arange(96) // 16, torch.arange(96) % 16, x, torch.arange(96))
    part = staging.heads(1, 4, 3).k
    cases = [(torch.tensor([4, 1, 2]), 48), (torch.tensor([4, 1, 2]), 21),
             (torch.tensor([3]), 5), (torch.tensor([[0, 5], [2, 3]]), 30)]
    in_cpp = write.read_staged
    for slots, n in cases:
        got = part.read_run(slots, n)
        monkeypatch.setattr(write, "read_staged", lambda *a: None)
        want = part.read_run(slots, n)
        monkeypatch.setattr(write, "read_staged", in_cpp)
        assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="slots"):
        part.read_run(torch.tensor([6]), 3)
    with pytest.raises(RuntimeError, match="out"):
        part.read_run(torch.tensor([0]), 17)


def test_page_state_writes_equal_the_pytorch_ones():
    """cpu.write_states puts group states where PageFormat.write_states does, bit for bit,
    nothing else touched: sink bytes, several groups per block, a split layer's part (a
    strided view of the page bytes); gids outside the pages are refused by name."""
    from vllm_lowbit_kv.paged.layout import HeadSplitLayout

    g = torch.Generator().manual_seed(8)
    layout = layout_for("vidkv", None, H=3, T=16, block_size=64, sinks=2)
    split = HeadSplitLayout([layout_for("kivi4", None, H=1, T=16, block_size=64, sinks=2),
                             layout_for("vidkv", None, H=2, T=16, block_size=64, sinks=2)],
                            [(0,), (1, 2)])
    for part, pages in [(layout, torch.randint(0, 256, layout.page_shape(5), dtype=torch.uint8,
                                               generator=g))] + \
            list(zip(split.parts, split.part_pages(torch.randint(
                0, 256, split.page_shape(5), dtype=torch.uint8, generator=g)))):
        fmt = part.format
        gids = torch.randperm(5 * fmt.groups_per_block, generator=g)[:7]
        states = torch.randint(0, 256, (7, part.H, fmt.state_bytes), dtype=torch.uint8,
                               generator=g)
        want = pages.clone()
        fmt.write_states(want, gids, states)
        assert cpu.write_states(fmt, pages, gids, states)
        assert torch.equal(pages, want)
    with pytest.raises(RuntimeError, match="gids"):
        cpu.write_states(fmt, pages, torch.tensor([5 * fmt.groups_per_block]), states[:1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_merge_into_the_output_equals_the_pytorch_merge(dtype):
    """cpu.merge_attention_into writes merge_attention's output into a view of the layer's
    output in its dtype: float32 up to rounding, else that rounded to the dtype (within
    one unit in its last place); rows where either part, or both, has no keys (lse -inf)
    included, nothing outside the view touched."""
    g = torch.Generator().manual_seed(11)
    n, Hq, D = 7, 9, 64
    out_a, out_b = (torch.randn(n, Hq, D, generator=g) for _ in range(2))
    lse_a, lse_b = (torch.randn(n, Hq, generator=g) * 4 for _ in range(2))
    lse_a[1], lse_b[2] = float("-inf"), float("-inf")
    lse_a[3, :4] = lse_b[3, :4] = float("-inf")
    lse_b[4] = lse_a[4] + 30  # one part all but absent
    output = torch.full((n + 2, Hq * D), 7.0, dtype=dtype)
    dst = output[:n].view(n, Hq, D)
    assert cpu.merge_attention_into(out_a, lse_a, out_b, lse_b, dst)
    want = merge_attention(out_a, lse_a, out_b, lse_b)[0]
    assert not want[3, :4].any()
    ulp = 0 if dtype == torch.float32 else torch.finfo(dtype).eps
    torch.testing.assert_close(dst.float(), want.to(dtype).float(), atol=1e-6,
                               rtol=max(ulp, 1e-6))
    assert bool((output[n:] == 7).all())


# ---------------------------------------------------------------------------- dense prefill
#: the dense kernel computes in float32 (bf16 inputs widened exactly): only the order of
#: the sums differs from float32 attention
DENSE_TOL = dict(atol=1e-5, rtol=1e-5)


def dense_op(q, k, v, scale, causal):
    """The dense kernel's op itself (no wrapper)."""
    n, Hq, D = q.shape
    out, lse = torch.empty(n, Hq, D), torch.empty(n, Hq)
    torch.ops.lowbit_kv.dense_attention(q, k, v, causal, k.shape[0] - n, scale, out, lse)
    return out, lse


def dense_reference(q, k, v, scale, offset):
    """float32 attention of q [n, Hq, D] over k, v [S, H, D]; row i sees keys j <= i + offset
    (offset None: all), out 0 and lse -inf for a row that sees none."""
    n, S, G = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)
    kf, vf = (x.float().repeat_interleave(G, 1).transpose(0, 1) for x in (k, v))
    s = qf @ kf.transpose(1, 2) * scale
    if offset is not None:
        s = s.masked_fill(torch.arange(S)[None] > torch.arange(n)[:, None] + offset, float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.nan_to_num(torch.softmax(s, -1)) @ vf
    return out.transpose(0, 1), lse.transpose(0, 1)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 150), extra=st.integers(0, 150),
       heads=st.sampled_from([(1, 1), (3, 3), (9, 3), (8, 2), (12, 1)]),
       D=st.sampled_from([16, 32, 64, 80, 128, 256]), causal=st.booleans(),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), seed=st.integers(0, 2**16))
def test_dense_attention_matches_float32(built, n, extra, heads, D, causal, dtype, seed):
    """The dense kernel (a prefill chunk's own tokens: rows at the end of the keys, causal
    offset S - n) against float32 attention, across chunk lengths (ragged key blocks of 64,
    row blocks of 64, query vectors in blocks of 6 and 4), GQA ratios, head sizes and both
    input dtypes."""
    Hq, H = heads
    g = torch.Generator().manual_seed(seed)
    S = n + extra
    q = torch.randn(n, Hq, D, generator=g).to(dtype)
    k = (torch.randn(S, H, D, generator=g) * 2).to(dtype)
    v = torch.randn(S, H, D, generator=g).to(dtype)
    out, lse = dense_op(q, k, v, D ** -0.5, causal)
    want_out, want_lse = dense_reference(q, k, v, D ** -0.5, S - n if causal else None)
    bf16 = dtype == torch.bfloat16
    torch.testing.assert_close(lse, want_lse, **(BF16_LSE_TOL if bf16 else DENSE_TOL))
    torch.testing.assert_close(out, want_out, **(BF16_OUT_TOL if bf16 else DENSE_TOL))


def test_dense_attention_strides_empty_rows_and_poisoned_outputs(built):
    """Strided views are read as they are, and out written as a strided view in float32 or
    bf16; every output is written (NaN-poisoned before); rows that see no key (a negative
    causal offset) get 0 and -inf; bad arguments are errors; inputs the kernel does not
    take get None from the wrapper, which runs the op for bf16 and float32 alike."""
    g = torch.Generator().manual_seed(3)
    n, S, Hq, H, D = 40, 40, 6, 3, 64
    q = torch.randn(Hq, n, D, generator=g).bfloat16().transpose(0, 1)  # strided rows
    kv = torch.randn(S, 2, H, D, generator=g).bfloat16()
    k, v = kv[:, 0], kv[:, 1]  # every other row block
    out = torch.full((n, Hq, D), float("nan"))
    lse = torch.full((n, Hq), float("nan"))
    torch.ops.lowbit_kv.dense_attention(q, k, v, True, -5, 0.125, out, lse)
    want_out, want_lse = dense_reference(q, k, v, 0.125, -5)
    assert torch.equal(out[:5], torch.zeros(5, Hq, D)) and bool((lse[:5] == float("-inf")).all())
    torch.testing.assert_close(lse[5:], want_lse[5:], **BF16_LSE_TOL)
    torch.testing.assert_close(out[5:], want_out[5:], **BF16_OUT_TOL)
    # into the model's dtype through a strided view (a layer's output): the float32 rows
    # rounded to nearest even, nothing written past the view
    wide = torch.full((n, Hq, 2 * D), float("nan")).bfloat16()
    lse_again = torch.full((n, Hq), float("nan"))
    torch.ops.lowbit_kv.dense_attention(q, k, v, True, -5, 0.125, wide[..., :D], lse_again)
    assert torch.equal(wide[..., :D], out.bfloat16()) and torch.equal(lse_again, lse)
    assert bool(wide[..., D:].isnan().all())
    with pytest.raises(RuntimeError, match="unit stride in the last dim"):
        torch.ops.lowbit_kv.dense_attention(q, k, v, True, 0, 0.1, wide[..., ::2], lse)
    with pytest.raises(RuntimeError, match="all bfloat16 or all float32"):
        torch.ops.lowbit_kv.dense_attention(q.float(), k, v, True, 0, 0.1, out, lse)
    with pytest.raises(RuntimeError, match="multiple of the KV heads"):
        torch.ops.lowbit_kv.dense_attention(q[:, :5], k, v, True, 0, 0.1, out[:, :5].contiguous(),
                                            lse[:, :5].contiguous())
    assert cpu.dense_attention(q.half(), k.half(), v.half(), 0.1, causal=True) is None
    assert cpu.dense_attention(q.float(), k, v, 0.1, causal=True) is None
    f32 = [x.float() for x in (q, k, v)]
    got, want = cpu.dense_attention(*f32, 0.1, causal=True), dense_op(*f32, 0.1, True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def prefill_exact(q, k, v, ks, vs, scale, reference_arithmetic=False):
    """prefill_exact_attention into NaN-poisoned outputs: (out, lse)."""
    from vllm_lowbit_kv.paged.attention import prefill_exact_attention

    out = torch.full(q.shape, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"))
    prefill_exact_attention(q, k, v, ks, vs, scale, out, lse,
                            reference_arithmetic=reference_arithmetic)
    return out, lse


def test_prefill_chunks_take_the_dense_kernel(built, monkeypatch):
    """A prefill chunk without exact context (its own tokens causally) runs the dense kernel
    on the CPU for bf16 and float32 inputs (within its pair tiles' rounding, or summation
    order, of float32 attention), and torch's attention with ``reference_arithmetic`` (the
    engines' float32 parity checks) without calling the kernel."""
    import vllm_lowbit_kv.paged.attention as attention

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(70, h, 64, generator=g) for h in (9, 3, 3))
    for x, out_tol, lse_tol in ([(q, k, v), DENSE_TOL, DENSE_TOL],
                                [[y.bfloat16() for y in (q, k, v)], BF16_OUT_TOL, BF16_LSE_TOL]):
        got = prefill_exact(*x, [], [], 0.125)
        direct = cpu.dense_attention(*x, 0.125, causal=True)
        assert torch.equal(got[0], direct[0]) and torch.equal(got[1], direct[1])
        want_out, want_lse = dense_reference(*x, 0.125, 0)
        torch.testing.assert_close(got[0], want_out, **out_tol)
        torch.testing.assert_close(got[1], want_lse, **lse_tol)

    def refuse(*args, **kwargs):
        raise AssertionError("the dense kernel ran under reference_arithmetic")

    monkeypatch.setattr(attention, "dense_attention", refuse)
    out, lse = prefill_exact(q, k, v, [], [], 0.125, reference_arithmetic=True)
    want_out, want_lse = dense_reference(q, k, v, 0.125, 0)
    torch.testing.assert_close(out, want_out, **DENSE_TOL)
    torch.testing.assert_close(lse, want_lse, **DENSE_TOL)


def test_prefill_exact_part_in_one_dense_call(built, monkeypatch):
    """A bf16 prefill chunk's exact part (sinks and staged tokens whole, its own tokens
    causally) in one dense call equals the two parts attended apart by torch and merged."""
    import vllm_lowbit_kv.paged.attention as attention

    g = torch.Generator().manual_seed(9)
    Q = 100
    q, k, v = (torch.randn(Q, h, 64, generator=g).bfloat16() for h in (9, 3, 3))
    # sinks and a staged run as the pages and staging hold them: bf16 values, read as float32
    ks = [torch.randn(1, n, 3, 64, generator=g).bfloat16().float() for n in (4, 37)]
    vs = [torch.randn(1, n, 3, 64, generator=g).bfloat16().float() for n in (4, 37)]
    out, lse = prefill_exact(q, k, v, ks, vs, 0.125)
    monkeypatch.setattr(attention, "dense_attention", lambda *args, **kwargs: None)
    want_out, want_lse = prefill_exact(q, k, v, ks, vs, 0.125)
    torch.testing.assert_close(out, want_out, **BF16_OUT_TOL)
    torch.testing.assert_close(lse, want_lse, **BF16_LSE_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scheme,params", FORMATS + [(s, None) for s in RVQ_SCHEMES],
                         ids=lambda x: str(x))
def test_prefill_tile_path_matches_reference(scheme, params, dtype, rvq_codebook_file):
    """Items with many query vectors (a prefill chunk: rows x query heads per KV head at
    least the kernel's kTileMinVectors, 256) decode each group once to float tiles and
    multiply them (bf16 queries: as bf16 pairs where the CPU has AVX-512 BF16): every page
    format against the reference, with a decode request beside the chunk, sinks skipped
    into the second group, a split long context, poisoned outputs (check)."""
    if params is None:  # RVQ: the layer's codebooks (seeded random codes)
        params = {"codebook": str(rvq_codebook_file(scheme))}
    layout = layout_for(scheme, params, H=2, T=32, block_size=64, sinks=2)
    seed = zlib.crc32(f"tiles{scheme}{params}".encode())
    pages, table, ng, q_start, query = random_case(layout, [20, 3], [90, 1], 6, seed)
    bf16 = dtype == torch.bfloat16
    check(layout, pages, table, ng, q_start, query.to(dtype), torch.tensor([35, 2]),
          out_tol=BF16_OUT_TOL if bf16 else None, lse_tol=BF16_LSE_TOL if bf16 else LSE_TOL)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scheme,params", FORMATS + [(s, None) for s in RVQ_SCHEMES],
                         ids=lambda x: str(x))
@pytest.mark.parametrize("T", [32, 30])
def test_decode_groups_matches_reference(scheme, params, dtype, T, rvq_codebook_file):
    """A prefill chunk's packed context as dense rows (ops.cpu.decode_groups): every page
    format's tokens [skip, G T) equal the codecs' decode (float32 within summation order;
    bf16 and fp16 as its rounding), written into slices of poisoned larger buffers with
    nothing around them touched; skips inside the first group and past it. T = 30: groups
    whose tokens are not a whole number of the kernel's token blocks (VidKV keys map 4 at
    a time)."""
    if params is None:
        params = {"codebook": str(rvq_codebook_file(scheme))}
    layout = layout_for(scheme, params, H=2, T=T, block_size=2 * T)
    pages, table, _, _, _ = random_case(layout, [5], [1], 2,
                                        zlib.crc32(f"rows{scheme}{params}".encode()))
    gids = table[0]
    want_k, want_v = (x.reshape(-1, 2, 64) for x in layout.decode(layout.read_states(pages, gids)))
    for skip in (0, 3, 40):
        rows = gids.numel() * layout.T - skip
        ko, vo = (torch.full((rows + 4, 2, 64), float("nan"), dtype=dtype) for _ in range(2))
        cpu.decode_groups(pages, layout, gids, skip, ko[2:-2], vo[2:-2])
        for got, want in ((ko, want_k), (vo, want_v)):
            assert got[:2].isnan().all() and got[-2:].isnan().all()
            if dtype == torch.float32:
                torch.testing.assert_close(got[2:-2], want[skip:], atol=2e-5, rtol=1e-5)
            else:  # a float32 difference may round the other way: one unit in the last place
                torch.testing.assert_close(got[2:-2].float(), want[skip:].to(dtype).float(),
                                           atol=1e-5, rtol=2 * torch.finfo(dtype).eps)


def test_decode_groups_refuses_bad_arguments():
    """Buffers of the wrong shape or dtype, groups outside the cache and skips past the
    groups are errors naming the argument."""
    layout = layout_for("vidkv", {}, H=2, T=32, block_size=64)
    pages, table, _, _, _ = random_case(layout, [3], [1], 2, 4)
    gids = table[0]
    ok = torch.empty(3 * 32, 2, 64)
    with pytest.raises(RuntimeError, match="key_out, value_out"):
        cpu.decode_groups(pages, layout, gids, 0, torch.empty(3 * 32 - 1, 2, 64), ok)
    with pytest.raises(RuntimeError, match="key_out, value_out"):
        cpu.decode_groups(pages, layout, gids, 0, ok, ok.to(torch.int32))
    with pytest.raises(RuntimeError, match="gids"):
        cpu.decode_groups(pages, layout, torch.tensor([0, 1, pages.shape[0] * 2]), 0, ok, ok)
    with pytest.raises(RuntimeError, match="skip"):
        cpu.decode_groups(pages, layout, gids, 3 * 32 + 1, ok, ok)


@pytest.mark.parametrize("scheme,sinks,window", [("vidkv", 3, 0), ("kivi2", 0, 1),
                                                 ("vidkv_stp", 2, 0)])
def test_prefill_chunks_read_their_packed_groups_dense(scheme, sinks, window, monkeypatch):
    """In bf16 with the C++ kernel, a prefill chunk reads its packed groups as decoded rows
    in the dense kernel's one pass (paged.attention.reads_packed_dense), decode rows beside
    it keep the packed kernel: the outputs of chunked prefill and decode of three requests
    equal those of the packed kernel's tile path merged with the exact part, within bf16
    tiles' rounding; the pages are the same bytes."""
    import vllm_lowbit_kv.paged.forward as forward

    torch.manual_seed(3)
    HQ, D = 9, 64
    lens = [100, 60, 20]
    seqs = [tuple(rnd(L, h, D).bfloat16() for h in (3, 3, HQ)) for L in lens]
    schedule = [[20, 30, 3], [40, 1, 17], [40, 29, 0]] + [[1, 1, 0]] * 4
    decoded = []
    spy = cpu.decode_groups
    monkeypatch.setattr(cpu, "decode_groups", lambda *a: decoded.append(a[2].numel()) or spy(*a))
    runs = []
    for dense in (True, False):
        if not dense:
            monkeypatch.setattr(forward, "reads_packed_dense", lambda *a: False)
        layout, pages, staging, alloc = make(scheme, T=16, block_size=32, sinks=sinks,
                                             window=window, slots=12,
                                             q_heads=HQ if scheme == "vidkv_stp" else None)
        tables = [torch.arange(i * 8, (i + 1) * 8).flip(0) for i in range(3)]
        outs = run_schedule(layout, pages, staging, alloc, seqs, tables, schedule,
                            obs_window=8 if scheme == "vidkv_stp" else None,
                            packed_attention=cpu.packed_attention)[1]
        runs.append(([o[3] for o in outs], pages))
        if dense:
            assert decoded, "no prefill chunk read its groups dense"
            calls = len(decoded)
    assert len(decoded) == calls  # the packed kernel's run decoded nothing
    for a, b in zip(*(r[0] for r in runs)):
        torch.testing.assert_close(a, b, **BF16_OUT_TOL)
    assert torch.equal(runs[0][1], runs[1][1])
