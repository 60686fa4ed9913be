"""A prefix-cache hit on a block written in the same step, through the real server.

vLLM commits blocks to its prefix cache when they are scheduled to be filled,
so a request scheduled later in the same step can hit a block an earlier one is
still writing (docs/vllm_integration.md, "Same-step prefix-cache hits"). Three
identical ~400-token prompts at once, new to the server's cache, with 256-token
prefill chunks: the second and third hit the block the first fills in its second
chunk. Before paged.forward_layer encoded completed groups ahead of attention,
this stopped the engine ("corrupt block"); tests/test_paged.py checks the same at
the page level, byte for byte.
"""

from __future__ import annotations

import http.client
import json
import threading

import pytest

pytest.importorskip("vllm")

from _servers import long_prompt, model_name, post  # noqa: E402


def test_identical_prompts_at_once_on_a_cold_prefix_cache(server):
    port = server.port
    model = model_name(port)
    ids = post(port, "/tokenize", {"model": model, "prompt": long_prompt(41)})["tokens"][:400]
    status = [None] * 3

    def run(i):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        c.request("POST", "/v1/completions", json.dumps(
            {"model": model, "prompt": ids, "max_tokens": 60, "ignore_eos": True}),
            {"Content-Type": "application/json"})
        status[i] = c.getresponse().status

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert status == [200, 200, 200]
    assert server.alive and "corrupt block" not in server.log.read_text()
