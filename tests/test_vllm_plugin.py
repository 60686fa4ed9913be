"""The vLLM plugin and backend: registration in-process, then real servers.

The lowbit server tests share the session's one vidkv server (fixture
``server``, tests/_servers.py: STP, sinks, a bf16 layer, chunked prefill, prefix
caching, only 10 KV blocks so that concurrent requests get preempted). That
``--kv-cache-dtype auto`` through our launcher answers exactly as stock vLLM does,
text and image requests, is tests/test_vllm_multimodal.py's first test (on the VLM,
whose text path is this model's).
"""

from __future__ import annotations

import http.client
import json
import re

import pytest

vllm = pytest.importorskip("vllm")

from _servers import LOWBIT, fluent, long_prompt, metric, model_name, post, wait_idle  # noqa: E402
from vllm_lowbit_kv.schemes import SCHEMES, get_scheme  # noqa: E402
from vllm_lowbit_kv.vllm import BACKEND_PATH  # noqa: E402
from vllm_lowbit_kv.vllm.plugin import register  # noqa: E402

# SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64
CPU_BLOCK = 128


@pytest.fixture(scope="module")
def plugin():
    register()
    return True


def test_argparse_accepts_schemes_and_lists_names(plugin, capsys):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    for name in SCHEMES:
        assert parser.parse_args(["--model", "m", "--kv-cache-dtype", name]).kv_cache_dtype == name
    assert parser.parse_args(["--model", "m", "--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--kv-cache-dtype", "kivi3"])
    err = capsys.readouterr().err
    assert "invalid choice: 'kivi3'" in err
    for name in [*SCHEMES, "auto", "bfloat16", "fp8"]:
        assert f"'{name}'" in err


def test_config_validation_accepts_schemes(plugin):
    from vllm.config import CacheConfig, VllmConfig

    for name in SCHEMES:
        assert VllmConfig(cache_config=CacheConfig(cache_dtype=name)).cache_config.cache_dtype == name
    with pytest.raises(Exception, match="cache_dtype"):
        CacheConfig(cache_dtype="kivi3")


def _selector(**kw):
    import torch
    from vllm.v1.attention.selector import AttentionSelectorConfig

    base = dict(head_size=HEAD_DIM, dtype=torch.bfloat16, kv_cache_dtype="kivi2", block_size=None)
    base.update(kw)
    return AttentionSelectorConfig(**base)


def test_backend_selection_and_refusals(plugin):
    from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
    from vllm.platforms.cpu import CpuPlatform

    # stock dtypes keep the stock backend
    for dt in ("auto", "bfloat16", "fp8"):
        path = CpuPlatform.get_attn_backend_cls(None, _selector(kv_cache_dtype=dt))
        assert path.endswith("cpu_attn.CPUAttentionBackend")
    cfg = VllmConfig(cache_config=CacheConfig(cache_dtype="kivi2", block_size=128))
    with set_current_vllm_config(cfg):
        path = CpuPlatform.get_attn_backend_cls(None, _selector())
        assert path == BACKEND_PATH == "vllm_lowbit_kv.vllm.backend.LowBitKVBackend"
        # vLLM's validate_configuration reads the backend's supports_* classmethods;
        # supports_combination adds the scheme's own limits
        for kw, reason in [({"use_mla": True}, "MLA"),
                           ({"has_sliding_window": True}, "sliding window"),
                           ({"attn_type": "encoder_decoder"}, "encoder"),
                           ({"has_sink": True}, "attention sinks"),
                           ({"use_kv_connector": True}, "KV connector"),
                           ({"use_non_causal": True}, "non-causal"),
                           ({"head_size": 2048}, "head_dim 2048")]:
            with pytest.raises(ValueError, match=reason):
                CpuPlatform.get_attn_backend_cls(None, _selector(**kw))


def test_spec_page_size_is_packed(plugin):
    import torch
    from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm_lowbit_kv.vllm.backend import LowBitKVBackend

    with set_current_vllm_config(VllmConfig(cache_config=CacheConfig(cache_dtype="kivi2"))):
        spec = FullAttentionSpec(block_size=CPU_BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM,
                                 dtype=torch.uint8)
        packed = LowBitKVBackend.customize_spec(spec)
    bf16 = FullAttentionSpec(block_size=CPU_BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM,
                             dtype=torch.bfloat16)
    eff = get_scheme("kivi2").effective_bits(HEAD_DIM)
    assert bf16.page_size_bytes / packed.page_size_bytes == pytest.approx(16 / eff)
    assert packed.tokens_per_state == 64
    # with sinks a state is a whole block per head: the sink area, then the groups
    cfg = VllmConfig(cache_config=CacheConfig(cache_dtype="vidkv_stp"),
                     additional_config={"lowbit_kv": {"sink_tokens": 4}})
    with set_current_vllm_config(cfg):
        spec = FullAttentionSpec(block_size=CPU_BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM,
                                 dtype=torch.uint8)
        sunk = LowBitKVBackend.customize_spec(spec)
    kc, vc = get_scheme("vidkv_stp").codecs(HEAD_DIM)
    state = -(-(kc.nbytes + vc.nbytes) // 4) * 4
    assert sunk.tokens_per_state == CPU_BLOCK and sunk.num_states == 1
    assert sunk.page_size_bytes == KV_HEADS * (2 * 4 * HEAD_DIM * 2 + 2 * state)
    assert sunk.page_size_bytes % 4 == 0


# --------------------------------------------------------------------------- servers

@pytest.mark.slow
def test_config_logged_once_with_effective_bits(server):
    log = server.log.read_text()
    lines = [ln for ln in log.splitlines() if "lowbit-kv: --kv-cache-dtype vidkv" in ln]
    assert len(lines) == 1, lines
    assert "protect=0.2" in lines[0] and "sink_tokens=4" in lines[0] and "skip_layers=[0]" in lines[0]
    assert "(STP relevance)" in lines[0] and "Effective bits/element" in lines[0]
    # layer 0 gets vLLM's own bf16 attention, the other 29 our packed pages (one line per
    # page size: layers with retrieval heads hold larger pages); staging: 4 sequences, each
    # with its window's groups and its partial group
    slots = 4 * get_scheme("vidkv").with_params(residual_tokens=LOWBIT["residual_tokens"]).staged_groups
    layers = re.findall(rf"lowbit-kv pages: \d+ bytes per block .*; (\d+) layers; staging: {slots} slots",
                        log)
    assert sum(map(int, layers)) == 29 and len(layers) > 1, layers
    assert "staging pool" not in log and "Traceback" not in log


@pytest.mark.slow
def test_completions_stream_and_not(server):
    port = server.port
    body = {"model": model_name(port), "prompt": "The capital of France is Paris. The capital of Germany is",
            "max_tokens": 24, "temperature": 0}
    text = post(port, "/v1/completions", body)["choices"][0]["text"]
    assert text.startswith(" Berlin")
    events = post(port, "/v1/completions", {**body, "stream": True}, stream=True)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == text


@pytest.mark.slow
def test_chat_stream_and_not(server):
    port = server.port
    body = {"model": model_name(port), "max_tokens": 20, "temperature": 0,
            "messages": [{"role": "user", "content": "What is 2+2? Answer briefly."}]}
    text = post(port, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    assert "4" in text
    events = post(port, "/v1/chat/completions", {**body, "stream": True}, stream=True)
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert streamed == text


@pytest.mark.slow
def test_long_prompt_reads_packed_pages_and_prefix_cache(server):
    """~650 prompt tokens in chunks of 256: later chunks attend to quantized groups (STP
    scores from the chunk's last queries); the second time, the prompt's full blocks
    are prefix-cache hits, reused as packed bytes (sinks included)."""
    port = server.port
    body = {"model": model_name(port), "prompt": long_prompt(), "max_tokens": 40, "temperature": 0}
    hits = metric(port, "prefix_cache_hits_total")
    r = post(port, "/v1/completions", body)
    assert r["usage"]["prompt_tokens"] > 256 + 64
    assert fluent(r["choices"][0]["text"]), r["choices"][0]["text"]
    r2 = post(port, "/v1/completions", body)
    assert metric(port, "prefix_cache_hits_total") - hits >= 256
    assert fluent(r2["choices"][0]["text"]), r2["choices"][0]["text"]
    wait_idle(server)


@pytest.mark.slow
def test_preempted_requests_leave_nothing_behind(server):
    """4 requests of 370 prompt tokens, sent as one batch so that they run together
    however fast the CPU or slow the client, fit 3 blocks each at admission, then each
    needs two more while decoding: 20 blocks of the 10 there are, so vLLM preempts (frees
    the blocks, recomputes later). All finish fluently; blocks and staging slots go back."""
    port, model = server.port, model_name(server.port)
    before = metric(port, "num_preemptions_total")
    prompts = [post(port, "/tokenize", {"model": model, "prompt": long_prompt(i + 1)})["tokens"][:370]
               for i in range(4)]
    r = post(port, "/v1/completions", {"model": model, "prompt": prompts, "max_tokens": 150,
                                       "temperature": 0, "ignore_eos": True})
    assert metric(port, "num_preemptions_total") > before
    assert len(r["choices"]) == 4 and r["usage"]["completion_tokens"] == 4 * 150
    for choice in r["choices"]:
        assert fluent(choice["text"], 10), choice["text"]
    wait_idle(server)
    assert "Traceback" not in server.log.read_text()


@pytest.mark.slow
def test_aborted_requests_leave_nothing_behind(server):
    port, model = server.port, model_name(server.port)
    conns = []
    for i in range(3):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        c.request("POST", "/v1/completions",
                  json.dumps({"model": model, "prompt": long_prompt(i + 5, chars=1500),
                              "max_tokens": 400, "temperature": 0, "stream": True}),
                  {"Content-Type": "application/json"})
        conns.append(c)
    for c in conns:  # read a few tokens, then hang up: vLLM aborts the request
        r, n = c.getresponse(), 0
        for line in r:
            n += line.startswith(b"data:")
            if n >= 5:
                break
        c.close()
    wait_idle(server)
    assert metric(port, "num_requests_running") == 0
