"""Triton kernels (vllm_lowbit_kv.ops.triton) against the reference codecs and the reference attention.

Without a usable CUDA device the kernels run in Triton's interpreter
(TRITON_INTERPRET=1 is set below, before the kernels are imported); with one
(and TRITON_INTERPRET unset) the same tests run on the GPU, marked ``gpu``.
Outputs and pages are poisoned before every run.

Tolerances (float32 math in both; only the summation order differs): out
atol 2e-5 + rtol 1e-4 and lse atol 1e-5 + rtol 1e-5 for float32, bfloat16 and
float16 queries alike (both sides compute in float32 from the same query
values; on the GPU the code products use an exact 3-way bf16 split with
float32 accumulation, see vllm_lowbit_kv.ops.triton.attention_kernel).

quantize_and_store: bit-identical fields are compared byte for byte; the
fields whose thresholds are float32 means (VidKV 1-bit components, ternary
values) must have identical codes except at elements within float32 rounding
of their threshold, and levels within one fp16 step (vllm_lowbit_kv.ops.triton.store_kernel).
"""

import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
if not ON_GPU:  # tests/conftest.py sets it before anything imports triton
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from vllm_lowbit_kv.ops import triton as triton_ops  # noqa: E402
from vllm_lowbit_kv.ops.triton.attention_kernel import _row_tiles  # noqa: E402
from vllm_lowbit_kv.ops import packed_attention_reference, reference  # noqa: E402
from vllm_lowbit_kv.ops.page_format import gpu_format_reason, page_format  # noqa: E402
from vllm_lowbit_kv.paged import PagedLayout  # noqa: E402
from vllm_lowbit_kv.schemes import get_scheme  # noqa: E402

from _state_agreement import assert_states_agree, fields  # noqa: E402

if not ON_GPU and not isinstance(triton.language.sum, InterpretedFunction):
    raise RuntimeError(
        "triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run "
        "in the interpreter; run through tests/conftest.py (pytest) or set TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def _interpreter_while_testing(monkeypatch):
    """The interpreter also reads TRITON_INTERPRET while it runs (conftest drops it after
    collection so that servers started by other tests do not inherit it)."""
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


DEVICE = "cuda" if ON_GPU else "cpu"
on_device = pytest.mark.gpu if ON_GPU else (lambda test: test)  # gpu: skipped without CUDA
SCHEMES = ["kivi2", "vidkv", "vidkv_stp"]
#: every scheme the GPU kernels read (tests/test_kernel_protocol.py's KERNEL_SCHEMES)
KERNEL_SCHEMES = ["kivi2", "kivi4", "kivi8", "vidkv", "vidkv_paper", "vidkv_retrieval", "vidkv_stp",
                  "vidkv_k2v2", "vidkv_k15v2"]
POISON = 0xAB


def _layout(scheme, T, H, block_size, sinks=0):
    kc, vc = get_scheme(scheme).codecs(64, T)
    return PagedLayout(kc, vc, H, block_size, sinks)


def _kv(E, T, H, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    offset = torch.randn(64, generator=g) * 2  # per-channel offsets, as real keys have
    k = torch.randn(E, T, H, 64, generator=g) * 3 + offset
    v = torch.randn(E, T, H, 64, generator=g)
    return k.to(dtype), v.to(dtype)


# -- quantize and store ---------------------------------------------------------------------

@on_device
@pytest.mark.parametrize("scheme,T,block_size,dtype", [
    ("kivi2", 16, 32, torch.bfloat16), ("kivi2", 64, 64, torch.float32),
    ("vidkv", 32, 64, torch.bfloat16), ("vidkv", 64, 128, torch.float16),
    ("vidkv_stp", 32, 32, torch.bfloat16), ("vidkv_stp", 64, 64, torch.float32),
    ("kivi4", 32, 64, torch.bfloat16), ("vidkv_k2v2", 32, 64, torch.bfloat16)])
def test_quantize_and_store_matches_reference_codec(scheme, T, block_size, dtype):
    H, E, blocks = 2, 5, 6
    layout = _layout(scheme, T, H, block_size, sinks=2)  # sink areas must stay untouched
    k, v = _kv(E, T, H, dtype, seed=T)
    k[0, :, 1, 5] = 0.75  # a constant channel: zero scale
    v[1, 3] = v[1, 4]  # duplicated tokens: tied ranges and norms
    rel = torch.rand(E, T, H)
    rel[2, :4] = 0.5  # tied relevance: lower index wins
    gids = torch.randperm(blocks * layout.groups_per_block)[:E]
    ref = torch.full(layout.page_shape(blocks), POISON, dtype=torch.uint8)
    reference.store(k, v, gids, ref, layout, rel)
    pages = torch.full(layout.page_shape(blocks), POISON, dtype=torch.uint8, device=DEVICE)
    triton_ops.store(k.to(DEVICE), v.to(DEVICE), gids.to(DEVICE), pages, layout,
                                  rel.to(DEVICE))
    pages = pages.cpu()
    assert_states_agree(layout, layout.read_states(ref, gids), layout.read_states(pages, gids),
                         k, v, rel if layout.value_codec.uses_relevance else None)
    untouched = ref.clone()
    layout.write_states(untouched, gids, layout.read_states(pages, gids))
    assert torch.equal(pages, untouched)  # nothing else written: other states, sinks, pads
    # decoded groups agree (codes equal up to ties, levels up to an fp16 step)
    dk, dv = layout.decode(layout.read_states(pages, gids))
    rk, rv = layout.decode(layout.read_states(ref, gids))
    for got, want in ((dk, rk), (dv, rv)):
        err = (got - want).norm() / want.norm()
        assert err < 1e-3, err


@on_device
@pytest.mark.parametrize("scheme", ["kivi2", "vidkv_k2v2"])
@pytest.mark.parametrize("magnitude", [1e-6, 3e4])
def test_quantize_and_store_kivi_is_bit_exact_at_extreme_magnitudes(scheme, magnitude):
    """Tiny ranges (subnormal fp16 scales) and values near the fp16 limit."""
    layout = _layout(scheme, 16, 2, 16)
    k, v = ((x * magnitude).clamp(-65504, 65504) for x in _kv(4, 16, 2, torch.float32, seed=3))
    gids = torch.tensor([3, 0, 2, 1])
    ref = torch.zeros(layout.page_shape(4), dtype=torch.uint8)
    reference.store(k, v, gids, ref, layout)
    pages = torch.full(layout.page_shape(4), POISON, dtype=torch.uint8, device=DEVICE)
    triton_ops.store(k.to(DEVICE), v.to(DEVICE), gids.to(DEVICE), pages, layout)
    assert torch.equal(pages.cpu(), ref)


@on_device
def test_quantize_and_store_many_groups_near_ties_only():
    """Larger sample for the non-exact fields: mismatches stay rare and at ties."""
    layout = _layout("vidkv_stp", 64, 4, 64)
    E = 24
    k, v = _kv(E, 64, 4, torch.bfloat16, seed=7)
    gids = torch.arange(E)
    ref = torch.zeros(layout.page_shape(E), dtype=torch.uint8)
    reference.store(k, v, gids, ref, layout)  # STP from the norm fallback
    pages = torch.full(layout.page_shape(E), POISON, dtype=torch.uint8, device=DEVICE)
    triton_ops.store(k.to(DEVICE), v.to(DEVICE), gids.to(DEVICE), pages, layout)
    got = layout.read_states(pages.cpu(), gids)
    want = layout.read_states(ref, gids)
    # the norm fallback may pick another token at a norm tie: compare masks first
    kb = layout.format.k_bytes
    vm = fields(layout.value_codec, want[..., kb:])["tok_mask"]
    gm = fields(layout.value_codec, got[..., kb:])["tok_mask"]
    assert torch.equal(vm, gm)
    rel = v.float().norm(dim=-1)
    assert_states_agree(layout, want, got, k, v, rel)


def test_quantize_and_store_refuses_nonfinite_and_bad_shapes():
    layout = _layout("vidkv", 16, 2, 16)
    pages = torch.zeros(layout.page_shape(2), dtype=torch.uint8)
    k, v = _kv(1, 16, 2, torch.float32, seed=0)
    k[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        triton_ops.store(k, v, torch.tensor([0]), pages, layout)
    with pytest.raises(ValueError, match="k.shape"):
        triton_ops.store(k[:, :8], v, torch.tensor([0]), pages, layout)


def test_unsupported_formats_are_refused_with_the_reason():
    layout = _layout("quantile1", 16, 2, 16)
    reason = triton_ops.supports(page_format(layout), "cuda", 1)
    assert reason and "QuantileCodec" in reason
    with pytest.raises(ValueError, match="QuantileCodec"):
        triton_ops.attention(torch.zeros(1, 2, 64), torch.tensor([0, 1]),
                                    torch.zeros(layout.page_shape(1), dtype=torch.uint8), layout,
                                    torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1]),
                                    torch.tensor([0]), 0.1)
    with pytest.raises(ValueError, match="QuantileCodec"):
        triton_ops.store(torch.zeros(1, 16, 2, 64), torch.zeros(1, 16, 2, 64), torch.tensor([0]),
                         torch.zeros(layout.page_shape(1), dtype=torch.uint8), layout)
    assert gpu_format_reason(page_format(_layout("vidkv_stp", 64, 2, 64))) is None


# -- attention ---------------------------------------------------------------------------------

def _attention_case(scheme, T, H, Hq, block_size, n_groups, q_rows, skip, seed, qdtype):
    torch.manual_seed(seed)
    layout = _layout(scheme, T, H, block_size)
    N = layout.groups_per_block
    blocks = -(-sum(n_groups) // N) + 3
    pages = torch.full(layout.page_shape(blocks), POISON, dtype=torch.uint8)
    gids = torch.randperm(blocks * N)[:sum(n_groups)]
    k, v = _kv(len(gids), T, H, torch.float32, seed)
    layout.write_states(pages, gids, layout.encode(k, v, torch.rand(len(gids), T, H)))
    table = torch.full((len(n_groups), max(max(n_groups), 1) + 2), -7, dtype=torch.int32)
    at = 0
    for r, g in enumerate(n_groups):
        table[r, :g] = gids[at:at + g].int()
        at += g
    q_start = torch.tensor([0] + q_rows).cumsum(0)
    query = (torch.randn(int(q_start[-1]), Hq, 64) * 2).to(qdtype)
    return layout, pages, table, torch.tensor(n_groups), q_start, query, torch.tensor(skip)


def _check_attention(layout, pages, table, ng, q_start, query, skip, scale, splits):
    ref_out, ref_lse = packed_attention_reference(query, q_start, pages, layout, table, ng, skip,
                                                  scale)
    n, Hq, D = query.shape
    out = torch.full((n, Hq, D), float("nan"), device=DEVICE)  # poisoned
    lse = torch.full((n, Hq), 12345.0, device=DEVICE)
    dev = lambda x: x.to(DEVICE)  # noqa: E731
    got_out, got_lse = triton_ops.attention(
        dev(query), dev(q_start), dev(pages), layout, dev(table), dev(ng), dev(skip), scale,
        num_splits=splits, out=out, lse=lse)
    assert got_out is out and got_lse is lse
    torch.testing.assert_close(out.cpu(), ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=1e-5, rtol=1e-5)


@on_device
@pytest.mark.parametrize("scheme", SCHEMES + ["vidkv_k15v2"])
@pytest.mark.parametrize("T,block_size,H,Hq,splits,qdtype", [
    (16, 32, 2, 6, 1, torch.float32),  # GQA 3 (not a power of two), one split
    (32, 64, 1, 4, 3, torch.bfloat16),  # GQA 4, split-K
    (64, 64, 2, 2, 2, torch.float16),  # no GQA, split-K
])
def test_attention_matches_reference(scheme, T, block_size, H, Hq, splits, qdtype):
    # requests: long context with a skipped sink prefix and 2 query rows; empty context;
    # context entirely skipped; one group; a context whose last group is partly skipped;
    # a request with no query rows
    n_groups = [5, 0, 1, 2, 3, 4]
    q_rows = [2, 1, 1, 1, 3, 0]
    skip = [3, 0, T, 0, 2 * T + 5, 0]
    case = _attention_case(scheme, T, H, Hq, block_size, n_groups, q_rows, skip, T + Hq, qdtype)
    _check_attention(*case, scale=0.125, splits=splits)


@on_device
@pytest.mark.parametrize("scheme", ["vidkv", "kivi2"])
def test_attention_long_context_default_splits(scheme):
    """A batch of decode rows over contexts of 20-37 groups (default split choice)."""
    n_groups = [37, 20, 29]
    case = _attention_case(scheme, 16, 2, 8, 16, n_groups, [1, 1, 1], [4, 0, 0], 3,
                           torch.bfloat16)
    _check_attention(*case, scale=64 ** -0.5, splits=None)


def test_default_split_aims_at_16_programs_per_sm(monkeypatch):
    """The default split (measured on an H200, attention_kernel.PROGRAMS_PER_SM): about 16
    programs per SM, at least 4 groups per split, 1 off CUDA."""
    from vllm_lowbit_kv.ops.triton import attention_kernel as ak
    monkeypatch.setattr(ak, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    assert ak._default_splits(cuda, 32 * 3, 256) == 22  # 32K context x batch 32, 3 KV heads
    assert ak._default_splits(cuda, 3, 8) == 2  # short: 4 groups per split
    assert ak._default_splits(cuda, 4096, 256) == 1  # the SMs are full already
    assert ak._default_splits(torch.device("cpu"), 3, 256) == 1


@on_device
def test_attention_chunked_prefill_rows_use_bigger_tiles():
    """More query rows than requests: row tiles of 64 // G rows, a tile straddling nothing."""
    case = _attention_case("vidkv_stp", 16, 1, 3, 16, [3, 2], [25, 40], [0, 1], 11,
                           torch.float32)
    _check_attention(*case, scale=0.1, splits=2)


@on_device
def test_store_then_attend_round_trip():
    """Pages written by the Triton store kernel read by the Triton attention equal the
    reference attention over the same pages."""
    layout = _layout("vidkv", 32, 2, 64)
    k, v = _kv(6, 32, 2, torch.bfloat16, seed=5)
    gids = torch.tensor([7, 1, 4, 0, 2, 9])
    pages = torch.full(layout.page_shape(5), POISON, dtype=torch.uint8, device=DEVICE)
    triton_ops.store(k.to(DEVICE), v.to(DEVICE), gids.to(DEVICE), pages, layout)
    table = gids.reshape(2, 3).int()
    q = torch.randn(2, 8, 64)
    _check_attention(layout, pages.cpu(), table, torch.tensor([3, 3]), torch.tensor([0, 1, 2]),
                     q, torch.tensor([0, 0]), 0.125, None)


# -- memory bounds (interpreter only) ----------------------------------------------------------

@contextlib.contextmanager
def bounds_checked_interpreter():
    """Triton's interpreter with every load and store checked: each address that its mask
    keeps must lie inside the storage of a tensor argument of the launch (the interpreter
    itself reads host memory unchecked, where a GPU faults with an illegal memory access)."""
    from triton.runtime import interpreter as interp

    ranges = []
    init = interp.GridExecutor._init_args_hst

    def init_checked(self, args_dev, kwargs):
        args, kw = init(self, args_dev, kwargs)
        ranges.clear()
        for x in [*args, *kw.values()]:
            if isinstance(x, torch.Tensor):
                st = x.untyped_storage()
                ranges.append((st.data_ptr(), st.data_ptr() + st.nbytes()))
        return args, kw

    builder = interp.interpreter_builder
    load, store = builder.create_masked_load, builder.create_masked_store

    def check(ptrs, mask, what):
        size = np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize
        addr = np.asarray(ptrs.data).astype(np.uint64)
        addr = addr[np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)]
        inside = np.zeros(addr.shape, dtype=bool)
        for lo, hi in ranges:
            inside |= (addr >= lo) & (addr + size <= hi)
        if not inside.all():
            bad = [int(a) for a in addr[~inside][:3]]
            near = [min((a - lo for lo, _ in ranges), key=abs) for a in bad]
            raise IndexError(f"{what} outside every tensor argument at {int((~inside).sum())} "
                             f"addresses (offsets from the nearest tensor start: {near})")

    def load_checked(ptrs, mask, other, *args):
        check(ptrs, mask, "load")
        return load(ptrs, mask, other, *args)

    def store_checked(ptrs, value, mask, *args):
        check(ptrs, mask, "store")
        return store(ptrs, value, mask, *args)

    interp.GridExecutor._init_args_hst = init_checked
    builder.create_masked_load, builder.create_masked_store = load_checked, store_checked
    try:
        yield
    finally:
        interp.GridExecutor._init_args_hst = init
        builder.create_masked_load, builder.create_masked_store = load, store


@triton.jit
def _shifted_copy(x, y, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y + i, tl.load(x + i + 1))


@pytest.mark.skipif(ON_GPU, reason="the interpreter's memory checks")
def test_bounds_check_catches_an_unmasked_load_past_the_end():
    x, y = torch.zeros(16), torch.zeros(16)
    with bounds_checked_interpreter(), pytest.raises(Exception, match="load outside every"):
        _shifted_copy[(1,)](x, y, N=16)
    with bounds_checked_interpreter():
        _shifted_copy[(1,)](x, y, N=8)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's memory checks")
@pytest.mark.parametrize("scheme", KERNEL_SCHEMES)
def test_attention_reads_and_writes_only_its_tensors(scheme):
    """Every page format the kernels read, through both row-tile paths (decode rows; more
    rows than requests) and split-K, with an empty request and a fully skipped one: no
    address outside the launch's tensors (what faulted on the H200 must show here)."""
    n_groups, q_rows, skip = [3, 0, 2, 1], [2, 1, 1, 1], [3, 0, 0, 16]
    with bounds_checked_interpreter():
        for Hq, splits in ((2, 2), (6, 1)):
            case = _attention_case(scheme, 16, 2, Hq, 32, n_groups, q_rows, skip, Hq,
                                   torch.float32)
            _check_attention(*case, scale=0.125, splits=splits)
        case = _attention_case(scheme, 16, 2, 4, 32, [2, 1], [1, 1], [0, 0], 5, torch.float32)
        _check_attention(*case, scale=0.125, splits=None)


def _launched_tensors(monkeypatch, call):
    """Run ``call`` with every kernel launch recorded instead of run: [(kernel, tensors)]."""
    from vllm_lowbit_kv.ops.triton import _jit

    launches = []
    monkeypatch.setattr(_jit, "launch_hook", lambda kernel, grid, args, kwargs: launches.append(
        (kernel, [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)])))
    call()
    assert launches
    return launches


@pytest.mark.parametrize("scheme", ["vidkv", "kivi2"])
@pytest.mark.parametrize("splits", [1, 2])
def test_attention_moves_cpu_plans_to_the_query_device(monkeypatch, scheme, splits):
    """paged.forward keeps its plans (q_start, group table, group counts, skips) on the
    CPU: the launcher must hand the kernel copies on the query's device (on the H200 a
    CPU group table failed the launch). The query and pages live on ``meta`` here, a
    device other than the plans', so nothing runs and every pointer's device shows."""
    layout, pages, table, ng, q_start, query, skip = _attention_case(
        scheme, 16, 2, 4, 32, [3, 0, 2], [2, 1, 1], [3, 0, 0], 7, torch.float32)
    meta = torch.device("meta")
    launches = _launched_tensors(monkeypatch, lambda: triton_ops.attention(
        query.to(meta), q_start, pages.to(meta), layout, table, ng, skip, 0.125,
        num_splits=splits))
    for kernel, tensors in launches:
        assert [t.device for t in tensors] == [meta] * len(tensors), kernel


def test_store_moves_cpu_group_ids_to_the_kv_device(monkeypatch):
    """The store kernel likewise: CPU group ids and relevance go to the K/V device."""
    layout = _layout("vidkv_stp", 32, 2, 64)
    k, v = _kv(3, 32, 2, torch.float32, seed=2)
    meta = torch.device("meta")
    launches = _launched_tensors(monkeypatch, lambda: triton_ops.store(
        k.to(meta), v.to(meta), torch.tensor([4, 0, 2]),
        torch.zeros(layout.page_shape(3), dtype=torch.uint8, device=meta), layout,
        torch.rand(3, 32, 2), validate=False))
    for kernel, tensors in launches:
        assert [t.device for t in tensors] == [meta] * len(tensors), kernel


def test_attention_refuses_pages_on_another_device():
    layout, pages, table, ng, q_start, query, skip = _attention_case(
        "kivi2", 16, 2, 4, 32, [2], [1], [0], 7, torch.float32)
    with pytest.raises(ValueError, match="pages"):
        triton_ops.attention(query.to("meta"), q_start, pages, layout, table, ng, skip, 0.125)


def test_row_tiles_cover_every_row_once():
    q_start = torch.tensor([0, 3, 3, 10, 11])
    req, row0, bound = _row_tiles(q_start, 11, 4)
    live = req >= 0
    rows = []
    for r, s in zip(req[live].tolist(), row0[live].tolist()):
        end = min(s + 4, int(q_start[r + 1]))
        assert int(q_start[r]) <= s < end
        rows += list(range(s, end))
    assert sorted(rows) == list(range(11)) and bound >= int(live.sum())


@pytest.mark.skipif(ON_GPU, reason="the GPU tests above run the compiled kernels")
def test_kernels_compile_for_sm80_and_sm90():
    """The kernels lower to cubins for sm_80 and sm_90 (no GPU needed; catches what the
    interpreter cannot: layouts, dot shapes, register spills)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-m", "vllm_lowbit_kv.ops.triton.compile_check", "--arch", "80", "90",
                           "--scheme", "vidkv_stp", "kivi2"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2 * 2 * 3  # schemes x archs x (store, attention, combine)
    assert all(r["registers"] > 0 for r in rows)
    assert all(r["stack_bytes"] <= 256 for r in rows), rows  # at most light spilling
