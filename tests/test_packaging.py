"""What an installed wheel and the CPU image carry: the kernel sources (built on first use),
the corpus helper that fetches the calibration text, and the serving entry points."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNEL_SOURCES = ["vllm_lowbit_kv/csrc/cpu/packed_attention.cpp",
                  "vllm_lowbit_kv/csrc/cpu/dense_attention.cpp",
                  "vllm_lowbit_kv/csrc/cpu/vectors.h",
                  "vllm_lowbit_kv/csrc/cpu/micro_gemm.h",
                  "vllm_lowbit_kv/csrc/cpu/code_columns.h",
                  "vllm_lowbit_kv/csrc/cpu/value_sums.h",
                  "vllm_lowbit_kv/csrc/cpu/amx.h",
                  "vllm_lowbit_kv/csrc/cpu/encode_states.cpp",
                  "vllm_lowbit_kv/csrc/cpu/exact_decode.cpp",
                  "vllm_lowbit_kv/csrc/cpu/staging.cpp",
                  "vllm_lowbit_kv/csrc/cpu/merge.cpp",
                  "vllm_lowbit_kv/csrc/cpu/descriptors.h",
                  "vllm_lowbit_kv/csrc/cpu/dtypes.h",
                  "vllm_lowbit_kv/csrc/cuda/bindings.cpp",
                  "vllm_lowbit_kv/csrc/cuda/packed_attention.cu",
                  "vllm_lowbit_kv/csrc/cuda/packed_attention.cuh"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(out), str(ROOT)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    (path,) = out.glob("vllm_lowbit_kv-*.whl")
    return zipfile.ZipFile(path)


def test_kernel_sources_are_where_the_ops_look():
    from vllm_lowbit_kv.ops import cpu, cuda
    assert all(s.is_file() for s in cpu.SOURCES + cpu.HEADERS)
    assert all((cuda.SOURCE_DIR / name).is_file() for name in cuda.SOURCES)
    assert {str(p.relative_to(ROOT)) for p in (*cpu.SOURCES, *cpu.HEADERS,
                                                *(cuda.SOURCE_DIR / n for n in cuda.SOURCES))} \
        <= set(KERNEL_SOURCES)


def test_wheel_carries_kernels_corpus_helper_and_serving(wheel):
    names = set(wheel.namelist())
    missing = [n for n in KERNEL_SOURCES + ["vllm_lowbit_kv/corpus.py", "vllm_lowbit_kv/calibrate.py",
                                             "serving/__main__.py", "serving/kv_stats.py"]
               if n not in names]
    assert missing == []
    (ep,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    entry_points = wheel.read(ep).decode()
    assert "lowbit_kv = vllm_lowbit_kv.vllm.plugin:register" in entry_points
    assert "lowbit_kv_stats = serving.kv_stats:KVStatsPlugin" in entry_points


def test_cpu_image_copies_the_kernel_sources():
    """The CPU image serves the C++ kernel only if its sources are in the image: the package
    folder that holds them is copied whole."""
    copied = re.findall(r"^COPY\s+(\S+)", (ROOT / "docker" / "Dockerfile.cpu").read_text(), re.M)
    assert any(all(src.startswith(c.rstrip("/") + "/") for src in KERNEL_SOURCES)
               for c in copied), copied
