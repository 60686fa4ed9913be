"""bench.serve_client's parts that need no server (the benchmark starts one per dtype and
runs vLLM's own client against it; tests/test_serving_vllm_cli.py runs that client)."""

from types import SimpleNamespace

import pytest

from bench.serve_client import METRICS, add_ratios, client_command, label, summarize


def test_every_server_gets_the_same_prompts_all_at_once():
    args = SimpleNamespace(input_tokens=1024, output_tokens=64, prompts=8, seed=3)
    a = client_command(8001, "/m", "smol", args, "/r")
    b = client_command(8002, "/m", "smol", args, "/r")
    assert [x for x in a if x != "8001"] == [x for x in b if x != "8002"]
    flags = dict(zip(a, a[1:]))
    assert flags["--seed"] == "3" and flags["--num-prompts"] == "8"
    assert flags["--random-input-len"] == "1024" and flags["--random-output-len"] == "64"
    assert "--ignore-eos" in a  # every request generates exactly --output-tokens
    assert "--request-rate" not in a  # vLLM's default: all at once


def test_ratios_are_against_the_first_row():
    rows = [dict(dtype="bfloat16", **{m: 2.0 for m in METRICS}),
            dict(dtype="vidkv", **{m: 3.0 for m in METRICS})]
    add_ratios(rows)
    assert rows[0]["x_ref"] == {m: 1.0 for m in METRICS}
    assert rows[1]["x_ref"] == {m: pytest.approx(1.5) for m in METRICS}


def test_rounds_are_ratios_to_bf16_of_the_same_round():
    """--rounds N: each round's rows against that round's bf16 row (the machine drifts
    between rounds); the summary is the median ratio per dtype with its range."""
    rows = [dict(dtype=d, round=k, **{m: x for m in METRICS})
            for k, (b, v) in enumerate([(2.0, 3.0), (4.0, 4.0), (1.0, 3.0)])
            for d, x in (("bfloat16", b), ("vidkv", v))]
    add_ratios(rows)
    assert [r["x_ref"]["duration"] for r in rows] == [1.0, 1.5, 1.0, 1.0, 1.0, 3.0]
    summary = summarize(rows)
    assert [(s["dtype"], s["rounds"]) for s in summary] == [("bfloat16", 3), ("vidkv", 3)]
    vidkv = summary[1]
    assert (vidkv["x_ref_min"]["duration"], vidkv["x_ref_median"]["duration"],
            vidkv["x_ref_max"]["duration"]) == (1.0, 1.5, 3.0)
    assert summary[0]["x_ref_median"] == {m: 1.0 for m in METRICS}


def test_preload_on_and_off_in_the_same_run():
    """--preload on,off: each dtype twice; ratios to bf16 within a setting, and on/off."""
    rows = [dict(dtype="bfloat16", preload="on", **{m: 4.0 for m in METRICS}),
            dict(dtype="bfloat16", preload="off", **{m: 2.0 for m in METRICS}),
            dict(dtype="vidkv", preload="on", **{m: 6.0 for m in METRICS}),
            dict(dtype="vidkv", preload="off", **{m: 3.0 for m in METRICS})]
    add_ratios(rows)
    assert [r["x_ref"]["duration"] for r in rows] == [1.0, 1.0, 1.5, 1.5]
    assert [r.get("x_preload_off", {}).get("duration") for r in rows] == [2.0, None, 2.0, None]
    assert [label(r, rows) for r in rows] == ["bfloat16", "bfloat16 (no preload)", "vidkv",
                                              "vidkv (no preload)"]
    assert label(rows[0], rows[:1]) == "bfloat16"


def test_reserved_cpus_beside_preload():
    """--reserved-cpus launcher,1 with --preload on,off: x_ref within the same settings,
    each launcher value against the other value of that setting alone."""
    rows = [dict(dtype=d, preload=p, reserved_cpus=r, **{m: x for m in METRICS})
            for d, scale in (("bfloat16", 1.0), ("vidkv", 2.0))
            for (p, r), x in ((("on", "launcher"), 8.0 * scale), (("on", "1"), 4.0 * scale),
                              (("off", "launcher"), 2.0 * scale), (("off", "1"), 1.0 * scale))]
    add_ratios(rows)
    assert [r["x_ref"]["duration"] for r in rows] == [1.0] * 4 + [2.0] * 4
    assert rows[0]["x_reserved_cpus_1"]["duration"] == 2.0  # on/launcher against on/1
    assert rows[0]["x_preload_off"]["duration"] == 4.0  # on/launcher against off/launcher
    assert rows[1]["x_preload_off"]["duration"] == 4.0 and "x_reserved_cpus_1" not in rows[1]
    assert rows[2]["x_reserved_cpus_1"]["duration"] == 2.0 and "x_preload_off" not in rows[2]
    assert [label(r, rows) for r in rows[:4]] == [
        "bfloat16", "bfloat16 (1 CPU reserved)", "bfloat16 (no preload)",
        "bfloat16 (no preload) (1 CPU reserved)"]
    assert [s["rounds"] for s in summarize(rows)] == [1] * 8


def test_settings_reach_the_server(monkeypatch):
    """Preload is the launcher's LOWBIT_KV_PRELOAD (1 or 0); reserved CPUs vLLM's
    VLLM_CPU_NUM_OF_RESERVED_CPU, unset for the launcher's own choice."""
    import bench.serve_client as sc

    seen = []

    def server(model, dtype, **kw):
        seen.append(kw["env"])
        raise RuntimeError("stop")

    monkeypatch.setattr(sc, "measurement_server", server)
    args = SimpleNamespace(chunk=2048, max_model_len=2048, prompts=8, kv_space_gib=2, dtype=None)
    for setting in (dict(preload="on", reserved_cpus="launcher"), dict(preload="off", reserved_cpus="1")):
        with pytest.raises(RuntimeError):
            sc.measure("/m", "vidkv", args, setting)
    assert [e["LOWBIT_KV_PRELOAD"] for e in seen] == ["1", "0"]
    assert [e["VLLM_CPU_NUM_OF_RESERVED_CPU"] for e in seen] == [None, "1"]
    for bad in (["--preload", "maybe"], ["--reserved-cpus", "launcher,x"], ["--rounds", "0"],
                ["--dtype", "float16"]):
        with pytest.raises(SystemExit):
            sc.main([*bad, "--model", "/m"])


def test_float32_weights_reach_every_server_against_auto(monkeypatch):
    """--dtype float32: vLLM's --dtype on every server, and the reference measured first is
    the float32 model's own cache (auto), not bfloat16 (which the plugin refuses there)."""
    import bench.serve_client as sc

    seen = []

    def server(model, dtype, **kw):
        seen.append((dtype, kw["model_dtype"]))
        raise RuntimeError("stop")

    monkeypatch.setattr(sc, "measurement_server", server)
    with pytest.raises(RuntimeError):
        sc.main(["--dtype", "float32", "--model", "/m"])
    assert seen == [("auto", "float32")]
    seen.clear()
    with pytest.raises(RuntimeError):
        sc.main(["--model", "/m"])
    assert seen == [("bfloat16", None)]
