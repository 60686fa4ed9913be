"""``GET /v1/kv_cache/stats`` and the ``lowbit_kv:*`` gauges, against the session's vidkv server.

The figures must agree with vLLM's own (``vllm:cache_config_info``,
``vllm:kv_cache_usage_perc``, ``vllm:num_requests_running``) and with the
backend's start-up account of its bits, follow a request while it runs, and
return to idle after it.
"""

from __future__ import annotations

import http.client
import json
import re
import time

import pytest

pytest.importorskip("vllm")

from vllm_lowbit_kv.schemes import get_scheme  # noqa: E402
from _servers import (LOWBIT, NUM_BLOCKS, STATS_ROUTE, get_json, long_prompt,  # noqa: E402
                      metric, metrics_text, model_name, wait_idle)

pytestmark = pytest.mark.slow
# SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; vLLM's CPU block size
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 128


def _cache_config_info(text: str) -> dict[str, str]:
    m = re.search(r"^vllm:cache_config_info\{([^}]*)\}", text, re.M)
    assert m, "vllm:cache_config_info missing"
    return dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))


def test_static_figures_match_vllm_and_the_backend(server):
    stats = get_json(server.port, STATS_ROUTE)
    info = _cache_config_info(metrics_text(server.port))
    assert stats["kv_cache_dtype"] == info["cache_dtype"] == "vidkv" and stats["lowbit"]
    assert stats["model"] == model_name(server.port)
    scheme = stats["scheme"]
    assert scheme["name"] == "vidkv" and scheme["skip_layers"] == LOWBIT["skip_layers"]
    assert scheme["sink_tokens"] == LOWBIT["sink_tokens"] and scheme["obs_window"] == 32
    assert scheme["set_fields"] == LOWBIT
    assert scheme["key_codec"].startswith("VidKVKeyCodec(") and "protect=0.2" in scheme["value_codec"]
    assert scheme["protect_first"] == "visual"
    # the implementation the backend logged choosing: the C++ kernel reads vidkv pages
    impls = sorted(set(re.findall(r"packed attention implementation: (\w+)", server.log.read_text())))
    assert stats["attention_impls"] == impls == ["cpp"]

    cap, blocks = stats["capacity"], stats["blocks"]
    assert cap["tokens"] == int(info["kv_cache_size_tokens"]) == NUM_BLOCKS * BLOCK
    assert blocks["total"] == int(info["num_gpu_blocks"]) == NUM_BLOCKS
    assert cap["kv_cache_memory_bytes"] == int(info["kv_cache_memory_bytes"])
    assert cap["block_size"] == int(info["block_size"]) and cap["num_layers"] == LAYERS

    # the backend's own start-up account of its bits
    log = server.log.read_text()
    m = re.search(r"Effective bits/element: groups ([\d.]+).*?pages ([\d.]+)[^,;]*, ([\d.]+) over all",
                  log)
    bits = stats["effective_bits"]
    assert (round(bits["groups"], 3), round(bits["pages"], 3), round(bits["overall"], 3)) == \
        tuple(float(x) for x in m.groups())
    # what the worker really allocated: 29 packed layers (those with retrieval heads hold
    # larger pages: one log line per page size) + 1 bf16 layer per block
    pages = [(int(b), int(n)) for b, n in re.findall(
        r"lowbit-kv pages: (\d+) bytes per block of \d+ tokens per layer \([^)]*\); (\d+) layers", log)]
    assert sum(n for _, n in pages) == 29 and len(pages) > 1, pages
    bf16_page = BLOCK * KV_HEADS * HEAD_DIM * 2 * 2
    assert cap["kv_cache_bytes"] == NUM_BLOCKS * (sum(b * n for b, n in pages) + bf16_page)
    assert bits["allocated"] == pytest.approx(bits["overall"], abs=1e-3)
    bf16_tokens = cap["kv_cache_bytes"] // (bf16_page * LAYERS) * BLOCK
    assert cap["bf16_equivalent_tokens"] == bf16_tokens
    assert cap["x_bf16"] == pytest.approx(cap["tokens"] / bf16_tokens, abs=1e-4)

    # --max-num-seqs 4, each with its residual window's groups and its partial group
    groups = get_scheme("vidkv").with_params(residual_tokens=LOWBIT["residual_tokens"]).staged_groups
    assert stats["staging"]["slots_total"] == 4 * groups * stats["staging"]["pools"]
    assert stats["eviction"] == {"enabled": False, "evicted_pairs": 0}
    assert stats["worker_error"] is None


def _gauges(text: str) -> dict[str, float]:
    out = {}
    for m in re.finditer(r"^lowbit_kv:(\w+)\{([^}]*)\} ([0-9.e+-]+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        assert labels["kv_cache_dtype"] == "vidkv"
        key = m.group(1) + (f"[{labels['part']}]" if "part" in labels else "")
        out[key] = float(m.group(3))
    return out


def _check_scrape(text: str) -> dict[str, float]:
    """One /metrics scrape: our gauges against vLLM's gauges of the same scrape."""
    g = _gauges(text)
    usage = metric(0, "kv_cache_usage_perc", text)
    assert g["blocks_total"] == NUM_BLOCKS
    assert g["blocks_used"] == round(usage * (NUM_BLOCKS - 1))
    assert g["blocks_used"] + g["blocks_free"] == NUM_BLOCKS - 1  # block 0: vLLM's null block
    return g


def test_gauges_equal_the_route(server):
    wait_idle(server)
    stats = get_json(server.port, STATS_ROUTE)
    g = _check_scrape(metrics_text(server.port))
    for part, v in stats["effective_bits"].items():
        assert g[f"effective_bits[{part}]"] == pytest.approx(v)
    assert g["capacity_tokens"] == stats["capacity"]["tokens"]
    assert g["capacity_bf16_equivalent_tokens"] == stats["capacity"]["bf16_equivalent_tokens"]
    assert g["kv_cache_bytes"] == stats["capacity"]["kv_cache_bytes"]
    assert g["staging_slots_total"] == stats["staging"]["slots_total"]
    assert g["evicted_pairs_total"] == 0
    assert stats["blocks"]["used"] == g["blocks_used"] == 0


def test_figures_follow_a_running_request_and_return_to_idle(server):
    """A streaming request holds blocks and a staging slot (its partial group) while it
    decodes; route and gauges show it, agreeing with vLLM; after it ends, all is idle."""
    port = server.port
    wait_idle(server)
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request("POST", "/v1/completions", json.dumps({
        "model": model_name(port), "prompt": long_prompt(3, chars=2000), "max_tokens": 200,
        "temperature": 0, "ignore_eos": True, "stream": True}), {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    seen = None
    try:
        deadline = time.time() + 240
        for line in r:  # keep reading so the request keeps running; sample as it goes
            if not line.startswith(b"data:"):
                continue
            stats = get_json(port, STATS_ROUTE)
            b, st = stats["blocks"], stats["staging"]
            if b["running_requests"] == 1 and b["used"] and st["slots_in_use"] >= 1:
                text = metrics_text(port)
                g = _check_scrape(text)
                if g["blocks_used"] > 0 and g["staging_slots_in_use"] >= 1 and \
                        metric(0, "num_requests_running", text) == 1:
                    seen = (stats, g)
                    break
            assert time.time() < deadline, stats
    finally:
        c.close()  # hang up: vLLM aborts the request
    assert seen is not None, "never saw the running request in the figures"
    stats, g = seen
    assert 4 <= stats["blocks"]["used"] <= NUM_BLOCKS - 1  # ~470 prompt tokens: 4 blocks of 128
    assert stats["blocks"]["free"] == NUM_BLOCKS - 1 - stats["blocks"]["used"]

    wait_idle(server)
    deadline = time.time() + 30  # the gauges' staging figure is refreshed in the background
    while True:
        g = _check_scrape(metrics_text(port))
        if g["blocks_used"] == 0 and g["staging_slots_in_use"] == 0:
            break
        assert time.time() < deadline, g
        time.sleep(0.5)
    stats = get_json(port, STATS_ROUTE)
    assert stats["blocks"]["used"] == 0 and stats["blocks"]["running_requests"] == 0
    assert stats["staging"]["slots_in_use"] == 0


def test_an_idle_server_costs_no_cpu(server):
    """The background refresh of the worker figures asks the workers only while the engine
    steps: after each message vLLM's worker busy-polls its queue for a second, so asking
    every 2 s kept an idle server's worker at 50-90% of a core (what made a CI machine with
    three servers up crawl)."""
    import psutil

    wait_idle(server)  # its own route calls ask the worker: let that second of polling pass
    time.sleep(3)
    workers = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
               if "Worker" in p.name() or "Worker" in " ".join(p.cmdline())]
    assert workers, [p.name() for p in psutil.Process(server.proc.pid).children(recursive=True)]
    before = sum(sum(p.cpu_times()[:2]) for p in workers)
    time.sleep(8)
    busy = sum(sum(p.cpu_times()[:2]) for p in workers) - before
    assert busy < 0.8, f"idle workers used {busy:.1f} CPU seconds in 8 s"
