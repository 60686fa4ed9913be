"""bench/kernels.py's GPU mode without a GPU: its arguments, its plan and dry run, the order
of its cells, the issue's targets, the rerun after a sticky CUDA error, and the int4 layout
of xformers' decoder (bench/xformers_decode.py) that its baselines are built in. What needs
the GPU runs in bench/gpu.sh."""

from __future__ import annotations

import json

import pytest
import torch

from bench import kernels
from bench import xformers_decode as xfd

CUDA = torch.cuda.is_available()


def test_gpu_dry_run_checks_the_arguments_and_measures_nothing(tmp_path, capsys):
    out = tmp_path / "k.json"
    assert kernels.main(["--device", "cuda", "--dry-run", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "cells (context x batch), in order: 32768x32, 4096x1" in text, text
    assert "schemes vidkv,vidkv_stp,kivi2,kivi4; implementations cuda,triton" in text, text
    assert "baselines bf16_sdpa,xformers_bf16,xformers_int4_g1,xformers_int4_g2" in text, text
    assert f"writes {out} and {out.with_suffix('.png')}" in text, text
    if not CUDA:
        assert "no CUDA device: skipped" in text, text
    if xfd.unavailable():
        assert "will skip xformers_bf16" in text, text
    assert not out.exists()


@pytest.mark.parametrize("argv,message", [
    (["--device", "cuda", "--baselines", "xformers_int4_g3"], "--baselines"),
    (["--device", "cpu", "--baselines", "xformers_bf16"], "--baselines"),
    (["--device", "cuda", "--impls", "nope"], "--impls"),
    (["--device", "cuda", "--schemes", "vidkv,nope"], "--schemes"),
    (["--device", "cuda", "--q-heads", "8", "--kv-heads", "3"], "--q-heads"),
    (["--device", "tpu"], "--device"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        kernels.parse_args(argv + ["--dry-run"])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_defaults_per_device(tmp_path):
    gpu = kernels.parse_args(["--device", "cuda"])
    assert gpu.impls == ["cuda", "triton"] and gpu.time_budget == 150
    assert gpu.out.name == "kernels_gpu.json" and gpu.png.name == "kernels_gpu.png"
    cpu = kernels.parse_args(["--device", "cpu", "--no-vllm", "--json", str(tmp_path / "c.json")])
    assert cpu.baselines == ["bf16_sdpa"] and cpu.time_budget == 0
    assert cpu.png == tmp_path / "c.png"


def test_the_gpu_target_is_measured_first():
    grid = kernels.cells(torch.device("cuda"), quick=False)
    assert grid[0] == kernels.TARGET and len(grid) == len(set(grid)) == 20
    assert {c for c, _ in grid} == {4096, 8192, 16384, 32768, 65536}
    assert {b for _, b in grid} == {1, 8, 32, 64}


def test_targets_compare_with_bf16_and_the_fastest_int4_decode():
    ctx, batch = kernels.TARGET
    result = dict(device_type="cuda", rows=[
        dict(scheme="vidkv", impl="cuda", context=ctx, batch=batch, time_ms=0.05),
        dict(scheme="vidkv", impl="triton", context=ctx, batch=batch, time_ms=0.1),
        dict(scheme="vidkv", impl="cuda", context=4096, batch=1, time_ms=0.01)],
        baselines=[dict(kind="bf16_sdpa", context=ctx, batch=batch, time_ms=0.3),
                   dict(kind="xformers_int4_g1", context=ctx, batch=batch, time_ms=0.1),
                   dict(kind="xformers_int4_g2", context=ctx, batch=batch, time_ms=0.12)])
    t = kernels.targets(result)
    assert t["xformers_int4_fastest"] == "xformers_int4_g1"
    cuda, triton = t["results"]["vidkv/cuda"], t["results"]["vidkv/triton"]
    assert cuda["speedup_vs_bf16_sdpa"] == 6.0 and cuda["speedup_vs_xformers_int4"] == 2.0
    assert cuda["meets"] == {"bf16_sdpa": True, "xformers_int4": True}
    assert triton["meets"] == {"bf16_sdpa": False, "xformers_int4": False}
    result["baselines"] = result["baselines"][:1]  # no xformers: that bar is unknown
    assert kernels.targets(result)["results"]["vidkv/cuda"]["meets"]["xformers_int4"] is None
    assert kernels.targets(dict(result, device_type="cpu")) is None


def test_a_rerun_after_a_sticky_error_leaves_out_the_culprit(tmp_path):
    prev = tmp_path / "prev.json"
    aborted = [dict(what="cuda", error="CUDA error: an illegal memory access was encountered")]
    prev.write_text(json.dumps(dict(aborted=aborted)))
    args = kernels.parse_args(["--device", "cuda", "--after-abort", str(prev)])
    assert args.impls == ["triton"] and args.aborted == aborted
    assert kernels._is_sticky(RuntimeError(aborted[0]["error"]))
    assert not kernels._is_sticky(torch.OutOfMemoryError("CUDA out of memory"))


def test_int4_rows_are_laid_out_as_xformers_reads_them():
    # one row of 16 values: codes 0..15 with scale 1, shift -3 (group 0) / codes 15..0 (1)
    x = torch.cat([torch.arange(16.0) - 3, torch.arange(15.0, -1, -1) - 3]).reshape(1, 32)
    q = xfd.quantize_int4(x.repeat(1, 2), 2)  # D 64, 2 groups of 32
    assert q.dtype == torch.int32 and q.shape == (1, 2 + 64 // 8)
    b = q.view(torch.uint8)[0]
    coeffs = b[:8].view(torch.float16)  # (scale, shift) per group, in the first int32 each
    assert coeffs.tolist() == [1.0, -3.0, 1.0, -3.0]
    codes = b[8:]
    assert codes[0].item() == 0x10 and codes[1].item() == 0x32  # element 2i: low nibble
    assert torch.equal(xfd.dequantize_int4(q, 2), x.repeat(1, 2))


@pytest.mark.parametrize("groups", xfd.INT4_GROUPS)
def test_int4_round_trip_within_half_a_step(groups):
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(groups))
    q = xfd.quantize_int4(x, groups)
    assert q.shape == (3, 5, groups + 8)
    g = x.reshape(3, 5, groups, -1)
    half_step = ((g.amax(-1) - g.amin(-1)) / 30).repeat_interleave(64 // groups, -1)
    err = (xfd.dequantize_int4(q, groups) - x).abs()
    assert (err <= half_step * 1.01 + 1e-3).all()


def test_baseline_names():
    assert xfd.kinds() == ["xformers_bf16", "xformers_int4_g1", "xformers_int4_g2"]
    assert xfd.int4_groups("xformers_int4_g8") == 8 and xfd.int4_groups("bf16_sdpa") is None
    with pytest.raises(ValueError):
        xfd.int4_groups("xformers_int4_g3")


@pytest.mark.skipif(CUDA, reason="on a GPU the benchmark's own check runs it (bench/gpu.sh)")
@pytest.mark.parametrize("groups", [1, 2])
def test_int4_decoder_called_directly_matches_dequantized_attention(groups, monkeypatch):
    """xformers' Split-K decoder through FwOp.apply (no dispatcher, so no check that the
    wheel's C++/CUDA extension loaded) in Triton's interpreter, fp16 queries: float32
    attention over the dequantized K/V, to fp16 output rounding. Needs xformers and a
    Triton with block pointers (3.6; removed in 3.7+)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # before xformers defines its kernels
    if xfd.unavailable():
        pytest.skip(xfd.unavailable())
    run = xfd.build(f"xformers_int4_g{groups}", context=80, batch=2, kv_heads=2, q_heads=6,
                    head_dim=64, device=torch.device("cpu"), seed=groups)
    try:
        err = run.check()
    except Exception as e:  # noqa: BLE001
        if "Block pointers have been removed" in str(e):
            pytest.skip(f"this Triton has no block pointers, which xformers' decoder uses: {e}")
        raise
    assert run.info["call"] == xfd.DIRECT_CALL
    assert err < 4e-3, err


def test_rotation_rounds_time_both_reads_of_the_same_pages():
    """A rotating variant's cost: the same pages read with and without the rotation in turn,
    ROTATION_ROUNDS times, through the C++ kernel."""
    from vllm_lowbit_kv.ops import IMPLEMENTATIONS

    args = kernels.parse_args(["--device", "cpu", "--no-vllm", "--min-time", "0.01"])
    for name, value in dict(q_heads=9, kv_heads=3, head_dim=64, block_size=128).items():
        assert getattr(args, name) == value
    case = kernels.Case("kivi2@hadamard", 256, 2, args, torch.device("cpu"))
    assert case.layout.rotation is not None
    calls = []

    def attention(*a, **kw):
        calls.append(kw.get("rotation") is not None)
        return IMPLEMENTATIONS["cpp"].attention(*a, **kw)
    plain, cost = kernels.rotation_rounds(case, attention, 1.0, torch.device("cpu"), args)
    # the first rotated time is given as 1 s: the median leaves that round out
    assert 0 < plain < 0.1 and abs(cost) < 0.1
    assert True in calls and False in calls
    assert calls.count(False) >= kernels.ROTATION_ROUNDS


def test_cold_cpu_calls_take_copies_of_their_operands_in_turn():
    """On the CPU each timed call reads the next of identical copies of its pages, copies
    adding up to at least 64 MiB (4x the last-level cache), so that no call finds its
    operands in the cache; --warm-cache and the GPU (flushed instead) keep one."""
    cold = kernels.parse_args(["--device", "cpu", "--no-vllm"])
    warm = kernels.parse_args(["--device", "cpu", "--no-vllm", "--warm-cache"])
    cpu = torch.device("cpu")
    assert kernels.operand_copies(1 << 20, warm, cpu) == 1
    assert kernels.operand_copies(1 << 20, cold, torch.device("cuda")) == 1
    enough = max(64 << 20, 4 * kernels.last_level_cache_bytes())  # 1.2 GB on a 300 MiB L3
    assert kernels.operand_copies(enough, cold, cpu) == 1
    n = kernels.operand_copies(1 << 20, cold, cpu)
    assert n * (1 << 20) >= max(64 << 20, 4 * kernels.last_level_cache_bytes())
    case = kernels.Case("vidkv", 1024, 2, cold, cpu)
    seen = []

    def attention(query, q_start, pages, *rest, **kw):
        seen.append(pages)
        return None
    for _ in range(kernels.operand_copies(case.bytes, cold, cpu) + 1):
        case.run(attention, rotate=False)
    ptrs = [p.data_ptr() for p in seen]
    assert len(set(ptrs)) == len(ptrs) - 1 and ptrs[-1] == ptrs[0]  # all taken, then again
    assert all(torch.equal(p, seen[0]) for p in seen)
    assert len(seen) * case.bytes > 64 << 20
