"""Image requests through the real vLLM server to the test VLM (``python -m
vllm_lowbit_kv.model --vlm``: SmolLM2 behind an untrained, seeded vision tower, so
answers about images are meaningless; these tests check the path, not visual quality).

``vlm_server`` is this module's main packed-KV server: ``vidkv_stp`` with the shared
server's settings (tests/_servers.py: STP, sinks, residual window, layer 0 bf16,
256-token prefill chunks that split images). vLLM tells the backend where each
request's image tokens are (the runner hook, ``vllm.backend.visual_positions``); STP
protects visual tokens first, and ``/v1/kv_cache/stats`` counts them.
``vlm_visual_server`` runs the visual-only mode (``vidkv_visual``, its own defaults:
text tokens protected first, visual tokens low-bit) for the image requests and the
counts, on float32 weights (tests/_servers.py: FLOAT32_WEIGHTS; nothing compares it
with a bf16 server).
"""

from __future__ import annotations

import json

import pytest

from bench.multimodal import chat_body

from _servers import (COMMON, FLOAT32_WEIGHTS, LOWBIT, STATS_ROUTE, get_json, long_prompt, metric,
                      model_name, post, start_server, wait_idle)

pytestmark = pytest.mark.slow

T = 64  # the group of vidkv_stp and vidkv_visual
#: per server: STP's protected rows per group, which kind they go to first, sink rows
MODES = {"vidkv_stp": (round(LOWBIT["protect"] * T), "visual", LOWBIT["sink_tokens"]),
         "vidkv_visual": (16, "text", 4)}
QUESTION = "Describe the picture."


@pytest.fixture(scope="module")
def vlm():
    pytest.importorskip("vllm")
    from vllm_lowbit_kv.model import prepare_vlm

    return prepare_vlm(progress=False)


@pytest.fixture(scope="module")
def vlm_server(vlm, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vlm")
    cfg = tmp / "lowbit.json"
    cfg.write_text(json.dumps(LOWBIT))
    s = start_server(tmp, "vlm_stp", ["--kv-cache-dtype", "vidkv_stp", "--lowbit-config", str(cfg),
                                      *COMMON], model=vlm)
    try:
        yield s.wait_ready(timeout=300)
    finally:
        s.stop()


@pytest.fixture(scope="module")
def vlm_visual_server(vlm, tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("vlm_visual"), "vlm_visual",
                     ["--kv-cache-dtype", "vidkv_visual", *FLOAT32_WEIGHTS, *COMMON], model=vlm)
    try:
        yield s.wait_ready(timeout=300)
    finally:
        s.stop()


def mode_server(request, mode: str):
    """The module's server of ``mode`` (started on first use)."""
    return request.getfixturevalue({"vidkv_stp": "vlm_server",
                                    "vidkv_visual": "vlm_visual_server"}[mode])


def chat(port: int, seeds: list[int], text: str = QUESTION, stream: bool = False,
         max_tokens: int = 24) -> tuple[str, dict]:
    """Greedy answer of ``max_tokens`` tokens (:func:`bench.multimodal.chat_body`):
    (text, body or usage)."""
    body = chat_body(model_name(port), seeds, text, max_tokens)
    if not stream:
        out = post(port, "/v1/chat/completions", {**body, "return_token_ids": True})
        return out["choices"][0]["message"]["content"], out
    events = post(port, "/v1/chat/completions",
                  {**body, "stream": True, "stream_options": {"include_usage": True}}, stream=True)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    usage = [e["usage"] for e in events if e.get("usage")]
    return text, {"usage": usage[-1]}


def image_token_id(vlm) -> int:
    return json.loads((vlm / "config.json").read_text())["image_token_id"]


def visual_stats(port: int) -> dict:
    return get_json(port, STATS_ROUTE)["visual"]


#: text requests compared whole (choices with log-probs, usage): a long prompt's chunked
#: prefill and a chat
TEXT_REQUESTS = [
    ("/v1/completions", {"prompt": long_prompt(), "max_tokens": 32, "temperature": 0, "logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name three colors."}],
                              "max_tokens": 24, "temperature": 0, "logprobs": True, "top_logprobs": 2}),
]


def test_auto_dtype_answers_as_stock_vllm(vlm, tmp_path):
    """With vLLM's own KV (``--kv-cache-dtype auto``) our launcher and plugin change
    nothing: greedy image requests and text requests (with their log-probs) return what
    stock vLLM (``VLLM_PLUGINS=none``) returns, and our backend is not selected. (First
    in the module, and the two servers start side by side: before this module's packed
    server exists, so start-up does not share the two cores with more servers.)"""
    servers = {name: start_server(tmp_path, f"vlm_auto_{name}",
                                  ["--kv-cache-dtype", "auto", *FLOAT32_WEIGHTS, *COMMON],
                                  stock=stock, model=vlm)
               for name, stock in (("ours", False), ("stock", True))}
    try:
        answers, text = {}, {}
        for name, s in servers.items():
            s.wait_ready(timeout=300)
            answers[name] = [chat(s.port, [3])[0], chat(s.port, [4, 5], stream=True)[0]]
            text[name] = [post(s.port, path, {"model": model_name(s.port), **body})
                          for path, body in TEXT_REQUESTS]
    finally:
        for s in servers.values():
            s.stop()
    assert "using the LOWBIT_KV attention backend" not in servers["ours"].log.read_text()
    assert answers["ours"] == answers["stock"]
    assert all(a.strip() for a in answers["ours"])
    for (path, _), ours, stock in zip(TEXT_REQUESTS, text["ours"], text["stock"]):
        assert ours["choices"] == stock["choices"], path
        assert ours["usage"] == stock["usage"], path


@pytest.mark.parametrize("case,stream", [("one image", False), ("one image", True),
                                         ("eight frames", False), ("image and long text", False)])
@pytest.mark.parametrize("mode", list(MODES))
def test_image_requests_answer(request, mode, case, stream):
    """One image, eight images standing in for video frames, and an image before a long
    text (its prefill spans several 256-token chunks): answered with 64 image tokens per
    image in the prompt, by VidKV's STP and by the visual-only mode; streamed too (one
    image: the stream is the API server's format of the same engine output)."""
    vlm_server = mode_server(request, mode)
    seeds = {"one image": [1], "eight frames": list(range(10, 18)),
             "image and long text": [2]}[case]
    text = long_prompt(1, 1500) if case == "image and long text" else QUESTION
    seeds = [s + 100 * stream for s in seeds]  # no prefix shared between the two modes
    answer, out = chat(vlm_server.port, seeds, text, stream)
    assert answer.strip() and out["usage"]["completion_tokens"] == 24, out
    assert out["usage"]["prompt_tokens"] >= 64 * len(seeds) + 8
    if case == "image and long text":
        assert out["usage"]["prompt_tokens"] > 256  # several prefill chunks
    wait_idle(vlm_server)


@pytest.mark.parametrize("mode", list(MODES))
def test_stats_count_the_visual_tokens_stp_protects(request, mode, vlm):
    """The stats' visual figures grow by exactly what the request's image tokens make:
    every image token in a completed group is encoded; a group's protected rows go to
    its image tokens first (VidKV's STP: min(rows, image tokens)) or to its text tokens
    first (the visual-only mode: image tokens get only the rows text leaves over; sink
    rows are never protected)."""
    vlm_server = mode_server(request, mode)
    rows, first, sinks = MODES[mode]
    before = visual_stats(vlm_server.port)
    _, out = chat(vlm_server.port, [7, 8], "Compare the two pictures. " * 20, max_tokens=40)
    wait_idle(vlm_server)
    after = visual_stats(vlm_server.port)
    ids = out["prompt_token_ids"] + out["choices"][0]["token_ids"]
    written = len(ids) - 1  # the last sampled token is never fed back
    image = image_token_id(vlm)
    per_group = [sum(t == image for t in ids[g * T:(g + 1) * T]) for g in range(written // T)]
    assert sum(per_group) >= 2 * 64 - T  # the images lie in completed groups
    assert after["encoded_tokens"] - before["encoded_tokens"] == sum(per_group)
    if first == "visual":
        protected = [min(rows, n) for n in per_group]
    else:  # the text tokens of a group compete for the rows first (its sinks do not)
        text = [T - n - (sinks if g == 0 else 0) for g, n in enumerate(per_group)]
        protected = [min(n, max(0, rows - t)) for n, t in zip(per_group, text)]
        assert 0 < sum(protected) < sum(min(rows, n) for n in per_group)
    assert after["protected_tokens"] - before["protected_tokens"] == sum(protected)


def test_prefix_cache_hit_on_image_blocks(vlm_server):
    """An image prompt's full blocks are cached with the image's hash: the same image
    and text again reads them (packed bytes, written with the image's protection) and
    answers alike every time; another image before the same text hits nothing, as its
    first block holds the image. (The first, uncached answer may differ from the cached
    ones: it attended its own chunks' tokens exactly, a hit reads them packed.)"""
    port = vlm_server.port
    prompt = long_prompt(2, 800)
    chat(port, [42], prompt)
    hits = metric(port, "prefix_cache_hits_total")
    second, _ = chat(port, [42], prompt)
    assert metric(port, "prefix_cache_hits_total") - hits >= 256
    third, _ = chat(port, [42], prompt)
    assert third == second and second.strip()
    hits = metric(port, "prefix_cache_hits_total")
    chat(port, [43], prompt)
    assert metric(port, "prefix_cache_hits_total") == hits
    wait_idle(vlm_server)


def test_text_request_on_the_vlm_answers_as_the_text_model(vlm_server, server):
    """A text-only chat on the VLM is SmolLM2's: the same greedy answer as the shared
    text-model server, which runs the same packed KV configuration."""
    messages = [{"role": "user", "content": long_prompt(3, 600)}]

    def ask(port):
        body = {"model": model_name(port), "messages": messages, "temperature": 0, "max_tokens": 32}
        return post(port, "/v1/chat/completions", body)["choices"][0]["message"]["content"]

    assert ask(vlm_server.port) == ask(server.port)
    wait_idle(server)
    wait_idle(vlm_server)


def test_video_url_is_refused_with_the_reason(vlm_server):
    """Video needs a video processor (torchvision, which cannot run beside the CPU torch
    here): a ``video_url`` part gets an HTTP error saying so, never a made-up answer."""
    from bench.server import request

    body = {"model": model_name(vlm_server.port), "max_tokens": 8, "messages": [{
        "role": "user", "content": [
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
            {"type": "text", "text": QUESTION}]}]}
    status, data = request(vlm_server.port, "POST", "/v1/chat/completions", body)
    assert 400 <= status < 500, (status, data[:500])
    assert b"video" in data.lower(), data[:500]
    wait_idle(vlm_server)


def test_flashcache_eviction_serves_image_prompts(vlm, tmp_path):
    """FlashCache scores an image prompt's pairs as any other (frequency-domain outliers,
    no attention scores): a ~1.6K-token image-and-text prompt is answered and pairs are
    evicted."""
    import time

    s = start_server(tmp_path, "vlm_evicting",
                     ["--kv-cache-dtype", "vidkv", "--kv-eviction", "flashcache", "--kv-retention",
                      "0.2", "--block-size", "128", "--max-model-len", "2048", "--max-num-seqs", "4",
                      *FLOAT32_WEIGHTS],
                     model=vlm)
    try:
        s.wait_ready(timeout=300)
        answer, out = chat(s.port, [61], long_prompt(4, 6000))
        assert answer.strip() and out["usage"]["prompt_tokens"] > 1200, out["usage"]
        deadline = time.time() + 30
        while (evicted := get_json(s.port, STATS_ROUTE)["eviction"]["evicted_pairs"]) == 0 \
                and time.time() < deadline:
            time.sleep(1)
        assert evicted > 0
    finally:
        s.stop()
