"""CUDA paged decode attention (csrc/cuda/, loader vllm_lowbit_kv/ops/cuda.py).

Without a GPU: nvcc compiles the kernel for sm_80 and sm_90a (compile-only,
no spills allowed), the torch binding is compiled against torch's headers
(syntax only), the Python side of the C struct is checked against the
header, and the kernel's own code runs on the CPU under
csrc/cuda/host_emulation.cpp (one fiber per CUDA thread, barriers for
__syncthreads, a per-warp exchange for shuffles) against the reference.
With a GPU (marked ``gpu``): the JIT-built kernel against the reference.
Outputs are poisoned first; tolerances as for the Triton kernel (float32
math, another summation order): out atol 2e-5 + rtol 1e-4, lse atol 1e-5 +
rtol 1e-5.
"""

import ctypes
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

from vllm_lowbit_kv.ops import packed_attention_reference
from vllm_lowbit_kv.ops import cuda as cuda_ops
from vllm_lowbit_kv.ops.page_format import page_format
from vllm_lowbit_kv.paged import PagedLayout
from vllm_lowbit_kv.schemes import get_scheme

SRC = cuda_ops.SOURCE_DIR


def _cuda_home() -> Path | None:
    """A CUDA toolkit with nvcc and the runtime headers: CUDA_HOME, /usr/local/cuda, or
    the one whose nvcc is on PATH (which may be a wrapper script)."""
    cands = [os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    if shutil.which("nvcc"):
        cands.append(str(Path(shutil.which("nvcc")).resolve().parent.parent))
    for c in filter(None, cands):
        home = Path(c)
        if (home / "bin" / "nvcc").exists() and (home / "include" / "cuda_runtime_api.h").exists():
            return home
    return None


def _nvcc() -> str | None:
    home = _cuda_home()
    return str(home / "bin" / "nvcc") if home else None


#: variants of registered schemes that reach the kernel's other code paths
VARIANTS = {
    # VidKV rows not byte-aligned (19 2-bit + 45 1-bit channels), no FFT, sign levels
    "vidkv_k03_sign": ("vidkv", dict(k=0.3, one_bit="sign")),
    # FFT over 16 components (k = 0.75)
    "vidkv_k075": ("vidkv_k15v2", dict(k=0.75)),
    # 8-bit KIVI, per-token value scales of 16 channels
    "kivi8_g16": ("kivi2", dict(bits=8, group_size=16)),
}


def _layout(scheme, T=64, H=2, block_size=64):
    base, params = VARIANTS.get(scheme, (scheme, {}))
    kc, vc = get_scheme(base).with_params(**params).codecs(64, T)
    return PagedLayout(kc, vc, H, block_size)


def test_format_fields_match_the_header():
    header = (SRC / "packed_attention.cuh").read_text()
    body = re.search(r"typedef struct LowbitPageFormat \{(.*?)\} LowbitPageFormat;", header, re.S)
    names = []
    for line in body.group(1).splitlines():
        decl = line.split("//")[0].strip()
        if decl.startswith("int32_t"):
            names += [n.strip() for n in decl[len("int32_t"):].rstrip(";").split(",")]
    assert tuple(names) == cuda_ops.FORMAT_FIELDS


@pytest.mark.parametrize("scheme", ["vidkv", "vidkv_stp", "kivi2"])
def test_format_values_are_the_codec_offsets(scheme):
    layout = _layout(scheme)
    fmt = page_format(layout)
    values = dict(zip(cuda_ops.FORMAT_FIELDS, cuda_ops.format_values(fmt)))
    assert values["state_bytes"] == layout.state_bytes and values["T"] == 64
    kfields = [n for n, _ in layout.key_codec.layout().fields]
    vfields = [n for n, _ in layout.value_codec.layout().fields]
    if "chan_mask" in kfields:
        assert values["k_cmask"] == sum(b for n, b in layout.key_codec.layout().fields[
            :kfields.index("chan_mask")])
    else:
        assert values["k_cmask"] == -1 and values["k_codes"] == 0
    v_first = layout.value_codec.layout().fields[0][0]
    key = {"codes": "v_codes", "alpha": "v_alpha", "prot_scale": "v_pscale"}[v_first]
    assert values[key] == layout.format.k_bytes  # V fields count from the state start
    assert len(vfields) > 0


def test_supports_names_each_limit():
    """Device type, page format and GQA are refused with their reason before any build."""
    vidkv = page_format(_layout("vidkv"))
    assert "runs on CUDA devices, not cpu" in cuda_ops.supports(vidkv, "cpu", 1)
    assert "QuantileCodec" in cuda_ops.supports(page_format(_layout("quantile1")), "cuda", 1)
    assert "17 query heads per KV head" in cuda_ops.supports(vidkv, "cuda", cuda_ops.MAX_GQA + 1)
    header = (SRC / "packed_attention.cuh").read_text()
    assert f"#define LOWBIT_MAX_GQA {cuda_ops.MAX_GQA} " in header


@pytest.mark.skipif(_nvcc() is None, reason="no CUDA toolkit (CUDA_HOME, /usr/local/cuda, PATH)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_kernel_compiles_with_nvcc(arch, tmp_path):
    proc = subprocess.run(
        [_nvcc(), "-c", "-O3", "-std=c++20", f"-arch={arch}", "-Xptxas", "-v",
         str(SRC / "packed_attention.cu"), "-o", str(tmp_path / "packed_attention.o")],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stderr
    assert "packed_attention_kernel" in log and "combine_splits_kernel" in log
    spills = re.findall(r"(\d+) bytes spill stores", log)
    # one packed kernel per head count (1, 2, 4, 8, 16) and the combine kernel
    assert len(spills) == 6 and set(spills) == {"0"}, log[-2000:]


@pytest.mark.skipif(shutil.which("g++") is None or _nvcc() is None,
                    reason="g++ or CUDA headers missing")
def test_binding_compiles_against_torch_headers(tmp_path):
    """bindings.cpp, syntax only, against the installed torch's headers (a CPU torch lacks
    one generated CUDA header, cuda_cmake_macros.h: an empty stand-in is enough here)."""
    inc = Path(torch.__file__).parent / "include"
    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    cuda_inc = _cuda_home() / "include"
    proc = subprocess.run(
        ["g++", "-fsyntax-only", "-std=c++20", f"-I{tmp_path}", f"-I{inc}",
         f"-I{inc / 'torch' / 'csrc' / 'api' / 'include'}", f"-I{cuda_inc}",
         f"-I{sysconfig.get_paths()['include']}", f"-I{SRC}",
         "-DTORCH_EXTENSION_NAME=lowbit_kv_cuda", str(SRC / "bindings.cpp")],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_default_split_fills_the_sms():
    """The default split: about 16 thread blocks per SM, at least 4 groups per split."""
    # the GPU target: 32K context in 128-token groups, batch 32 x 3 KV heads, an H200
    assert cuda_ops.split_plan(256, None, blocks=32 * 3, sms=132) == (22, 12)
    assert cuda_ops.split_plan(256, None, blocks=64 * 3, sms=132) == (11, 24)
    assert cuda_ops.split_plan(8, None, blocks=3, sms=132) == (2, 4)  # short: 4 groups each
    assert cuda_ops.split_plan(3, None, blocks=3, sms=132) == (1, 3)
    assert cuda_ops.split_plan(256, None, blocks=4096, sms=132) == (1, 256)  # SMs already full
    assert cuda_ops.split_plan(10, 3) == (3, 4) and cuda_ops.split_plan(10, 50) == (10, 1)

# -- the kernel's code, run: on the CPU (host emulation) and on a GPU ------------------------

def _case(scheme, T, H, Hq, n_groups, q_rows, skip, seed):
    torch.manual_seed(seed)
    layout = _layout(scheme, T, H, 2 * T)
    N = layout.groups_per_block
    blocks = -(-sum(n_groups) // N) + 2
    pages = torch.full(layout.page_shape(blocks), 0xAB, dtype=torch.uint8)
    gids = torch.randperm(blocks * N)[:sum(n_groups)]
    k = torch.randn(len(gids), T, H, 64) * 3 + torch.randn(64)
    v = torch.randn(len(gids), T, H, 64)
    layout.write_states(pages, gids, layout.encode(k, v, torch.rand(len(gids), T, H)))
    table = torch.full((len(n_groups), max(n_groups) + 1), -5, dtype=torch.int32)
    at = 0
    for r, g in enumerate(n_groups):
        table[r, :g] = gids[at:at + g].int()
        at += g
    q_start = torch.tensor([0] + q_rows).cumsum(0)
    query = torch.randn(int(q_start[-1]), Hq, 64).bfloat16()
    return layout, pages, table, torch.tensor(n_groups), q_start, query, torch.tensor(skip)


class _Format(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in cuda_ops.FORMAT_FIELDS]


class _Args(ctypes.Structure):  # LowbitAttentionArgs (csrc/cuda/packed_attention.cuh)
    _fields_ = [("fmt", _Format), ("query", ctypes.c_void_p), ("q_stride_row", ctypes.c_int64),
                ("q_stride_head", ctypes.c_int64), ("q_start", ctypes.c_void_p),
                ("num_requests", ctypes.c_int32), ("num_rows", ctypes.c_int32),
                ("Hq", ctypes.c_int32), ("pages", ctypes.c_void_p),
                ("page_stride_block", ctypes.c_int64), ("page_stride_head", ctypes.c_int64),
                ("group_table", ctypes.c_void_p), ("table_stride", ctypes.c_int64),
                ("num_groups", ctypes.c_void_p), ("skip_tokens", ctypes.c_void_p),
                ("fft_inverse_t", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("lse", ctypes.c_void_p), ("part_out", ctypes.c_void_p),
                ("part_lse", ctypes.c_void_p), ("num_splits", ctypes.c_int32),
                ("groups_per_split", ctypes.c_int32), ("scale_log2", ctypes.c_float)]


@pytest.fixture(scope="module", params=["tables", "no_tables"])
def emulated(request, tmp_path_factory):
    """The kernel compiled for the host (csrc/cuda/host_emulation.cpp), as a function with
    the contract's signature; built as shipped (1- and 2-bit key codes through nibble
    tables where they fit) and with no table room (every code multiplied one by one)."""
    if shutil.which("g++") is None or _cuda_home() is None:
        pytest.skip("g++ or the CUDA headers missing")
    lib_path = tmp_path_factory.mktemp("emu") / f"lowbit_emulated_{request.param}.so"
    defines = ["-DLOWBIT_TABLE_BYTES=0"] if request.param == "no_tables" else []
    proc = subprocess.run(["g++", "-O2", "-std=c++20", "-shared", "-fPIC", *defines,
                           f"-I{_cuda_home() / 'include'}", f"-I{SRC}",
                           str(SRC / "host_emulation.cpp"), "-o", str(lib_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lib = ctypes.CDLL(str(lib_path))
    lib.lowbit_packed_attention_emulated_check.restype = ctypes.c_char_p
    assert lib.lowbit_args_size() == ctypes.sizeof(_Args)

    def run(query, q_start, pages, layout, table, ng, skip, scale, num_splits, out, lse):
        fmt = page_format(layout)
        n, Hq, D = query.shape
        splits, per_split = cuda_ops.split_plan(table.shape[1], num_splits)
        keep = dict(  # the tensors the struct points into
            query=query.float().contiguous(), q_start=q_start.long().contiguous(),
            pages=fmt.flat_pages(pages), table=table.int().contiguous(),
            ng=ng.int().contiguous(), skip=skip.int().contiguous(),
            fft=cuda_ops.fft_matrix("inverse_t", fmt.n1, fmt.n1, "cpu") if fmt.fft else None,
            part_out=torch.full((splits, n, Hq, D), float("nan")),
            part_lse=torch.full((splits, n, Hq), float("nan")))
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        args = _Args(
            _Format(*cuda_ops.format_values(fmt)), ptr(keep["query"]), keep["query"].stride(0),
            keep["query"].stride(1), ptr(keep["q_start"]), q_start.numel() - 1, n, Hq,
            ptr(keep["pages"]), keep["pages"].stride(0), keep["pages"].stride(1),
            ptr(keep["table"]), keep["table"].stride(0), ptr(keep["ng"]), ptr(keep["skip"]),
            ptr(keep["fft"]), ptr(out), ptr(lse), ptr(keep["part_out"]), ptr(keep["part_lse"]),
            splits, per_split, scale * cuda_ops.LOG2E)
        reason = lib.lowbit_packed_attention_emulated_check(ctypes.byref(args))
        assert reason is None, reason
        rc = lib.lowbit_packed_attention_emulated(ctypes.byref(args))
        assert rc == 0, {1: "refused", 2: "threads wait at a barrier that others never reach"}[rc]

    return run


CASES = [  # scheme, T, H, Hq, splits
    ("vidkv", 16, 2, 6, 1), ("vidkv_stp", 32, 1, 4, 3), ("kivi2", 16, 3, 9, 2),
    ("vidkv_k2v2", 32, 2, 2, None), ("kivi4", 16, 1, 16, 2), ("vidkv_k15v2", 16, 2, 6, 2)]
#: the kernel's other paths: each head-count instantiation (1, 2, 4 for 3-4, 8 for 5-8, 16
#: for 9-16), 1, 2 or 4 lanes per token, two tokens per thread (T = 256), T not a power of two,
#: bit-unaligned code rows, 8-bit codes, per-token value scales of part of a head, 1, 2
#: or 4 value channels per thread
PATH_CASES = [
    ("vidkv", 128, 1, 3, None), ("vidkv_k03_sign", 48, 1, 5, 3), ("vidkv_stp", 256, 1, 1, 2),
    ("kivi2", 64, 2, 4, None), ("kivi8_g16", 16, 1, 12, 4), ("vidkv_k075", 32, 2, 16, 3),
    ("vidkv_k2v2", 64, 1, 4, 2),
    # 2 value channels per thread (8 heads): STP, per-token and per-channel KIVI values;
    # 4 per thread with 8-bit codes in per-token groups of 16 channels
    ("vidkv_stp", 32, 1, 8, 2), ("kivi2", 32, 1, 6, None), ("vidkv_k2v2", 16, 1, 7, 2),
    ("kivi8_g16", 32, 2, 4, 2)]


def _run_case(scheme, T, H, Hq, splits, call, device, n_groups=None, q_rows=None, skip=None):
    # default: long context with a skipped prefix and 2 rows; empty context; context
    # entirely skipped; a longer one; a partly skipped group; a request with no rows
    if n_groups is None:
        n_groups, q_rows = [5, 0, 1, 9, 3, 2], [2, 1, 1, 1, 3, 0]
        skip = [3, 0, T, 4, 2 * T + 5, 0]
    layout, pages, table, ng, q_start, query, skip = _case(scheme, T, H, Hq, n_groups, q_rows,
                                                           skip, T + Hq)
    ref_out, ref_lse = packed_attention_reference(query, q_start, pages, layout, table, ng, skip,
                                                  0.125)
    out = torch.full(ref_out.shape, float("nan"), device=device)
    lse = torch.full(ref_lse.shape, 777.0, device=device)
    dev = lambda x: x.to(device)  # noqa: E731
    call(dev(query), dev(q_start), dev(pages), layout, dev(table), dev(ng), dev(skip), 0.125,
         splits, out, lse)
    torch.testing.assert_close(out.cpu(), ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scheme,T,H,Hq,splits", CASES + PATH_CASES)
def test_kernel_code_on_the_host_matches_reference(emulated, scheme, T, H, Hq, splits):
    _run_case(scheme, T, H, Hq, splits, emulated, "cpu")


@pytest.mark.parametrize("scheme,Hq", [("vidkv", 3), ("kivi2", 8)])
def test_kernel_code_on_the_host_long_context_many_splits(emulated, scheme, Hq):
    """37 and 23 groups over 9 splits (several groups per split, the double buffer's
    prefetch across them), a skipped prefix, 1 and 2 rows."""
    _run_case(scheme, 16, 1, Hq, 9, emulated, "cpu", n_groups=[37, 23], q_rows=[1, 2],
              skip=[40, 0])


@pytest.mark.gpu
@pytest.mark.parametrize("scheme,T,H,Hq,splits", CASES + PATH_CASES + [("vidkv", 64, 8, 32, None)])
def test_cuda_kernel_matches_reference(scheme, T, H, Hq, splits):
    def call(query, q_start, pages, layout, table, ng, skip, scale, num_splits, out, lse):
        cuda_ops.packed_attention(query, q_start, pages, layout, table, ng, skip, scale,
                                  num_splits=num_splits, out=out, lse=lse)
    _run_case(scheme, T, H, Hq, splits, call, "cuda")
