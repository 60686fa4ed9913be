"""xformers' decode attention, the GPU baselines of ``bench.kernels``: same shape, other formats.

* ``xformers_bf16``: ``xformers.ops.memory_efficient_attention_forward`` over bf16 K/V
  (xformers dispatches; the operator it picks is recorded);
* ``xformers_int4_g<N>``: ``xformers.ops.fmha.triton_splitk.FwOp``, the Split-K decoder that
  reads int4 K/V and dequantizes them in the kernel (the closest low-bit GPU decode that
  ships in a wheel), with ``N`` groups of scales per head row (``N`` in 1, 2, 4, 8; group
  size ``head_dim / N``). It is pure Triton, so it is called through ``FwOp.apply``
  directly (:func:`int4_decode`): the dispatcher refuses every operator, this one
  included, when the wheel's C++/CUDA extension does not load (a wheel built for another
  torch), while the bf16 row then has no operator at all and is recorded as unavailable
  (:func:`bf16_unavailable`).

The int4 layout is the one the kernel reads (its docstring, and
``xformers/benchmarks/benchmark_attn_decoding.py``'s ``quantize_kv_int4``): each
``head_dim`` row of K or V is ``N`` int32 words of quantization coefficients (two float16,
scale in the low half, shift in the high half, value = code * scale + shift, codes 0..15
spanning the group's min..max), then ``head_dim / 8`` int32 words of codes, element ``2i``
in the low nibble of byte ``i``. So a row costs ``4 N + head_dim / 2`` bytes (for head_dim
64: 4.5 bits per element at N = 1, 5 at N = 2, 6 at N = 4). Queries are float16, as in
xformers' own int4 benchmark and tests (checked here in Triton's interpreter: the kernel's
output equals float32 attention over the dequantized K/V).

GQA as xformers takes it (BMGHK): queries ``[B, 1, G, Hq / G, D]``, K/V
``[B, M, G, 1, D]`` expanded (stride 0) over the query heads of their group.

Everything here imports xformers lazily: :func:`unavailable` says why it cannot run.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Callable

import torch

INT4_GROUPS = (1, 2, 4, 8)
BF16 = "xformers_bf16"
INT4_PREFIX = "xformers_int4_g"


def kinds(groups=(1, 2)) -> list[str]:
    return [BF16] + [f"{INT4_PREFIX}{g}" for g in groups]


def int4_groups(kind: str) -> int | None:
    """N of an ``xformers_int4_g<N>`` baseline name, None for another name; ValueError for
    an N the kernel does not take."""
    if not kind.startswith(INT4_PREFIX):
        return None
    n = int(kind[len(INT4_PREFIX):])
    if n not in INT4_GROUPS:
        raise ValueError(f"{kind}: xformers' int4 decoder takes {INT4_GROUPS} groups per row")
    return n


def unavailable() -> str | None:
    """None when xformers can be imported, else why not (without importing it when absent)."""
    if importlib.util.find_spec("xformers") is None:
        return "xformers is not installed (pip install xformers==0.0.35: the [cuda] extra)"
    try:
        import xformers.ops  # noqa: F401
        from xformers.ops.fmha import triton_splitk  # noqa: F401
    except Exception as e:  # a wheel built for another torch
        return f"xformers does not import: {type(e).__name__}: {e}"
    return None


def version() -> str | None:
    if importlib.util.find_spec("xformers") is None:
        return None
    try:
        import xformers

        return xformers.__version__
    except Exception as e:
        return f"unimportable ({type(e).__name__})"


def quantize_int4(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``x`` [..., D] -> int32 [..., groups + D / 8] in the layout of the module doc."""
    D = x.shape[-1]
    assert D % (8 * groups) == 0, (D, groups)
    xg = x.float().reshape(*x.shape[:-1], groups, D // groups)
    lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).to(torch.float16)
    shift = lo.to(torch.float16)
    codes = ((xg - shift.float()) / scale.float().clamp_min(1e-8) + 0.5).clamp(0, 15)
    codes = codes.to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., groups, D / groups / 2]
    coeffs = torch.cat([scale.view(torch.uint8), shift.view(torch.uint8)], -1)  # [..., groups, 4]
    row = torch.cat([coeffs.flatten(-2), packed.flatten(-2)], -1)  # [..., 4 groups + D / 2] bytes
    return row.contiguous().view(torch.int32)


def dequantize_int4(q: torch.Tensor, groups: int) -> torch.Tensor:
    """The inverse of :func:`quantize_int4` up to rounding: int32 [..., groups + D / 8] ->
    float32 [..., D]."""
    b = q.contiguous().view(torch.uint8)
    coeffs = b[..., :4 * groups].contiguous().view(torch.float16).float()
    coeffs = coeffs.reshape(*q.shape[:-1], groups, 2)
    codes = b[..., 4 * groups:]
    c = torch.stack([codes & 0xF, codes >> 4], -1).flatten(-2).float()
    c = c.reshape(*q.shape[:-1], groups, -1)
    return (c * coeffs[..., :1] + coeffs[..., 1:]).flatten(-2)


@dataclass
class Run:
    """One baseline at one shape: ``run()`` is what is timed; ``bytes`` what it must read
    (K and V); ``check()`` its largest absolute error against float32 attention over the
    K/V it reads (dequantized for int4)."""

    run: Callable[[], object]
    bytes: int
    check: Callable[[], float]
    info: dict = field(default_factory=dict)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 attention: q [B, 1, G, g, D], k/v [B, M, G, D] -> [B, 1, G, g, D]."""
    s = torch.einsum("bqgid,bmgd->bgiqm", q.float(), k.float()) * scale
    return torch.einsum("bgiqm,bmgd->bqgid", s.softmax(-1), v.float())


def build(kind: str, context: int, batch: int, kv_heads: int, q_heads: int, head_dim: int,
          device: torch.device, seed: int = 0) -> Run:
    """The baseline ``kind`` (:func:`kinds`) for ``batch`` requests of ``context`` tokens."""
    import xformers.ops as xops
    from xformers.ops import fmha

    B, M, G, g, D = batch, context, kv_heads, q_heads // kv_heads, head_dim
    scale = D ** -0.5
    gen = torch.Generator(device=device).manual_seed(seed)
    groups = int4_groups(kind)
    dtype = torch.bfloat16 if groups is None else torch.float16
    q = torch.randn(B, 1, G, g, D, device=device, dtype=dtype, generator=gen)
    k = torch.randn(B, M, G, 1, D, device=device, dtype=dtype, generator=gen)
    v = torch.randn(B, M, G, 1, D, device=device, dtype=dtype, generator=gen)
    if groups is None:
        ke, ve = k.expand(-1, -1, -1, g, -1), v.expand(-1, -1, -1, g, -1)
        op = fmha._dispatch_fw(fmha.Inputs(query=q, key=ke, value=ve, scale=scale), False)

        def check() -> float:
            out = xops.memory_efficient_attention_forward(q, ke, ve, scale=scale)
            ref = _reference(q, k[:, :, :, 0], v[:, :, :, 0], scale)
            return (out.float() - ref).abs().max().item()

        return Run(lambda: xops.memory_efficient_attention_forward(q, ke, ve, scale=scale),
                   2 * k.numel() * k.element_size(), check,
                   dict(op=getattr(op, "NAME", op.__name__), dtype="bfloat16"))
    from xformers.ops.fmha import triton_splitk

    kq, vq = quantize_int4(k, groups), quantize_int4(v, groups)  # [B, M, G, 1, groups + D / 8]
    del k, v
    op = type(f"FwOp_int4_g{groups}", (triton_splitk.FwOp,), {"NUM_GROUPS": groups})
    ke, ve = kq.expand(-1, -1, -1, g, -1), vq.expand(-1, -1, -1, g, -1)
    reasons = int4_refusals(op, fmha.Inputs(query=q, key=ke, value=ve, scale=scale))
    if reasons:
        raise RuntimeError(f"{kind}: xformers refuses the shape: {'; '.join(reasons)}")

    def run():
        return int4_decode(op, q, ke, ve, scale)

    def check() -> float:
        kd, vd = (dequantize_int4(x[:, :, :, 0], groups) for x in (kq, vq))
        return (run().float() - _reference(q, kd, vd, scale)).abs().max().item()

    return Run(run, 2 * kq.numel() * kq.element_size(), check,
               dict(op=f"triton_splitk.FwOp NUM_GROUPS={groups}", dtype="int4 K/V, float16 q",
                    call=DIRECT_CALL, group_size=D // groups,
                    bits_per_element=8 * kq.shape[-1] * 4 / D))


#: how the int4 decoder is called (recorded with its rows)
DIRECT_CALL = ("FwOp.apply directly: the dispatcher refuses every operator when xformers' "
               "C++/CUDA extension does not load, this pure-Triton one included")
#: the refusal that :func:`int4_refusals` drops: the dispatcher's check that the C++/CUDA
#: extension loaded, which the Triton split-K decoder does not use
_NOT_BUILT = "wasn't build with CUDA support"


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def int4_refusals(op, inp) -> list[str]:
    """Why ``op`` (a ``triton_splitk.FwOp`` subclass) cannot run ``inp``, without the
    dispatcher's built-with-CUDA check (and, in Triton's interpreter, its device check)."""
    return [r for r in op.not_supported_reasons(inp)
            if _NOT_BUILT not in r and not (_interpreting() and r.startswith("device="))]


def int4_decode(op, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                ) -> torch.Tensor:
    """xformers' Split-K decoder over int4 K/V, called as
    ``memory_efficient_attention_forward(..., op=op)`` calls it (validate, normalize to
    BMHK, ``op.apply``, reshape back), minus the operator check :func:`int4_refusals`
    made once."""
    from xformers.ops import fmha

    inp = fmha.Inputs(query=q, key=k, value=v, scale=scale)
    inp.validate_inputs()
    shape = inp.normalize_bmhk()
    out, *_ = op.apply(inp, needs_gradient=False)
    return out.reshape(shape)


def bf16_unavailable(device: torch.device, head_dim: int = 64) -> str | None:
    """None when ``memory_efficient_attention`` has an operator for a bf16 decode here, else
    why not (e.g. the wheel's C++/CUDA extension was built for another torch)."""
    from xformers.ops import fmha

    q = torch.zeros(1, 1, 1, 1, head_dim, device=device, dtype=torch.bfloat16)
    k = torch.zeros(1, 16, 1, 1, head_dim, device=device, dtype=torch.bfloat16)
    try:
        fmha._dispatch_fw(fmha.Inputs(query=q, key=k, value=k), False)
    except NotImplementedError as e:
        built = getattr(fmha.common, "_built_with_cuda", True)
        why = ("xformers' C++/CUDA extension does not load (the wheel was built for another "
               "torch / CUDA)" if not built else str(e).splitlines()[0])
        return f"no memory_efficient_attention operator for bf16: {why}"
    return None


def bf16_bytes(context: int, batch: int, kv_heads: int, head_dim: int) -> int:
    """Bytes of bf16 K and V of a cell (for memory estimates)."""
    return 2 * batch * context * kv_heads * head_dim * 2
