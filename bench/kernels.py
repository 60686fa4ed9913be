"""Decode attention over packed pages: time and bytes/s per implementation, against bf16.

    python -m bench.kernels                      # this device's grid, every available impl
    python -m bench.kernels --device cuda        # the GPU grid (what bench/gpu.sh runs)
    python -m bench.kernels --device cuda --dry-run   # check the arguments, print the plan
    python -m bench.kernels --quick              # a small grid (smoke test)

One decode step of one layer: ``batch`` requests, one query row each, ``context``
packed tokens each (SmolLM2-135M's attention by default: 9 query heads, 3 KV
heads, head_dim 64; 128-token blocks of 64-token groups, pages scattered over
the cache as vLLM's allocator leaves them). Measured per scheme and per
implementation the device has (:mod:`vllm_lowbit_kv.ops`: ``torch``, the
PyTorch fallback, and ``cpp`` on the CPU; ``cuda`` and ``triton`` on a GPU),
against baselines of the same shape:

* ``bf16_sdpa``: ``scaled_dot_product_attention`` over contiguous bf16 K/V (on a GPU
  the FlashAttention backend when it takes the shape; the backend is recorded);
* ``vllm_bf16`` (CPU): vLLM's own paged CPU kernel
  (``torch.ops._C.cpu_attention_with_kv_cache``) when vLLM is importable;
* ``xformers_bf16``, ``xformers_int4_g<N>`` (GPU, :mod:`bench.xformers_decode`):
  xformers' ``memory_efficient_attention`` over bf16 K/V and its Triton Split-K
  decoder over int4 K/V with ``N`` scale groups per row (called through ``FwOp.apply``,
  as the dispatcher refuses it when the wheel's C++/CUDA extension does not load), when
  xformers is installed (the ``[cuda]`` extra); a baseline that cannot run (xformers
  absent; the bf16 one without the extension) is recorded in ``skipped_baselines`` as
  "unavailable: <reason>", not as an error (SDPA's FlashAttention stays the bf16 bar);
* the bandwidth floor: the bytes the implementation must read (the packed
  states of every group; K and V for the baselines) over the device's
  copy bandwidth, measured here (``dst.copy_(src)`` of a large buffer, bytes
  read + written over time).

Each row records time, bytes read, achieved GB/s, the floor and the fraction
of the floor reached, and speedups over each baseline (and the PyTorch fallback
when measured) in the same run. A scheme given as ``SCHEME@hadamard`` is its rotating
variant (:mod:`vllm_lowbit_kv.rotation`): its time is the step as the backend runs it,
query rotated and output un-rotated (by the kernel, or around it), and its rows add the
same pages read without the rotation (``unrotated_ms``), the difference
(``rotation_ms``: the median over ``ROTATION_ROUNDS`` rounds of the two timed in turn, as
a difference of two timings is only as steady as they are; it may come out below 0
within their spread) and its share of the unrotated time (``rotation_frac_of_kernel``).

On a GPU, times are CUDA-event medians of single calls, each after 1 GiB zeroed (the
L2 cache flushed; the host's launch overhead hidden, as CUDA graphs hide it in vLLM's
decode; ``wall_ms`` has it). On the CPU, the best of 5 batches of calls back to back
that take identical copies of their operands in turn, the copies adding up to 4x the
last-level cache (:func:`operand_copies`): a layer's decode step finds its KV out of the
cache (the other layers' KV and weights are read in between) and its code warm; one
layer's 6-25 MB of bf16 K/V called again and again would stay in a 32 MB L3 and read
faster than memory. ``--warm-cache`` keeps one copy (operands cache-resident). First,
every implementation and baseline is checked on one small shape (largest
absolute error against the PyTorch reference, or float32 attention over the
same K/V), and the cell of the GPU target (32K context, batch 32) is measured
first. A failure in one
measurement is recorded (``errors``) and the run goes on; a CUDA error that
poisons the process (illegal address) stops it with exit status 3, naming the
culprit in ``aborted``, and ``--after-abort`` reruns without it. JSON (with the
command and the device) and a PNG go to
``bench/results/kernels_{cpu,gpu}.{json,png}`` (``--json``/``--png`` elsewhere);
the JSON is rewritten after every cell, so a run cut short keeps what it measured.

``--threads`` sets the CPU threads: on a machine shared with other jobs use 1,
since every parallel region of a multi-threaded kernel waits for its slowest
thread (the JSON records the threads and the load average).

Imports only torch, the codecs and the ops (no vLLM needed): runs on a GPU box
with torch and triton alone (xformers optional).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import RESULTS, machine, portable
from bench import xformers_decode as xfd
from bench.plotting import pyplot, save
from vllm_lowbit_kv.ops import (AUTO_ORDER, IMPLEMENTATIONS, implementation,
                                packed_attention_reference, unsupported_reason)
from vllm_lowbit_kv.paged import PagedLayout
from vllm_lowbit_kv.paged.forward import packed_part
from vllm_lowbit_kv.schemes import get_scheme

#: (contexts, batches, most tokens per cell) per device type; the CPU grid is what a
#: 2-core machine measures in minutes, the GPU grid issue #14's (4K-64K, batch 1-64)
GRIDS = {
    "cpu": ([1024, 4096, 8192, 16384, 65536], [1, 4, 16], 1 << 17),
    "cuda": ([4096, 8192, 16384, 32768, 65536], [1, 8, 32, 64], 1 << 22),
}
QUICK = ([1024, 8192], [1, 4], 1 << 15)
#: the GPU target cell (context, batch): measured first; its speedups are the `targets`
TARGET = (32768, 32)
#: issue #14's bars at the target: x bf16 SDPA, x xformers' int4 decode (the fastest measured)
TARGET_SPEEDUPS = {"bf16_sdpa": 4.0, "xformers_int4": 1.5}
#: defaults per device type: schemes, implementations, baselines
DEFAULTS = {
    "cpu": dict(schemes="vidkv,vidkv_stp,kivi2", impls=",".join(AUTO_ORDER),
                baselines="bf16_sdpa,vllm_bf16"),
    "cuda": dict(schemes="vidkv,vidkv_stp,kivi2,kivi4", impls="cuda,triton",
                 baselines=",".join(["bf16_sdpa", *xfd.kinds((1, 2))])),
}
BASELINES = {"cpu": ("bf16_sdpa", "vllm_bf16"), "cuda": ("bf16_sdpa",)}
#: results file name per device type
OUTPUT = {"cpu": "kernels_cpu", "cuda": "kernels_gpu"}
POOL_GROUPS = 256  # distinct encoded groups the pages are filled from
#: the correctness check's shape (context, batch)
CHECK_SHAPE = (2048, 4)
#: an error after which the CUDA context is unusable: the process must stop
STICKY = ("illegal memory access", "device-side assert", "unspecified launch failure",
          "misaligned address", "illegal instruction", "an illegal", "CUDA error: unknown")


class Aborted(Exception):
    """A sticky CUDA error in ``what`` (an implementation or a baseline)."""

    def __init__(self, what: str, error: str):
        super().__init__(f"{what}: {error}")
        self.what, self.error = what, error


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return machine.cpu_name()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timeit(fn, device: torch.device, min_time: float, max_reps: int = 200) -> float:
    """Seconds per call: the best of up to 5 batches of calls lasting about min_time / 5
    each (the best, as ``timeit`` advises: on a shared machine the others measure the
    neighbours)."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    once = max(time.perf_counter() - t0, 1e-6)
    reps = max(1, min(max_reps, int(min_time / 5 / once)))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(device)
        times.append((time.perf_counter() - t0) / reps)
        if once * reps * len(times) > 4 * min_time:  # slow implementation: enough samples
            break
    return min(times)


_flush: dict[torch.device, torch.Tensor] = {}
#: bytes zeroed before each timed GPU call: more than the L2 cache (so every call reads its
#: operands from memory, as one layer's decode step does), and long enough on the GPU (about
#: 0.3 ms) that the host's launch overhead of the call that follows is hidden behind it, as
#: CUDA graphs hide it in vLLM's decode
FLUSH_BYTES = 1 << 30


def cuda_time(fn, device: torch.device, reps: int, wall: dict | None = None) -> float:
    """Seconds per call on a GPU: the median of ``reps`` single calls timed with CUDA
    events, each after :data:`FLUSH_BYTES` zeroed. With ``wall``, also ``wall['s']``: host
    wall-clock seconds per call of ``reps`` calls back to back (launch overhead included,
    L2 warm)."""
    if device not in _flush:
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 << 20
        _flush[device] = torch.empty(max(FLUSH_BYTES, 2 * l2), dtype=torch.uint8, device=device)
    flush = _flush[device]
    for _ in range(3):  # the first call compiles (Triton) and allocates
        fn()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    reps = max(3, min(reps, int(2.0 / max(time.perf_counter() - t0, 1e-6))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    if wall is not None:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize(device)
        wall["s"] = (time.perf_counter() - t0) / reps
    return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3


def last_level_cache_bytes() -> int:
    """The largest CPU cache of cpu0 (Linux sysfs), or 0 when unknown."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=0)


def operand_copies(nbytes: int, args, device: torch.device) -> int:
    """Identical copies of a call's operands for the calls to take in turn on the CPU: enough
    that the copies add up to 4x the last-level cache (64 MiB at least), so that each call
    finds its operands out of the cache while the code path stays warm, as a layer's decode
    step does (every layer runs the same code; its KV was last read a step ago, the other
    layers' KV and weights in between). One with ``--warm-cache`` and on a GPU (flushed)."""
    if device.type != "cpu" or args.warm_cache:
        return 1
    return max(1, -(-max(64 << 20, 4 * last_level_cache_bytes()) // max(nbytes, 1)))


def in_turn(first, copies: int, clone=torch.clone):
    """``first`` and ``copies - 1`` clones of it, taken in turn for ever."""
    return itertools.cycle([first] + [clone(first) for _ in range(copies - 1)])


def measure_time(fn, device: torch.device, args, wall: dict | None = None) -> float:
    if device.type == "cuda":
        return cuda_time(fn, device, args.reps, wall)
    return timeit(fn, device, args.min_time)


#: rounds of a rotating variant timed with and without its rotation in turn
ROTATION_ROUNDS = 3


def rotation_rounds(case, fn, rotated: float, device: torch.device, args
                    ) -> tuple[float, float]:
    """(the unrotated time, the rotation's cost): the same pages read with and without the
    rotation in turn for ``ROTATION_ROUNDS`` rounds (the first rotated time is
    ``rotated``, already measured); the cost is the median of the rounds' differences."""
    plain, costs = [], []
    for i in range(ROTATION_ROUNDS):
        t_rot = rotated if i == 0 else measure_time(lambda: case.run(fn), device, args)
        plain.append(measure_time(lambda: case.run(fn, rotate=False), device, args))
        costs.append(t_rot - plain[-1])
    return min(plain), statistics.median(costs)


def copy_bandwidth(device: torch.device, nbytes: int, args=None) -> float:
    """Bytes per second of ``dst.copy_(src)`` counting the read and the write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    if device.type == "cuda":
        t = cuda_time(lambda: dst.copy_(src), device, 10)
    else:
        t = timeit(lambda: dst.copy_(src), device, min_time=1.0)
    return 2 * nbytes / t


def layout_of(scheme: str, args) -> PagedLayout:
    """The pages of ``SCHEME`` or ``SCHEME@ROTATION`` (a rotating variant: K and V rotated
    before encoding, the query and output around the kernel, as the backend does); an
    ``rvq*`` scheme codes with the embedded SmolLM2's default codebooks (its first layer's;
    calibrated on first use), which fit only SmolLM2's shape."""
    name, _, rotate = scheme.partition("@")
    s = get_scheme(name).with_params(rotate=rotate) if rotate else get_scheme(name)
    if s.key.accepts("codebook"):
        from vllm_lowbit_kv.calibrate import default_codebook
        from vllm_lowbit_kv.model import prepare_model

        s = s.with_params(codebook=str(default_codebook(prepare_model(), name, progress=False)))
    kc, vc = s.codecs(args.head_dim, layer=0)
    return PagedLayout(kc, vc, args.kv_heads, args.block_size,
                       rotation=s.rotation(args.head_dim, 0))


class Case:
    """Pages of one scheme for ``batch`` requests of ``context`` packed tokens each (built
    on ``device``)."""

    def __init__(self, scheme: str, context: int, batch: int, args, device: torch.device,
                 seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.layout = L = layout_of(scheme, args)
        self.groups = -(-context // L.T)
        total = batch * self.groups
        num_blocks = -(-total // L.groups_per_block) + 1
        pool = L.encode(torch.randn(POOL_GROUPS, L.T, L.H, L.D, generator=g) * 2,
                        torch.randn(POOL_GROUPS, L.T, L.H, L.D, generator=g),
                        torch.rand(POOL_GROUPS, L.T, L.H, generator=g))
        self.pages = torch.zeros(L.page_shape(num_blocks), dtype=torch.uint8, device=device)
        gids = torch.randperm(num_blocks * L.groups_per_block, generator=g)[:total]
        pick = torch.randint(0, POOL_GROUPS, (total,), generator=g)
        L.write_states(self.pages, gids.to(device), pool.to(device)[pick.to(device)])
        self.table = gids.reshape(batch, self.groups).to(device)
        self.num_groups = torch.full((batch,), self.groups, device=device)
        self.skip = torch.zeros(batch, dtype=torch.long, device=device)
        self.q_start = torch.arange(batch + 1, device=device)
        self.query = torch.randn(batch, args.q_heads, L.D, generator=g).to(device, torch.bfloat16)
        self.bytes = total * L.H * L.state_bytes  # every group's K and V states
        self._pages = in_turn(self.pages, operand_copies(self.bytes, args, device))

    def run(self, fn, rotate: bool = True):
        """One decode step's packed part through ``fn``, as the backend calls it
        (:func:`~vllm_lowbit_kv.paged.forward.packed_part`: the layout's rotation
        included), over the next copy of the pages; ``rotate=False``: the same pages read
        without it (what it costs)."""
        pages = next(self._pages)
        rest = (self.table, self.num_groups, self.skip, self.layout.D ** -0.5)
        if rotate:
            return packed_part(fn, self.layout, self.query, self.q_start, pages, *rest)
        return fn(self.query, self.q_start, pages, self.layout, *rest)


def _sdpa_backend(device: torch.device):
    """The context manager that pins SDPA to FlashAttention on a GPU, or None."""
    if device.type != "cuda":
        return None
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    return lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def bf16_sdpa(context: int, batch: int, args, device: torch.device, info: dict | None = None,
              check: bool = False):
    """(callable, bytes): SDPA over contiguous bf16 K/V of the same shape. On a GPU the query
    heads of each KV head are folded into the query length (``[B, kv_heads, q_heads /
    kv_heads, D]``: one decode row per query head attends all keys, so no mask and no GQA
    flag), the form FlashAttention always takes, and SDPA is pinned to FlashAttention
    (SDPA's own choice if it refuses); on the CPU ``enable_gqa``. ``info['backend']`` says
    which ran; with ``check``, ``info['max_abs_err']`` its error against float32 attention."""
    H, g, D = args.kv_heads, args.q_heads // args.kv_heads, args.head_dim
    k = torch.randn(batch, H, context, D, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    if device.type == "cuda":
        q = torch.randn(batch, H, g, D, device=device, dtype=torch.bfloat16)

        def run():
            return F.scaled_dot_product_attention(q, k, v)
        kf, vf = k, v
    else:
        q = torch.randn(batch, args.q_heads, 1, D, device=device, dtype=torch.bfloat16)
        turns = in_turn((k, v), operand_copies(2 * k.numel() * 2, args, device),
                        lambda kv: tuple(t.clone() for t in kv))

        def run():
            return F.scaled_dot_product_attention(q, *next(turns), enable_gqa=True)
        kf, vf = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    pinned = _sdpa_backend(device)
    fn, backend = run, "default"
    if pinned is not None:
        def flash():
            with pinned():
                return run()
        try:
            flash()
            fn, backend = flash, "flash (query heads folded into the query length)"
        except RuntimeError as e:  # FlashAttention refuses the shape: SDPA's own choice
            backend = f"default (flash refused: {str(e).splitlines()[0][:160]})"
    if info is not None:
        info["backend"] = backend
    if check and info is not None:
        ref = F.scaled_dot_product_attention(q.float(), kf.float(), vf.float())
        info["max_abs_err"] = (fn().float() - ref).abs().max().item()
    return fn, 2 * k.numel() * 2


def vllm_cpu_attention(context: int, batch: int, args):
    """(callable, bytes) of vLLM's own paged CPU attention over bf16 pages, or None; its
    scheduler metadata as vLLM's CPU backend builds it (the context split between threads
    unless ``VLLM_CPU_ATTN_SPLIT_KV=0``)."""
    try:
        from vllm import _custom_ops as ops
        from vllm import envs
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except Exception:  # vLLM (CPU build) absent
        return None
    H, Hq, D, bs = args.kv_heads, args.q_heads, args.head_dim, args.block_size
    isa = _get_attn_isa(torch.bfloat16, bs, D, "auto")
    blocks = batch * -(-context // bs)
    kv = torch.randn(blocks, H, 2 * bs, D, dtype=torch.bfloat16)
    # (key, value) views of one tensor per copy, as vLLM's cache lays them out
    turns = in_turn(kv.chunk(2, dim=2), operand_copies(kv.numel() * 2, args, torch.device("cpu")),
                    lambda _: kv.clone().chunk(2, dim=2))
    q = torch.randn(batch, Hq, D, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    seq = torch.full((batch,), context, dtype=torch.int32)
    table = torch.randperm(blocks, dtype=torch.int32).reshape(batch, -1)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=batch, num_heads=Hq, num_kv_heads=H, head_dim=D, seq_lens=seq,
        dtype=torch.bfloat16, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV)  # as vLLM's backend calls it

    def run():
        key_cache, value_cache = next(turns)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=qsl, seq_lens=seq, scale=D ** -0.5, causal=True, alibi_slopes=None,
            sliding_window=-1, block_table=table, softcap=0, scheduler_metadata=meta, s_aux=None)
    return run, batch * context * H * D * 2 * 2


def baseline(kind: str, context: int, batch: int, args, device: torch.device,
             info: dict | None = None, check: bool = False):
    """(callable, bytes) of baseline ``kind``, or None when it does not exist here (vLLM
    absent); fills ``info`` (backend or operator; with ``check`` the largest absolute error
    against float32 attention, ``max_abs_err``) when given."""
    if kind == "bf16_sdpa":
        return bf16_sdpa(context, batch, args, device, info, check)
    if kind == "vllm_bf16":
        return vllm_cpu_attention(context, batch, args)
    run = xfd.build(kind, context, batch, args.kv_heads, args.q_heads, args.head_dim, device)
    if info is not None:
        info.update(run.info)
        if check:
            info["max_abs_err"] = run.check()
    return run.run, run.bytes


def cells(device: torch.device, quick: bool):
    contexts, batches, budget = QUICK if quick else GRIDS[device.type]
    grid = [(c, b) for c in contexts for b in batches if c * b <= budget]
    if device.type == "cuda" and TARGET in grid:  # the target first: a cut run still has it
        grid.remove(TARGET)
        grid.insert(0, TARGET)
    return grid


def cell_bytes(context: int, batch: int, args, baselines: list[str]) -> int:
    """Device memory a cell needs at most (one baseline or case at a time, plus the float32
    temporaries of the int4 quantization)."""
    bf16 = xfd.bf16_bytes(context, batch, args.kv_heads, args.head_dim)
    return bf16 * (4 if any(xfd.int4_groups(b) for b in baselines) else 1) + (256 << 20)


def _error_text(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) < 600 else text[:600] + " ..."


def _is_sticky(e: BaseException) -> bool:
    return any(s in str(e) for s in STICKY)


def _guard(device, what, fn, errors, **where):
    """``fn()``, or None with the error recorded; a sticky CUDA error raises :class:`Aborted`."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001: one shape or kernel failing must not stop the run
        if device.type == "cuda" and _is_sticky(e):
            raise Aborted(what, _error_text(e)) from e
        errors.append(dict(what=what, **where, error=_error_text(e)))
        print(f"  error: {what} {where}: {_error_text(e)}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None


def check_correctness(args, device: torch.device, result: dict) -> None:
    """Every implementation and baseline on :data:`CHECK_SHAPE` (the speed rows come with
    evidence that the kernels are right): largest absolute error of out and lse against the
    PyTorch reference (baselines: float32 attention over the K/V they read, in their own
    precision, so a looser bar: 2e-2). Recorded in ``result['correctness']``."""
    context, batch = CHECK_SHAPE
    rows, errors = result["correctness"], result["errors"]
    for scheme in args.schemes:
        case = _guard(device, "case", lambda: Case(scheme, context, batch, args, device, seed=1),
                      errors, stage="check", scheme=scheme)
        if case is None:
            continue
        ref = _guard(device, "torch", lambda: case.run(packed_attention_reference), errors,
                     stage="check", scheme=scheme)
        if ref is None:
            continue
        ref_out, ref_lse = ref
        for impl in args.impls:
            reason = unsupported_reason(impl, case.layout, device, args.q_heads // args.kv_heads)
            if reason:
                continue
            got = _guard(device, impl, lambda: case.run(implementation(impl)), errors,
                         stage="check", scheme=scheme)
            if got is None:
                continue
            out, lse = got
            finite = torch.isfinite(ref_lse)
            err_out = (out.float() - ref_out).abs().max().item()
            err_lse = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
            row = dict(scheme=scheme, impl=impl, context=context, batch=batch,
                       max_abs_err_out=err_out, max_abs_err_lse=err_lse,
                       ok=bool(err_out <= args.tolerance and err_lse <= args.tolerance))
            rows.append(row)
            print(f"check {scheme:10s} {impl:6s}: out err {err_out:.2e}, lse err {err_lse:.2e}"
                  f"{'' if row['ok'] else '  ABOVE TOLERANCE'}", flush=True)
        del case
    for kind in args.baselines:
        info: dict = {}
        got = _guard(device, kind,
                     lambda: baseline(kind, context, batch, args, device, info, check=True),
                     errors, stage="check")
        if got is None or "max_abs_err" not in info:
            continue
        # bf16 / int4 inputs: the error is the kernel's arithmetic in its own precision
        rows.append(dict(baseline=kind, context=context, batch=batch,
                         max_abs_err_out=info["max_abs_err"],
                         ok=bool(info["max_abs_err"] <= 2e-2), **{k: v for k, v in info.items()
                                                                  if k != "max_abs_err"}))
        print(f"check {kind:16s}: out err {info['max_abs_err']:.2e} ({info})", flush=True)


def measure_cell(context: int, batch: int, args, device: torch.device, bandwidth: float,
                 result: dict) -> None:
    rows, baselines, errors = result["rows"], result["baselines"], result["errors"]
    base = {}
    for kind in args.baselines:
        info: dict = {}

        def timed(kind=kind, info=info):
            got = baseline(kind, context, batch, args, device, info)
            if got is None:
                return None
            wall = {}
            t = measure_time(got[0], device, args, wall)
            if wall:
                info["wall_ms"] = wall["s"] * 1e3
            return t, got[1]
        got = _guard(device, kind, timed, errors, context=context, batch=batch)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if got is None:
            continue
        t, nbytes = got
        base[kind] = (t, nbytes)
        baselines.append(dict(kind=kind, context=context, batch=batch, time_ms=t * 1e3,
                              bytes=nbytes, GBps=nbytes / t / 1e9,
                              floor_ms=nbytes / bandwidth * 1e3,
                              floor_frac=nbytes / bandwidth / t, **info))
        print(f"{kind:18s} ctx {context:6d} batch {batch:3d}: {t * 1e3:9.3f} ms "
              f"{nbytes / t / 1e9:7.1f} GB/s", flush=True)
    for scheme in args.schemes:
        case = _guard(device, "case", lambda: Case(scheme, context, batch, args, device), errors,
                      scheme=scheme, context=context, batch=batch)
        if case is None:
            continue
        times, walls, unrotated = {}, {}, {}
        for impl in args.impls:
            if unsupported_reason(impl, case.layout, device, args.q_heads // args.kv_heads) is None:
                fn = implementation(impl)
                walls[impl] = {}
                t = _guard(device, impl,
                           lambda: measure_time(lambda: case.run(fn), device, args, walls[impl]),
                           errors, scheme=scheme, context=context, batch=batch)
                if t is not None:
                    times[impl] = t
                if t is not None and case.layout.rotation is not None:
                    rounds = _guard(device, impl,
                                    lambda: rotation_rounds(case, fn, t, device, args),
                                    errors, scheme=scheme, context=context, batch=batch,
                                    rotate=False)
                    if rounds is not None:
                        unrotated[impl] = rounds
        for impl, t in times.items():
            t_plain, rotation = unrotated.get(impl, (None, None))
            row = dict(scheme=scheme, impl=impl, context=context, batch=batch,
                       time_ms=t * 1e3, bytes=case.bytes, GBps=case.bytes / t / 1e9,
                       floor_ms=case.bytes / bandwidth * 1e3,
                       floor_frac=case.bytes / bandwidth / t)
            if rotation is not None:  # the bar: < 5% of the kernel
                row.update(unrotated_ms=t_plain * 1e3, rotation_ms=rotation * 1e3,
                           rotation_frac_of_kernel=rotation / t_plain)
            if walls[impl]:
                row["wall_ms"] = walls[impl]["s"] * 1e3
            for kind, (tb, _) in base.items():
                row[f"speedup_vs_{kind}"] = tb / t
            if "torch" in times:
                row["speedup_vs_torch"] = times["torch"] / t
            rows.append(row)
            print(f"{scheme:10s} {impl:6s} ctx {context:6d} batch {batch:3d}: "
                  f"{t * 1e3:9.3f} ms {case.bytes / t / 1e9:7.2f} GB/s "
                  f"floor {100 * row['floor_frac']:5.1f}%  "
                  + " ".join(f"x{row[k]:.2f} {k[11:]}" for k in row if k.startswith("speedup"))
                  + (f"  rotation {100 * row['rotation_frac_of_kernel']:.1f}% of the kernel"
                     if rotation is not None else ""),
                  flush=True)
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()


def versions() -> dict:
    out = dict(torch=torch.__version__, cuda=torch.version.cuda, xformers=xfd.version())
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception:  # triton absent (CPU machine without it)
        out["triton"] = None
    return out


def unsupported(args, device: torch.device) -> list[dict]:
    """(scheme, impl, reason) of every pair that will not be measured (format limits are
    checked without a GPU; on a GPU also the build)."""
    out = []
    for scheme in args.schemes:
        layout = layout_of(scheme, args)
        for impl in args.impls:
            reason = unsupported_reason(impl, layout, device, args.q_heads // args.kv_heads)
            if reason:
                out.append(dict(scheme=scheme, impl=impl, reason=reason))
    return out


def new_result(args, device: torch.device, argv: list[str]) -> dict:
    props = {}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        props = dict(capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                     memory_GiB=round(p.total_memory / 2 ** 30, 1),
                     L2_MiB=round(getattr(p, "L2_cache_size", 0) / 2 ** 20, 1))
    else:
        props = dict(isa=machine.isa())
    return dict(
        command=portable.command([sys.executable, "-m", "bench.kernels", *argv]),
        device=device_name(device), device_type=device.type, device_properties=props,
        threads=torch.get_num_threads(), **versions(),
        timing=("time_ms: CUDA events, median of single calls, each after 1 GiB zeroed (L2 "
                "flushed, host launch overhead hidden as under CUDA graphs); wall_ms: host "
                "wall-clock per call back to back (launch overhead included, L2 warm)"
                if device.type == "cuda" else
                "perf_counter, best of 5 batches of calls back to back (operands "
                "cache-resident, --warm-cache)" if args.warm_cache else
                "perf_counter, best of 5 batches of calls back to back, taking copies of "
                "their operands in turn that add up to 4x the last-level cache (operands "
                "read from memory, code warm, as in a decode step of one layer among many)"),
        shape=dict(q_heads=args.q_heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                   block_size=args.block_size, query_rows_per_request=1,
                   note="SmolLM2-135M's attention (9 query heads, 3 KV heads, head_dim 64)"
                   if (args.q_heads, args.kv_heads, args.head_dim) == (9, 3, 64) else ""),
        schemes=args.schemes, impls=args.impls, baseline_kinds=args.baselines,
        not_measured=[], correctness=[], rows=[], baselines=[], errors=[], skipped_cells=[],
        aborted=list(args.aborted), skipped_baselines=getattr(args, "skipped_baselines", None))


def measure(args, argv: list[str] | None = None, write=None) -> dict:
    """The whole run: the result dict (``write(result)`` after every cell when given)."""
    device = torch.device(args.device)
    argv = sys.argv[1:] if argv is None else argv
    load_before = os.getloadavg()[0]  # the machine may be shared: say how busy it was
    result = new_result(args, device, argv)
    result["not_measured"] = unsupported(args, device)
    for skip in result["not_measured"]:
        print(f"not measured: {skip['scheme']} {skip['impl']}: {skip['reason']}", flush=True)
    bandwidth = copy_bandwidth(device, args.copy_mib << 20)
    result["copy_bandwidth_GBps"] = bandwidth / 1e9
    print(f"{device_name(device)}: copy bandwidth {bandwidth / 1e9:.1f} GB/s, "
          f"{torch.get_num_threads()} threads", flush=True)
    t_start = time.time()
    try:
        check_correctness(args, device, result)
        for context, batch in cells(device, args.quick):
            if args.time_budget and time.time() - t_start > args.time_budget:
                result["skipped_cells"].append(dict(context=context, batch=batch,
                                                    reason=f"time budget {args.time_budget} s"))
                continue
            if device.type == "cuda":
                free = torch.cuda.mem_get_info(device)[0]
                need = cell_bytes(context, batch, args, args.baselines)
                if need > free:
                    result["skipped_cells"].append(dict(
                        context=context, batch=batch,
                        reason=f"needs about {need / 2**30:.1f} GiB, {free / 2**30:.1f} free"))
                    continue
            measure_cell(context, batch, args, device, bandwidth, result)
            result["summary"], result["targets"] = summarize(result["rows"]), targets(result)
            if write:
                write(result)
    except Aborted as e:
        result["aborted"].append(dict(what=e.what, error=e.error))
        print(f"ABORTED: sticky CUDA error in {e.what}: {e.error}", flush=True)
    except KeyboardInterrupt:  # bench/gpu.sh's time limit (SIGINT): keep what was measured
        result["interrupted"] = f"SIGINT after {time.time() - t_start:.0f} s"
        print(f"INTERRUPTED: {result['interrupted']}", flush=True)
    for s in result["skipped_cells"]:
        print(f"skipped ctx {s['context']} batch {s['batch']}: {s['reason']}", flush=True)
    result["load_avg_1min"] = dict(start=load_before, end=os.getloadavg()[0])
    result["elapsed_s"] = round(time.time() - t_start, 1)
    result["summary"], result["targets"] = summarize(result["rows"]), targets(result)
    return result


def summarize(rows: list[dict]) -> dict:
    """Per scheme and implementation at 8K context (the CPU target) and 32K / batch 32 (the
    GPU target): speedups over the fallback and the baselines, fraction of the floor."""
    out = {}
    for r in rows:
        if (r["context"], r["batch"]) in ((8192, b) for b in (1, 4, 16)) or \
                (r["context"], r["batch"]) == TARGET:
            key = f"{r['scheme']}/{r['impl']}/ctx{r['context']}/batch{r['batch']}"
            out[key] = {k: round(v, 3) for k, v in r.items()
                        if k.startswith("speedup") or k == "floor_frac"}
    return out


def targets(result: dict) -> dict | None:
    """Issue #14's bars at :data:`TARGET` per scheme and implementation: x bf16 SDPA and x
    the fastest xformers int4 decode measured (None where a baseline is missing)."""
    if result["device_type"] != "cuda":
        return None
    at = [r for r in result["rows"] if (r["context"], r["batch"]) == TARGET]
    base = {b["kind"]: b["time_ms"] for b in result["baselines"]
            if (b["context"], b["batch"]) == TARGET}
    int4 = {k: t for k, t in base.items() if xfd.int4_groups(k)}
    fastest = min(int4, key=int4.get) if int4 else None
    out = {}
    for r in at:
        vs = dict(bf16_sdpa=base["bf16_sdpa"] / r["time_ms"] if "bf16_sdpa" in base else None,
                  xformers_int4=int4[fastest] / r["time_ms"] if fastest else None)
        out[f"{r['scheme']}/{r['impl']}"] = dict(
            time_ms=round(r["time_ms"], 4),
            **{f"speedup_vs_{k}": None if v is None else round(v, 2) for k, v in vs.items()},
            meets={k: None if v is None else bool(v >= TARGET_SPEEDUPS[k]) for k, v in vs.items()})
    return dict(context=TARGET[0], batch=TARGET[1], bars=TARGET_SPEEDUPS,
                xformers_int4_fastest=fastest, results=out)


BASELINE_STYLE = "--"


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    batches = sorted({r["batch"] for r in result["rows"] + result["baselines"]})
    if not batches:
        return
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4.2), squeeze=False)
    for ax, b in zip(axes[0], batches):
        series = {}
        for r in result["rows"]:
            if r["batch"] == b:
                series.setdefault(f"{r['scheme']} {r['impl']}", []).append(
                    (r["context"], r["time_ms"]))
        kinds = set()
        for r in result["baselines"]:
            if r["batch"] == b:
                kinds.add(r["kind"])
                series.setdefault(r["kind"], []).append((r["context"], r["time_ms"]))
        floor = sorted({(r["context"], r["floor_ms"]) for r in result["rows"]
                        if r["batch"] == b and r["scheme"] == "vidkv"})
        for name, pts in sorted(series.items()):
            pts.sort()
            ax.plot(*zip(*pts), BASELINE_STYLE if name in kinds else "-", marker="o", ms=3,
                    label=name)
        if floor:
            ax.plot(*zip(*floor), ":", color="k", label="vidkv bandwidth floor")
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="ms per step",
               title=f"batch {b}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    where = (result["device"] if result["device_type"] == "cuda"
             else f"{result['device']}, {result['threads']} threads")
    fig.suptitle(f"decode attention, one layer ({result['shape']['q_heads']} q / "
                 f"{result['shape']['kv_heads']} kv heads, d={result['shape']['head_dim']}): "
                 f"{where}", fontsize=9)
    save(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kernels",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=["cpu", "cuda"])
    p.add_argument("--schemes", help="comma-separated SCHEME or SCHEME@hadamard (rotating "
                   f"variant) (default: cpu {DEFAULTS['cpu']['schemes']}; cuda "
                   f"{DEFAULTS['cuda']['schemes']})")
    p.add_argument("--impls", help="implementations to measure where available (default: cpu "
                   f"{DEFAULTS['cpu']['impls']}; cuda {DEFAULTS['cuda']['impls']})")
    p.add_argument("--baselines", help="baselines of the same shape (default: cpu "
                   f"{DEFAULTS['cpu']['baselines']}; cuda {DEFAULTS['cuda']['baselines']}; "
                   "xformers_int4_g<N>, N in 1, 2, 4, 8: scale groups per row)")
    p.add_argument("--quick", action="store_true", help="a small grid")
    p.add_argument("--min-time", type=float, default=1.0,
                   help="seconds of calls per measurement (CPU)")
    p.add_argument("--reps", type=int, default=25, help="timed calls per measurement at most")
    p.add_argument("--warm-cache", action="store_true",
                   help="CPU: calls back to back over one copy of their operands, which "
                        "then stay in the cache (this benchmark's timing before 62edec0)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds of measuring after which the remaining cells are skipped "
                        "(recorded; default: 150 on cuda, none on cpu)")
    p.add_argument("--tolerance", type=float, default=1e-3,
                   help="largest absolute error of out and lse in the correctness check")
    p.add_argument("--copy-mib", type=int, default=512, help="buffer of the bandwidth probe")
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--no-vllm", action="store_true", help="skip vLLM's own CPU kernel")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (torch.set_num_threads; default: torch's)")
    p.add_argument("--json", "--out", dest="out", type=Path,
                   help="JSON path (default bench/results/kernels_{cpu,gpu}.json)")
    p.add_argument("--png", type=Path, help="PNG path (default: the JSON's, .png)")
    p.add_argument("--after-abort", type=Path, metavar="JSON",
                   help="a result that stopped on a sticky CUDA error: measure without what "
                        "caused it (its `aborted` entries are carried over)")
    p.add_argument("--dry-run", action="store_true",
                   help="check the arguments and print the plan; measure nothing")
    args = p.parse_args(argv)
    dev = args.device
    defaults = DEFAULTS[dev]
    args.schemes = (args.schemes or defaults["schemes"]).split(",")
    args.impls = (args.impls or defaults["impls"]).split(",")
    args.baselines = (args.baselines or defaults["baselines"]).split(",")
    if args.no_vllm and "vllm_bf16" in args.baselines:
        args.baselines.remove("vllm_bf16")
    if args.time_budget is None:
        args.time_budget = 150.0 if dev == "cuda" else 0.0
    bad = [i for i in args.impls if i not in IMPLEMENTATIONS]
    if bad:
        p.error(f"--impls: unknown {bad}; choose from {sorted(IMPLEMENTATIONS)}")
    for s in args.schemes:
        try:
            layout_of(s, args)
        except Exception as e:  # unknown scheme, a head size it cannot take
            p.error(f"--schemes: {s}: {e}")
    allowed = set(BASELINES[dev]) | (set(xfd.kinds(xfd.INT4_GROUPS)) if dev == "cuda" else set())
    for b in args.baselines:
        if b not in allowed:
            p.error(f"--baselines: {b} is not one of {sorted(allowed)} on {dev}")
    if args.q_heads % args.kv_heads:
        p.error(f"--q-heads {args.q_heads} is not a multiple of --kv-heads {args.kv_heads}")
    if args.reps < 3 or args.min_time <= 0:
        p.error("--reps must be >= 3 and --min-time > 0")
    args.aborted = []
    if args.after_abort:
        try:
            args.aborted = json.loads(args.after_abort.read_text()).get("aborted", [])
        except (OSError, ValueError) as e:
            p.error(f"--after-abort {args.after_abort}: {e}")
        dead = {a["what"] for a in args.aborted}
        args.impls = [i for i in args.impls if i not in dead]
        args.baselines = [b for b in args.baselines if b not in dead]
        if "case" in dead:
            p.error(f"--after-abort: building the pages failed ({args.aborted}): nothing to rerun")
    args.out = args.out or RESULTS / f"{OUTPUT[dev]}.json"
    args.png = args.png or args.out.with_suffix(".png")
    return args


def plan(args) -> list[str]:
    """What a run would do, line by line (the dry run prints it)."""
    device = torch.device(args.device)
    grid = cells(device, args.quick)
    lines = [f"device {args.device}; cells (context x batch), in order: "
             + ", ".join(f"{c}x{b}" for c, b in grid),
             f"schemes {','.join(args.schemes)}; implementations {','.join(args.impls)}; "
             f"baselines {','.join(args.baselines)}",
             f"shape: {args.q_heads} query heads, {args.kv_heads} KV heads, head_dim "
             f"{args.head_dim}, {args.block_size}-token blocks, one query row per request"]
    if args.device == "cuda":
        lines.append(f"correctness first at context {CHECK_SHAPE[0]} x batch {CHECK_SHAPE[1]} "
                     f"(tolerance {args.tolerance}); {args.reps} timed calls per measurement; "
                     f"time budget {args.time_budget:.0f} s")
        # format limits are known without a GPU: a (scheme, impl) the kernels cannot read
        for scheme in args.schemes:
            layout = layout_of(scheme, args)
            for impl in args.impls:
                reason = IMPLEMENTATIONS[impl].supports(layout.format, "cuda",
                                                        args.q_heads // args.kv_heads)
                if reason and "no CUDA device" not in reason and "unavailable" not in reason:
                    lines.append(f"will skip {scheme} {impl}: {reason}")
        xf = [b for b in args.baselines if b.startswith("xformers")]
        if xf:
            reason = (None if importlib.util.find_spec("xformers") else
                      "xformers is not installed (pip install xformers==0.0.35: the [cuda] extra)")
            if reason:
                lines.append(f"will skip {','.join(xf)}: {reason}")
    lines.append(f"writes {args.out} and {args.png}")
    return lines


def write_result(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.dry_run:
        for line in plan(args):
            print(f"bench.kernels --dry-run: {line}")
        if args.device == "cuda" and not torch.cuda.is_available():
            print("bench.kernels --dry-run: no CUDA device: skipped (arguments checked, nothing "
                  "measured)")
        else:
            print("bench.kernels --dry-run: arguments checked, nothing measured")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench.kernels: no CUDA device: nothing measured (--dry-run checks the arguments)",
              file=sys.stderr)
        return 2
    if args.device == "cuda" and any(b.startswith("xformers") for b in args.baselines):
        # a baseline that cannot run here is recorded as unavailable, with the reason (not
        # an error): skipped_baselines, one {kinds, reason} per reason
        args.skipped_baselines = []
        reason = xfd.unavailable()
        if reason is None and xfd.BF16 in args.baselines:
            why = xfd.bf16_unavailable(torch.device("cuda"), args.head_dim)
            if why:
                args.skipped_baselines.append(dict(kinds=[xfd.BF16], reason=f"unavailable: {why}"))
        elif reason:
            args.skipped_baselines.append(dict(
                kinds=[b for b in args.baselines if b.startswith("xformers")],
                reason=f"unavailable: {reason}"))
        for skip in args.skipped_baselines:
            print(f"bench.kernels: skipping {','.join(skip['kinds'])}: {skip['reason']}",
                  flush=True)
            args.baselines = [b for b in args.baselines if b not in skip["kinds"]]
    result = measure(args, argv, write=lambda r: write_result(r, args.out))
    write_result(result, args.out)
    try:
        plot(result, args.png)
        print(f"wrote {args.out} and {args.png}")
    except Exception as e:  # noqa: BLE001: the JSON is the record; a plot failure is reported
        print(f"wrote {args.out}; the plot failed: {_error_text(e)}", flush=True)
    print(json.dumps(result["summary"], indent=1))
    if result.get("targets"):
        print(json.dumps(result["targets"], indent=1))
    if result["aborted"] and result["aborted"][-1] not in args.aborted:
        return 3
    wrong = [c for c in result["correctness"] if not c["ok"]]
    for c in wrong:
        print(f"bench.kernels: above tolerance in the correctness check: {c}", file=sys.stderr)
    return 1 if result["errors"] or wrong or result.get("interrupted") else 0


if __name__ == "__main__":
    sys.exit(main())
