"""The vLLM plugin and backend: registration in-process, then one real server.

The server tests share one ``python -m serving --kv-cache-dtype kivi2`` server
(session fixture, about 30 s to start on the embedded SmolLM2) run with
chunked prefill (max_num_batched_tokens=256), so a long prompt's later chunks
read the packed pages.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from vllm_lowbit_kv.schemes import SCHEMES, get_scheme  # noqa: E402
from vllm_lowbit_kv.vllm_plugin import register  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KV_SPACE_GIB = 1
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
        assert path == "vllm_lowbit_kv.vllm_backend.LowBitKVBackend"
        for kw, reason in [({"use_mla": True}, "MLA"),
                           ({"has_sliding_window": True}, "sliding-window"),
                           ({"attn_type": "encoder_decoder"}, "encoder"),
                           ({"head_size": 2048}, "head_size")]:
            with pytest.raises(ValueError, match=reason):
                CpuPlatform.get_attn_backend_cls(None, _selector(**kw))


def test_spec_page_size_is_packed(plugin):
    import torch
    from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm_lowbit_kv.vllm_backend import LowBitKVBackend

    with set_current_vllm_config(VllmConfig(cache_config=CacheConfig(cache_dtype="kivi2"))):
        spec = FullAttentionSpec(block_size=CPU_BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM,
                                 dtype=torch.uint8)
        packed = LowBitKVBackend.customize_spec(spec)
    bf16 = FullAttentionSpec(block_size=CPU_BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM,
                             dtype=torch.bfloat16)
    eff = get_scheme("kivi2").effective_bits(HEAD_DIM)
    assert bf16.page_size_bytes / packed.page_size_bytes == pytest.approx(16 / eff)


# --------------------------------------------------------------------------- server

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(KV_SPACE_GIB), LOWBIT_KV_LOG_STAGING="1")
    cmd = [sys.executable, "-m", "serving", "--kv-cache-dtype", "kivi2", "--port", str(port),
           "--enforce-eager", "--max-model-len", "2048", "--max-num-seqs", "8",
           "--max-num-batched-tokens", "256"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.time() + 240
        while "Application startup complete" not in log.read_text():
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"server did not start:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield port, log
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _model(port):
    return _get(port, "/v1/models")["data"][0]["id"]


def _get(port, path):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request("GET", path)
    return json.loads(c.getresponse().read())


def _post(port, path, body, stream=False):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200, r.read()
    if not stream:
        return json.loads(r.read())
    events = []
    for line in r:
        line = line.strip()
        if line.startswith(b"data:") and line != b"data: [DONE]":
            events.append(json.loads(line[5:]))
    return events


def _long_prompt() -> str:
    corpus = Path(os.environ.get("VLLM_LOWBIT_KV_CACHE", Path.home() / ".cache/vllm-lowbit-kv"))
    p = corpus / "corpus" / "lee_background.txt"
    if p.is_file():
        return " ".join(p.read_text().splitlines()[:6])[:3000] + "\n\nSummary:"
    return "The quick brown fox jumps over the lazy dog. " * 60 + "\n\nSummary:"


@pytest.mark.slow
def test_kv_capacity_scales_with_bits(server):
    _, log = server
    m = re.search(r"KV cache size: ([\d,]+) tokens", log.read_text())
    tokens = int(m.group(1).replace(",", ""))
    bf16_tokens = KV_SPACE_GIB * 2**30 // (LAYERS * KV_HEADS * HEAD_DIM * 2 * 2)
    eff = get_scheme("kivi2").effective_bits(HEAD_DIM)
    assert tokens >= 0.9 * (16 / eff) * bf16_tokens, (tokens, bf16_tokens, eff)


@pytest.mark.slow
def test_completions_stream_and_not(server):
    port, _ = server
    body = {"model": _model(port), "prompt": "The capital of France is Paris. The capital of Germany is",
            "max_tokens": 24, "temperature": 0}
    text = _post(port, "/v1/completions", body)["choices"][0]["text"]
    assert text.startswith(" Berlin")
    events = _post(port, "/v1/completions", {**body, "stream": True}, stream=True)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == text


@pytest.mark.slow
def test_chat_stream_and_not(server):
    port, _ = server
    body = {"model": _model(port), "max_tokens": 20, "temperature": 0,
            "messages": [{"role": "user", "content": "What is 2+2? Answer briefly."}]}
    text = _post(port, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    assert "4" in text
    events = _post(port, "/v1/chat/completions", {**body, "stream": True}, stream=True)
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert streamed == text


@pytest.mark.slow
def test_long_prompt_reads_packed_pages(server):
    """657 prompt tokens in chunks of 256: later chunks attend to quantized groups."""
    port, _ = server
    r = _post(port, "/v1/completions", {"model": _model(port), "prompt": _long_prompt(),
                                        "max_tokens": 70, "temperature": 0})
    assert r["usage"]["prompt_tokens"] > 256 + 64
    words = r["choices"][0]["text"].split()
    assert len(words) > 20 and len(set(words)) > 10  # fluent text, not a collapsed loop


@pytest.mark.slow
def test_aborted_requests_free_staging(server):
    port, log = server
    pat = re.compile(r"freed \d+ staging slots of ended requests \((\d+) in use\)")
    before = len(pat.findall(log.read_text()))
    model, prompt = _model(port), _long_prompt()[:1500]
    conns = []
    for i in range(3):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        c.request("POST", "/v1/completions",
                  json.dumps({"model": model, "prompt": f"{prompt} {i}", "max_tokens": 400,
                              "temperature": 0, "stream": True}),
                  {"Content-Type": "application/json"})
        conns.append(c)
    for c in conns:  # read a few tokens, then hang up: vLLM aborts the request
        r, n = c.getresponse(), 0
        for line in r:
            n += line.startswith(b"data:")
            if n >= 5:
                break
        c.close()
    deadline = time.time() + 60
    while True:
        frees = pat.findall(log.read_text())[before:]
        if frees and frees[-1] == "0":
            break
        assert time.time() < deadline, frees
        time.sleep(1)
    assert "staging pool full" not in log.read_text()
