"""Results name no path of the machine that made them (issue #17, "Portable results").

Every JSON and Markdown file under bench/results/ is scanned for absolute paths
(home, /tmp, the repository's own folder, site-packages, ...); the writers'
rewriting (:mod:`bench.portable`) is checked on real commands, and two writers
run for real into a temporary folder (the eviction-capacity calculation and a
quick kernel timing) with every path they are given absolute.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from bench import portable
from vllm_lowbit_kv.model import MODEL_NAME, cache_root

ROOT = Path(__file__).resolve().parents[1]
RESULTS = sorted(p for p in (ROOT / "bench" / "results").iterdir() if p.suffix in (".json", ".md"))
EMBEDDED = str(cache_root() / MODEL_NAME)

def test_results_exist():
    assert len(RESULTS) >= 10 and any(p.suffix == ".md" for p in RESULTS)


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_result_file_names_no_absolute_path(path):
    found = portable.absolute_paths(path.read_text())
    assert found == [], f"{path.name}: {found[:5]} (python -m bench.portable --fix {path.name})"


@pytest.mark.parametrize("text", [
    "/root/.cache/vllm-lowbit-kv/SmolLM2-135M-Instruct",
    "/home/alice/x.json", "/tmp/bench/dec", "/work/main/.venv/bin/python",
    "/usr/lib/python3/dist-packages/vllm/x.py", "lib/python3.11/site-packages/torch",
    "--log-dir=/tmp/a", '"/opt/models/llama"',
])
def test_detector_finds_absolute_paths(text):
    assert portable.absolute_paths(text)


@pytest.mark.parametrize("text", [
    "python -m bench.decode --out bench/results/decode_cpu.json", "$TMPDIR/bench/dec",
    "$VLLM_LOWBIT_KV_CACHE/codebooks/SmolLM2-135M-Instruct/rvq.safetensors",
    "http://127.0.0.1:8000/v1/models", "K/V pairs", "tokens/s", "model: SmolLM2-135M-Instruct",
])
def test_detector_leaves_portable_text(text):
    assert portable.absolute_paths(text) == []


def test_server_command_is_portable():
    """What throughput, decode, eviction_capacity and load_fault record as their server's
    command (bench.server.Server.command) once made portable."""
    from bench.server import measurement_server

    tmp = tempfile.gettempdir()
    srv = measurement_server(EMBEDDED, "vidkv", chunk=256, max_model_len=1024,
                             extra_args=["--lowbit-config", f"{tmp}/run/lowbit.json",
                                         "--x", str(ROOT / "bench" / "results" / "a.json")])
    raw = srv.command()
    assert raw[0] == sys.executable and EMBEDDED in raw
    cmd = portable.command(raw, [EMBEDDED])
    assert cmd.startswith("python -m serving --kv-cache-dtype vidkv"), cmd
    assert "--model" not in cmd  # the launcher serves the embedded model without it
    assert "--lowbit-config '$TMPDIR/run/lowbit.json'" in cmd or \
        "--lowbit-config $TMPDIR/run/lowbit.json" in cmd, cmd
    assert "--x bench/results/a.json" in cmd, cmd
    assert portable.absolute_paths(cmd) == []
    # another local model: its folder's name (what it is served as), never the path
    other = portable.command(["python", "-m", "serving", "--model", "/srv/models/Llama-3-8B"],
                             ["/srv/models/Llama-3-8B"])
    assert other == "python -m serving --model Llama-3-8B"
    assert portable.model_name(EMBEDDED) == MODEL_NAME
    assert portable.model_name("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"  # a hub id stays


def _run_writer(args, out: Path, timeout=300):
    r = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    text = out.read_text()
    assert portable.absolute_paths(text) == [], text[:2000]
    return json.loads(text)


def test_eviction_capacity_writer(tmp_path):
    out = tmp_path / "ec.json"
    res = _run_writer(["bench.eviction_capacity", "--no-measure", "--dtypes", "vidkv",
                       "--model", EMBEDDED, "--json", str(out), "--png", str(tmp_path / "ec.png")], out)
    assert res["model"] == MODEL_NAME
    assert res["command"].startswith("python -m bench.eviction_capacity --no-measure"), res["command"]
    assert "$TMPDIR/" in res["command"] or str(tmp_path) not in res["command"]


def test_kernels_writer(tmp_path):
    out = tmp_path / "k.json"
    res = _run_writer(["bench.kernels", "--quick", "--min-time", "0.005", "--no-vllm", "--impls",
                       "torch", "--schemes", "vidkv", "--out", str(out)], out)
    assert res["command"].startswith("python -m bench.kernels --quick"), res["command"]
