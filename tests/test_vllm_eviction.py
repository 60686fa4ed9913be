"""Eviction on the real vLLM server: refusals at start-up, blocks given back and reused.

The numbers of compaction and of attention after it are checked against a
reference in tests/test_eviction.py (pure PyTorch, the same functions the
worker calls). Here one server (kivi4, FlashCache at retention 0.2, a pool of
28 blocks of 128 tokens, one of them vLLM's null block) shows what only the
engine can: a 2,036-token prompt needs 16 blocks; after its prefill the
request keeps 7 + its last prompt block and gives 8 back (vLLM's own usage
gauge drops), and a second request of the same length, which needs 16 free
blocks, runs to completion while the first is still decoding, with no
preemption. Without eviction only 27 - 16 = 11 blocks would be free and the
second request would wait for the first to finish.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time

import pytest

pytest.importorskip("vllm")

from bench.quality import passkey_prompt  # noqa: E402
from _servers import FLOAT32_WEIGHTS  # noqa: E402
from _vllm_config import vllm_config  # noqa: E402
from bench.server import Server, measurement_server, metric_value, metrics_text  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _plugin_registered():
    """Our dtypes and hooks in vLLM's tables, as the engine's plugin loading does."""
    from vllm_lowbit_kv.vllm.plugin import register
    register()

BLOCKS, BS = 28, 128
EVICTION = {"eviction": "flashcache", "retention": 0.2}


@pytest.mark.parametrize("dtype,lowbit,cache_kw,reason", [
    ("kivi4", EVICTION, dict(enable_prefix_caching=True), "pass --no-enable-prefix-caching"),
    ("vidkv_stp", EVICTION, {}, "eviction with an STP scheme"),
    ("kivi4", {**EVICTION, "skip_layers": [0]}, {}, r"eviction with skip_layers \[0\]"),
    ("kivi4", {**EVICTION, "sink_tokens": 8, "eviction_sinks": 4}, {},
     r"eviction_sinks \(4\) must be >= sink_tokens \(8\)"),
    ("auto", EVICTION, {}, "eviction needs a lowbit-kv --kv-cache-dtype"),
    ("bfloat16", EVICTION, {}, "eviction needs a lowbit-kv --kv-cache-dtype"),
])
def test_eviction_refused_at_startup_with_the_reason(model_dir, dtype, lowbit, cache_kw, reason):
    cache_kw.setdefault("enable_prefix_caching", False)
    with pytest.raises(ValueError, match=f"{reason}.*Refusing to start"):
        vllm_config(model_dir, dtype, lowbit, **cache_kw)


def test_eviction_installs_its_scheduler(model_dir):
    cfg = vllm_config(model_dir, "kivi4", EVICTION, enable_prefix_caching=False)
    assert cfg.scheduler_config.scheduler_cls == "vllm_lowbit_kv.vllm.eviction.EvictingScheduler"
    plain = vllm_config(model_dir, "kivi4", {}, enable_prefix_caching=False)
    assert plain.scheduler_config.scheduler_cls is None


def test_yardstick_engine_passes_the_policy_to_its_server(tmp_path):
    from bench.vllm_engine import VllmEngine
    from vllm_lowbit_kv.eviction import make_policy

    (tmp_path / "config.json").write_text(json.dumps(dict(
        num_attention_heads=9, num_key_value_heads=3, hidden_size=576, num_hidden_layers=30)))
    pol = make_policy("recency", 0.5, recent_window=16)
    eng = VllmEngine(tmp_path, "kivi4", eviction=pol)
    cmd = measurement_server(tmp_path, "kivi4", chunk=256, max_model_len=1024,
                             additional_config=eng.overrides).command()
    assert json.loads(cmd[cmd.index("--additional-config") + 1]) == {"lowbit_kv": dict(
        eviction="recency", retention=0.5, eviction_gamma=0.2, eviction_sinks=4, recent_window=16)}
    assert eng.logprobs_variants([1, 2, 3], 2, 2, [pol])[0]["logprobs"] is None  # no PPL after eviction
    with pytest.raises(ValueError, match="one engine per policy"):
        eng.greedy_variants([1, 2], 2, 2, [None, pol])
    with pytest.raises(ValueError, match="eviction needs a lowbit-kv scheme"):
        VllmEngine(tmp_path, "bfloat16", eviction=pol)


def _metric(srv: Server, name: str) -> float:
    value = metric_value(metrics_text(srv.port), name)
    assert value is not None, name
    return value


def _stream(srv: Server, ids, n, events: list, hang_up: threading.Event) -> None:
    """Stream a completion into ``events`` ((time, text), then (time, None) at its end),
    hanging up (vLLM aborts the request) once ``hang_up`` is set."""
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=1200)
    c.request("POST", "/v1/completions", json.dumps(dict(
        model=srv.model_name, prompt=ids, max_tokens=n, temperature=0, ignore_eos=True,
        stream=True)), {"Content-Type": "application/json"})
    r = c.getresponse()
    for line in r:
        line = line.strip()
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            events.append((time.time(), json.loads(line[6:])["choices"][0]["text"]))
        if hang_up.is_set():
            break
    else:
        events.append((time.time(), None))
    c.close()


def test_freed_blocks_are_given_back_and_reused(model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    a_ids = passkey_prompt(tok, 2048, 0.5, 11111)
    b_ids = passkey_prompt(tok, 2048, 0.1, 22222)
    assert -(-len(a_ids) // BS) == 16 and -(-len(b_ids) // BS) == 16
    srv = measurement_server(model_dir, "kivi4", chunk=512, max_model_len=3072, max_num_seqs=4,
                             additional_config=EVICTION, kv_space_gib=1, log=tmp_path / "server.log",
                             extra_args=["--num-gpu-blocks-override", str(BLOCKS), "--block-size", str(BS),
                                         *FLOAT32_WEIGHTS])
    with srv:
        events: list = []
        hang_up = threading.Event()
        a = threading.Thread(target=_stream, args=(srv, a_ids, 400, events, hang_up))
        a.start()
        t0 = time.time()
        while "compacted" not in srv.log_text() or len(events) < 3:
            assert a.is_alive() and time.time() - t0 < 600, srv.log_text()[-3000:]
            time.sleep(0.5)
        log = srv.log_text()
        m = re.search(r"\(2036 prompt tokens, flashcache @ 0.2\): keeps (\d+) blocks \+ its last "
                      r"prompt block, freed (\d+) blocks \((\d+) free now\)", log)
        assert m, log[-3000:]
        kept, freed, free_now = map(int, m.groups())
        assert (kept, freed) == (7, 8) and free_now == BLOCKS - 1 - (kept + 1)
        held = round(_metric(srv, "vllm:kv_cache_usage_perc") * (BLOCKS - 1))
        assert kept + 1 <= held <= kept + 1 + 3, held  # + blocks of the tokens decoded so far
        # B needs 16 free blocks: only there because A gave 8 back
        b = srv.completion(prompt=b_ids, max_tokens=8, temperature=0, ignore_eos=True)
        assert len(tok(b["text"], add_special_tokens=False).input_ids) >= 1
        assert None not in [t for _, t in events], "B waited for A to finish"
        hang_up.set()  # the rest of A's 400 tokens would only cost time
        a.join(600)
        assert not a.is_alive() and len("".join(t for _, t in events if t)) > 0
        assert _metric(srv, "vllm:num_preemptions_total") == 0
        assert len(re.findall(r"compacted, kept pairs per layer", srv.log_text())) == 2
        assert srv.alive
