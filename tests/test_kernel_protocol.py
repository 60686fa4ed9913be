"""Every packed-attention implementation against one matrix, through its protocol.

The matrix: every registered scheme x device (cpu, cuda) x query heads per KV
head (1, 3, 8, and 32, past the CUDA kernel's 16) x head size (64, 128, 96).
Each implementation's ``supports`` must name exactly the limits its module
documents (written out again here, in :func:`documented_limit`, so a change
of either shows). What an implementation accepts must really run: on the CPU
``cpp`` and ``torch`` on small random pages, against the reference (and the
reference against dense attention over the codecs' decoded K/V); the GPU
implementations on a CUDA device (marked ``gpu``). What it refuses by format
or GQA its attention refuses too, with the same reason, before any kernel runs.
"""

from __future__ import annotations

import pytest
import torch

from vllm_lowbit_kv.codecs.base import ModelIdentity
from vllm_lowbit_kv.ops import (AUTO_ORDER, IMPLEMENTATIONS, KernelImplementation, cuda,
                                packed_attention_reference, reference, select_implementation)
from vllm_lowbit_kv.ops.page_format import PageFormat
from vllm_lowbit_kv.schemes import SCHEMES, get_scheme

from test_cpu_kernel import fixed_point_out_tol

DEVICES = ("cpu", "cuda")
GQAS = (1, 3, 8, 32)
HEAD_SIZES = (64, 128, 96)
H, T = 2, 16
#: the schemes whose codecs the C++, Triton and CUDA kernels read (their module docs)
KERNEL_SCHEMES = {"kivi2", "kivi4", "kivi8", "vidkv", "vidkv_paper", "vidkv_retrieval",
                  "vidkv_stp", "vidkv_k2v2", "vidkv_k15v2"}
#: and those only the C++ kernel reads: STP on keys, RVQ
CPP_ONLY_SCHEMES = {"vidkv_visual", "rvq", "rvq8x256", "rvq4x256", "rvq2x256"}
CUDA_AVAILABLE = torch.cuda.is_available()


def documented_limit(impl: str, scheme: str, device: str, gqa: int, D: int) -> str | None:
    """A phrase of the reason ``impl`` must give for this case, None when it documents no
    limit that the case hits."""
    if impl == "torch":
        return None
    if impl == "cpp":
        if device != "cpu":
            return f"runs on the CPU, not {device}"
        if scheme not in KERNEL_SCHEMES | CPP_ONLY_SCHEMES:
            return "reads KIVI per-channel / VidKV / RVQ keys"
        return None  # head sizes here are multiples of 16; any GQA
    if device != "cuda":
        return f"on CUDA devices, not {device}"
    if scheme == "vidkv_visual":
        return "VidKV keys with STP"
    if scheme not in KERNEL_SCHEMES:
        return "reads KIVI per-channel / VidKV keys"
    if D & (D - 1):
        return f"head_dim {D} (a power of two"
    if impl == "cuda" and gqa > cuda.MAX_GQA:
        return f"{gqa} query heads per KV head"
    return None


@pytest.fixture(scope="module")
def formats(rvq_codebook_file):
    """(scheme, head size) -> the PageFormat of its pages (2 groups per block, 2 KV heads);
    RVQ schemes with seeded random codebooks."""
    made = {}

    def get(scheme: str, D: int) -> PageFormat:
        if (scheme, D) not in made:
            s = get_scheme(scheme)
            if scheme.startswith("rvq"):
                model = ModelIdentity("protocol-test", 1, H, D)
                s = s.with_params(codebook=str(rvq_codebook_file(scheme, model)))
            kc, vc = s.codecs(D, T, layer=0)
            made[scheme, D] = PageFormat.build(kc, vc, H, groups_per_block=2)
        return made[scheme, D]

    return get


def random_case(fmt: PageFormat, gqa: int, seed: int, device: str = "cpu"):
    """Pages with three requests' groups stored by the reference (the rest random bytes),
    their decoded K/V, and the contract's arguments."""
    g = torch.Generator().manual_seed(seed)
    n_groups, q_rows, skip = [3, 0, 2], [2, 1, 1], [3, 0, 0]
    total = sum(n_groups)
    blocks = total // fmt.groups_per_block + 2
    pages = torch.randint(0, 256, (blocks, H, fmt.head_bytes), dtype=torch.uint8, generator=g)
    gids = torch.randperm(blocks * fmt.groups_per_block, generator=g)[:total]
    k = torch.randn(total, T, H, fmt.D, generator=g) * 2
    v = torch.randn(total, T, H, fmt.D, generator=g)
    rel = torch.rand(total, T, H, generator=g)
    reference.store(k, v, gids, pages, fmt, rel)
    decoded = fmt.decode(fmt.encode(k, v, rel))  # [total, T, H, D] each
    table = torch.zeros(len(n_groups), max(n_groups), dtype=torch.int64)
    at = 0
    for r, n in enumerate(n_groups):
        table[r, :n] = gids[at:at + n]
        at += n
    q_start = torch.tensor([0] + q_rows).cumsum(0)
    query = torch.randn(int(q_start[-1]), H * gqa, fmt.D, generator=g)
    args = (query, q_start, pages, fmt, table, torch.tensor(n_groups), torch.tensor(skip), 0.125)
    on = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    return on, decoded, n_groups


def dense_attention(query, q_start, decoded, n_groups, skip, scale):
    """Softmax attention of each request's rows over its decoded tokens, written plainly."""
    k_all, v_all = decoded
    G = query.shape[1] // H
    out = torch.zeros(query.shape)
    lse = torch.full(query.shape[:2], float("-inf"))
    first = 0
    for r, n in enumerate(n_groups):
        rows = slice(int(q_start[r]), int(q_start[r + 1]))
        D = query.shape[2]
        k = k_all[first:first + n].reshape(n * T, H, D)[int(skip[r]):]
        v = v_all[first:first + n].reshape(n * T, H, D)[int(skip[r]):]
        first += n
        if not len(k):
            continue
        for h in range(query.shape[1]):
            s = query[rows, h] @ k[:, h // G].T * scale  # [rows, S]
            lse[rows, h] = torch.logsumexp(s, dim=-1)
            out[rows, h] = torch.softmax(s, dim=-1) @ v[:, h // G]
    return out, lse


def test_every_implementation_follows_the_protocol():
    assert set(IMPLEMENTATIONS) == set(AUTO_ORDER)
    for name, impl in IMPLEMENTATIONS.items():
        assert isinstance(impl, KernelImplementation) and impl.name == name


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_supports_names_the_documented_limits(formats, scheme):
    for D in HEAD_SIZES:
        fmt = formats(scheme, D)
        for name, impl in IMPLEMENTATIONS.items():
            for device in DEVICES:
                for gqa in GQAS:
                    reason = impl.supports(fmt, device, gqa)
                    limit = documented_limit(name, scheme, device, gqa, D)
                    case = f"{name} {scheme} D={D} {device} gqa={gqa}: {reason!r}"
                    if limit is not None:
                        assert reason and limit in reason, case
                    elif device == "cuda" and name in ("cuda", "triton") and not CUDA_AVAILABLE:
                        assert reason == "no CUDA device is available", case
                    else:
                        assert reason is None, case


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_accepted_cases_run_on_the_cpu(formats, scheme):
    """torch against dense attention over the decoded K/V, cpp against torch; a format cpp
    refuses is refused by its attention with the same reason."""
    for D in HEAD_SIZES:
        fmt = formats(scheme, D)
        for gqa in GQAS:
            args, decoded, n_groups = random_case(fmt, gqa, seed=D + gqa)
            assert IMPLEMENTATIONS["torch"].supports(fmt, "cpu", gqa) is None
            want_out, want_lse = packed_attention_reference(*args)
            dense_out, dense_lse = dense_attention(args[0], args[1], decoded, n_groups, args[6],
                                                   args[7])
            torch.testing.assert_close(want_out, dense_out, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(want_lse, dense_lse, atol=1e-4, rtol=1e-4)
            reason = IMPLEMENTATIONS["cpp"].supports(fmt, "cpu", gqa)
            if reason is None:
                out, lse = IMPLEMENTATIONS["cpp"].attention(*args)
                torch.testing.assert_close(out, want_out, **fixed_point_out_tol(fmt, decoded[1]))
                torch.testing.assert_close(lse, want_lse, atol=5e-5, rtol=0)
            else:
                with pytest.raises(ValueError) as refused:
                    IMPLEMENTATIONS["cpp"].attention(*args)
                assert reason in str(refused.value)


@pytest.mark.parametrize("scheme", ["kivi2", "vidkv", "vidkv_stp", "rvq4x256"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_reads_q_m_and_returns_o_m_transposed(formats, scheme, dtype):
    """The contract's ``rotation``: attention with ``rotation=M`` equals attention of the
    query ``q M`` (float32), its output times ``Mᵀ``, for the reference (rotating around
    its decode) and for the C++ kernel (rotating as it loads queries and writes rows).
    M is a random orthonormal matrix, not a Hadamard one, so nothing may lean on M's
    symmetry; rows without packed keys stay 0."""
    for D in (64, 128):
        fmt = formats(scheme, D)
        m, _ = torch.linalg.qr(torch.randn(D, D, generator=torch.Generator().manual_seed(D)))
        for gqa in (1, 3):
            args, decoded, _ = random_case(fmt, gqa, seed=7 * D + gqa)
            # M spreads an output row's error over its D channels: at most sqrt(D) times
            out_tol = fixed_point_out_tol(fmt, decoded[1] * D**0.5)
            query = args[0].to(dtype)
            rest = args[1:]
            plain_out, plain_lse = packed_attention_reference.__wrapped__(query.float() @ m,
                                                                          *rest)
            want_out = plain_out @ m.T
            out, lse = packed_attention_reference(query, *rest, rotation=m)
            torch.testing.assert_close(out, want_out, atol=1e-6, rtol=0)
            torch.testing.assert_close(lse, plain_lse, atol=0, rtol=0)
            if IMPLEMENTATIONS["cpp"].supports(fmt, "cpu", gqa) is None:
                out, lse = IMPLEMENTATIONS["cpp"].attention(query, *rest, rotation=m)
                torch.testing.assert_close(out, want_out, **out_tol)
                torch.testing.assert_close(lse, plain_lse, atol=5e-5, rtol=0)
                assert not out[int(rest[0][1]):int(rest[0][2])].any()  # request 1: no groups
                # the kernel takes M with Mᵀ made once per tensor: M changed in place is read
                m.copy_(m.flip(0))
                want_out = packed_attention_reference(query, *rest, rotation=m)[0]
                out, _ = IMPLEMENTATIONS["cpp"].attention(query, *rest, rotation=m)
                torch.testing.assert_close(out, want_out, **out_tol)
                with torch.inference_mode():  # as vLLM runs it: M without a version counter
                    m_inf = m.clone()
                    out, _ = IMPLEMENTATIONS["cpp"].attention(query, *rest, rotation=m_inf)
                torch.testing.assert_close(out, want_out, **out_tol)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_gpu_kernels_refuse_what_supports_refuses(formats, scheme):
    """Cases the GPU kernels refuse by format or GQA are refused by their attention (and
    the Triton store) with the reason ``supports`` gives, before any kernel runs."""
    for D in HEAD_SIZES:
        fmt = formats(scheme, D)
        for name in ("cuda", "triton"):
            impl = IMPLEMENTATIONS[name]
            for gqa in GQAS:
                reason = impl.supports(fmt, "cuda", gqa)
                if reason is None or reason == "no CUDA device is available":
                    continue
                pages = torch.zeros(1, H, fmt.head_bytes, dtype=torch.uint8)
                one = torch.ones(1, dtype=torch.int64)
                with pytest.raises(ValueError) as refused:
                    impl.attention(torch.randn(1, H * gqa, D), torch.tensor([0, 1]), pages, fmt,
                                   torch.zeros(1, 1, dtype=torch.int64), one, 0 * one, 0.125)
                assert reason in str(refused.value), (name, scheme, D, gqa)
                if name == "triton":
                    k = torch.zeros(1, T, H, D)
                    with pytest.raises(ValueError, match="unsupported page format"):
                        impl.store(k, k, 0 * one, pages, fmt)


def test_selection_checks_every_limit(formats):
    vidkv, quantile = formats("vidkv", 64), formats("quantile1", 64)
    assert select_implementation(vidkv, "cpu", gqa=32)[0] == "cpp"
    assert select_implementation(quantile, "cpu", gqa=3)[0] == "torch"
    with pytest.raises(ValueError, match="'cuda' cannot run .* 32 query heads per KV head"):
        select_implementation(vidkv, "cuda", "cuda", gqa=32)
    with pytest.raises(ValueError, match="'triton' cannot run .*head_dim 96"):
        select_implementation(formats("vidkv", 96), "cuda", "triton", gqa=1)
    with pytest.raises(ValueError, match="gqa must be"):
        select_implementation(vidkv, "cpu", "torch", gqa=0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n in AUTO_ORDER if n != "cpp"])
@pytest.mark.parametrize("scheme", sorted(KERNEL_SCHEMES))
def test_accepted_cases_run_on_cuda(formats, scheme, name):
    """Every implementation that accepts a case on CUDA runs it and matches the reference
    computed on the CPU (one test per implementation, and the case in the message: with
    CUDA_LAUNCH_BLOCKING=1, as bench/gpu.sh runs it, a faulting kernel names itself)."""
    impl = IMPLEMENTATIONS[name]
    for D in HEAD_SIZES:
        fmt = formats(scheme, D)
        for gqa in GQAS:
            if impl.supports(fmt, "cuda", gqa) is not None:
                continue
            args, _, _ = random_case(fmt, gqa, seed=D + gqa)
            want_out, want_lse = packed_attention_reference(*args)
            on_gpu, _, _ = random_case(fmt, gqa, seed=D + gqa, device="cuda")
            case = f"{name} {scheme} D={D} gqa={gqa}"
            try:
                out, lse = impl.attention(*on_gpu)
                torch.cuda.synchronize()
            except RuntimeError as e:  # a CUDA error: say which case raised it
                raise AssertionError(f"{case}: {e}") from e
            torch.testing.assert_close(out.cpu(), want_out, atol=2e-5, rtol=1e-4,
                                       msg=lambda m, case=case: f"{case}: {m}")
            torch.testing.assert_close(lse.cpu(), want_lse, atol=1e-5, rtol=1e-5,
                                       msg=lambda m, case=case: f"{case}: {m}")
