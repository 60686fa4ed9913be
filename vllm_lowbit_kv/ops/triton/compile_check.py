"""Compile the Triton kernels for NVIDIA targets without a GPU (CI's GPU-lowering check).

    python -m vllm_lowbit_kv.ops.triton.compile_check --arch 80 90 --scheme vidkv_stp kivi2

Runs the public wrappers on small CPU inputs with the launches intercepted
(:data:`vllm_lowbit_kv.ops.triton._jit.launch_hook`), then compiles every launched kernel with
its real arguments and constants down to a cubin for each ``sm_<arch>`` (the
NVIDIA backend and ptxas ship with the triton wheel; no driver is needed) and
prints registers and spill bytes per kernel (one JSON line each). Must run
without TRITON_INTERPRET (interpreted kernels cannot be compiled).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

_SIG = {torch.uint8: "*u8", torch.float32: "*fp32", torch.bfloat16: "*bf16",
        torch.float16: "*fp16", torch.int32: "*i32", torch.int64: "*i64"}


def _signature_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return _SIG[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"kernel argument of type {type(value).__name__}")


def collect_launches(scheme: str, head_dim: int = 64, block_tokens: int = 64) -> list:
    """(kernel, args, kwargs) of every launch that quantize-and-store and attention (split
    and unsplit) make for a small layout of ``scheme``."""
    from ...schemes import get_scheme
    from ..page_format import PageFormat
    from . import _jit
    from .attention_kernel import packed_attention
    from .store_kernel import quantize_and_store

    launches = []
    _jit.launch_hook = lambda kernel, grid, args, kwargs: launches.append((kernel, args, kwargs))
    try:
        kc, vc = get_scheme(scheme).codecs(head_dim, block_tokens)
        fmt = PageFormat.build(kc, vc, num_kv_heads=2)
        pages = torch.zeros(4, fmt.H, fmt.head_bytes, dtype=torch.uint8)
        k = torch.randn(2, block_tokens, 2, head_dim).bfloat16()
        quantize_and_store(k, k.clone(), torch.tensor([0, 1]), pages, fmt,
                           torch.rand(2, block_tokens, 2))
        table = torch.zeros(2, 8, dtype=torch.int32)
        q = torch.randn(3, 8, head_dim).bfloat16()
        packed_attention(q, torch.tensor([0, 2, 3]), pages, fmt, table, torch.tensor([3, 8]),
                         torch.tensor([0, 0]), 0.125, num_splits=2)
    finally:
        _jit.launch_hook = None
    return launches


def _resources(cubin: bytes) -> dict:
    """Registers and spill (stack) bytes of a cubin, from cuobjdump."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], check=True,
                              capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return {"registers": int(m.group(1)), "stack_bytes": int(m.group(2))} if m else {}


def compile_for(arch: int, launches: list) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    results = []
    for kernel, args, kwargs in launches:
        kwargs = dict(kwargs)
        options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages", "enable_fp_fusion")
                   if key in kwargs}
        names = kernel.arg_names
        signature = {names[i]: _signature_type(a) for i, a in enumerate(args)}
        signature.update({key: "constexpr" for key in kwargs})
        compiled = triton.compile(ASTSource(kernel, signature, constexprs=kwargs),
                                  target=GPUTarget("cuda", arch, 32), options=options)
        results.append({"kernel": kernel.__name__, "arch": f"sm_{arch}",
                        **_resources(compiled.asm["cubin"])})
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    ap.add_argument("--scheme", nargs="+", default=["vidkv_stp", "kivi2"])
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("compile_check: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")
    for scheme in args.scheme:
        launches = collect_launches(scheme)
        for arch in args.arch:
            for row in compile_for(arch, launches):
                print(json.dumps({"scheme": scheme, **row}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
