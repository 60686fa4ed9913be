"""Scale-out through vLLM's own distributed engine on the CPU build (issue #17):
``--pipeline-parallel-size 2`` (SmolLM2's 30 layers split 15/15) and
``--tensor-parallel-size 3`` (3 KV heads, 9 query heads: one KV head per rank), with
the packed KV cache, give the same greedy output as one process, and the stats route
reports the whole engine (every rank's staging pools and KV bytes added up).

The one-process reference for ``vidkv`` is the session's shared server; the scaled
servers get exactly its flags (its lowbit_kv fields: sinks, window, ``protect``,
layer 0 in bf16; chunked prefill of 256 tokens; 10 blocks of 128 tokens), so a
long prompt's later chunks read packed pages written by other chunks. ``kivi2``
runs with tensor parallelism against a one-process kivi2 server of its own.

On this 2-core machine the ranks share the cores: the launcher sets
``VLLM_CPU_OMP_THREADS_BIND`` (vLLM's automatic binding wants a NUMA node per rank)
and, for pipeline parallelism, traces the model instead of ``--enforce-eager``
(serving/__main__.py says why).

KV eviction under tensor/pipeline parallelism is refused at start-up with the
reason (each rank would plan on its own heads and layers only): tested here.
"""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("vllm")

from _servers import (COMMON, LOWBIT, NUM_BLOCKS, STATS_ROUTE, get_json, long_prompt,  # noqa: E402
                      model_name, post, start_server)

pytestmark = pytest.mark.slow

GEN = 16
#: nats: a divergence from the one-process run is accepted only at a near-tie this close
NEAR_TIE = 0.3


def _prompts() -> list[str]:
    """A tag first, new for every call: no prompt shares a cached prefix block with an
    earlier request of the server (a prefix hit reads packed pages where a fresh prefill
    attends its own chunk exactly, so it changes the answer)."""
    tag = f"[run {time.time_ns() % 10**12}] "
    return [tag + long_prompt(0, chars=2400), tag + long_prompt(5, chars=600),
            tag + "The capital of France is"]


def _shared_args(tmp, dtype="vidkv", lowbit=None):
    cfg = tmp / f"lowbit_{dtype}.json"
    cfg.write_text(json.dumps(LOWBIT if lowbit is None else lowbit))
    return ["--kv-cache-dtype", dtype, "--lowbit-config", str(cfg),
            "--num-gpu-blocks-override", str(NUM_BLOCKS), *COMMON]


def _greedy(port, prompts) -> list[tuple[list[int], list[dict[str, float]]]]:
    """Greedy tokens of every prompt, each with the top-3 log-probs of every position."""
    out = []
    for p in prompts:
        r = post(port, "/v1/completions", {"model": model_name(port), "prompt": p, "max_tokens": GEN,
                                           "temperature": 0, "ignore_eos": True, "logprobs": 3,
                                           "return_token_ids": True})
        ch = r["choices"][0]
        out.append((ch["token_ids"], ch["logprobs"]["top_logprobs"]))
    return out


def _same_greedy(scaled, reference, prompts) -> list[int]:
    """Both runs give the same greedy tokens, except after a near-tie: at the first
    position where they differ, each run's token is within :data:`NEAR_TIE` nats of the
    other's in that run's own log-probs (vLLM's own bf16 cache under tensor parallelism
    diverges from one process the same way: its all-reduce sums in another order, and
    a near-tie flips). Returns the length of the common prefix of each prompt."""
    common = []
    for (tok_s, lp_s), (tok_r, lp_r), prompt in zip(scaled, reference, prompts):
        n = next((i for i, (a, b) in enumerate(zip(tok_s, tok_r)) if a != b), len(tok_r))
        common.append(n)
        if n == len(tok_r):
            continue
        top_s, top_r = lp_s[n], lp_r[n]
        chosen_s, chosen_r = max(top_s, key=top_s.get), max(top_r, key=top_r.get)
        for top, other in ((top_s, chosen_r), (top_r, chosen_s)):  # the other run's token:
            near = other in top and top[other] >= max(top.values()) - NEAR_TIE  # a near-tie here
            assert near, (f"diverged at token {n} of {prompt[-40:]!r} without a near-tie",
                          top_s, top_r)
    return common


def _scaled(tmp, name, args, parallel):
    if "-pp" in parallel or "--pipeline-parallel-size" in parallel:
        args = [a for a in args if a != "--enforce-eager"]  # the launcher's tracing instead
    return start_server(tmp, name, [*args, *parallel])


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("scale_out")


@pytest.mark.parametrize("parallel,ranks", [(["--pipeline-parallel-size", "2"], 2),
                                            (["--tensor-parallel-size", "3"], 3)],
                         ids=["pp2", "tp3"])
def test_vidkv_scaled_out_equals_one_process(server, tmp, parallel, ranks):
    prompts = _prompts()
    reference = _greedy(server.port, prompts)
    s = _scaled(tmp, f"vidkv_{ranks}", _shared_args(tmp), parallel).wait_ready(timeout=500)
    try:
        log = s.log.read_text()
        assert "using the LOWBIT_KV attention backend" in log
        common = _same_greedy(_greedy(s.port, prompts), reference, prompts)
        print(f"{parallel}: greedy tokens equal to one process before a near-tie: {common}")
        stats = get_json(s.port, STATS_ROUTE)
        one = get_json(server.port, STATS_ROUTE)
        assert stats["workers"] == ranks and one["workers"] == 1
        assert stats["scheme"] == one["scheme"]
        assert stats["staging"]["pools"] == ranks * one["staging"]["pools"]
        assert stats["staging"]["slots_total"] == ranks * one["staging"]["slots_total"]
        assert stats["staging"]["slots_in_use"] == 0
        # every rank holds its share of the layers (pp) or heads (tp) of the same blocks: the
        # KV bytes of all ranks together are one process's, up to per-rank padding
        assert stats["capacity"]["kv_cache_bytes"] == pytest.approx(one["capacity"]["kv_cache_bytes"],
                                                                    rel=0.02)
        assert stats["effective_bits"] == pytest.approx(one["effective_bits"], abs=2e-3)
    finally:
        s.stop()


def test_kivi2_tensor_parallel_equals_one_process(tmp):
    lowbit = {"sink_tokens": 4, "residual_tokens": 128}
    prompts = _prompts()
    one = start_server(tmp, "kivi2_1", _shared_args(tmp, "kivi2", lowbit))
    try:
        reference = _greedy(one.wait_ready(timeout=500).port, prompts)
    finally:
        one.stop()
    s = _scaled(tmp, "kivi2_tp3", _shared_args(tmp, "kivi2", lowbit),
                ["--tensor-parallel-size", "3"]).wait_ready(timeout=500)
    try:
        _same_greedy(_greedy(s.port, prompts), reference, prompts)
        assert get_json(s.port, STATS_ROUTE)["workers"] == 3
    finally:
        s.stop()


@pytest.mark.parametrize("parallel", [["--pipeline-parallel-size", "2"], ["--tensor-parallel-size", "3"]],
                         ids=["pp2", "tp3"])
def test_eviction_with_parallelism_is_refused_with_the_reason(tmp, parallel):
    args = [a for a in COMMON if a != "--enforce-eager"] if "--pipeline-parallel-size" in parallel \
        else COMMON
    s = start_server(tmp, f"evict_{parallel[0][2:4]}", ["--kv-cache-dtype", "vidkv", "--kv-eviction",
                                                       "flashcache", "--kv-retention", "0.2",
                                                       *args, *parallel])
    try:
        assert s.proc.wait(300) != 0
    finally:
        s.stop()
    assert "eviction with tensor/pipeline parallelism" in s.log.read_text()


def test_launcher_refuses_enforce_eager_with_pipeline_parallelism():
    from serving.__main__ import defaults

    with pytest.raises(SystemExit, match="--enforce-eager with --pipeline-parallel-size"):
        defaults(["--model", "m", "--enforce-eager", "-pp", "2"], environ={}, cpu=True)
    add, env = defaults(["--model", "m", "-pp", "2"], environ={}, cpu=True)
    assert "--enforce-eager" not in add and "--compilation-config" in add
    assert env["VLLM_CPU_OMP_THREADS_BIND"].count("|") == 1
    add, env = defaults(["--model", "m", "--tensor_parallel_size=3"], environ={}, cpu=True)
    assert "--enforce-eager" in add and env["VLLM_CPU_OMP_THREADS_BIND"].count("|") == 2
    # the user's own binding stands
    assert "VLLM_CPU_OMP_THREADS_BIND" not in defaults(
        ["--model", "m", "-tp", "3"], environ={"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, cpu=True)[1]
