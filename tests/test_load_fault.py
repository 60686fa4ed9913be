"""The load-and-fault run, short form, against the session's shared vidkv server.

16 clients for 30 s (every kind of request and fault at least once: streams,
hang-ups mid-stream and before the answer, oversized prompts, malformed JSON,
unknown fields, bad values, unknown model) on a server with 10 KV blocks and
4 sequences, so requests queue and get preempted. The full run is
``python -m bench.load_fault --clients 64 --duration 180`` (its own server;
bench/results/load_fault.json).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from _servers import wait_idle  # noqa: E402

from bench.load_fault import KINDS, run_load  # noqa: E402

pytestmark = pytest.mark.slow


def test_short_load_and_fault_run(server):
    wait_idle(server)
    s = run_load(server.port, clients=16, duration=30, grace=30, seed=1, log_path=server.log)
    assert s["kinds_missing"] == [], s["by_kind"]
    assert s["five_xx"] == 0, s["unexpected_examples"]
    assert s["unexpected"] == 0, s["unexpected_examples"]
    assert s["streams_completed"] > 0 and s["by_kind"]["hangup_mid_stream"].get("200", 0) > 0
    assert s["health_after"] == 200 and server.alive
    assert s["idle"], s["idle_state"]
    assert s["final_completion"]["ok"], s["final_completion"]
    assert s["log_errors"] == []
    assert s["passed"]
    assert len(KINDS) <= 16  # every kind was some client's first request
