"""bench.serve_client's parts that need no server (the benchmark starts one per dtype and
runs vLLM's own client against it; tests/test_serving_vllm_cli.py runs that client)."""

from types import SimpleNamespace

import pytest

from bench.serve_client import METRICS, add_ratios, client_command


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
    assert rows[0]["x_bf16"] == {m: 1.0 for m in METRICS}
    assert rows[1]["x_bf16"] == {m: pytest.approx(1.5) for m in METRICS}
