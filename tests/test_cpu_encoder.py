"""The C++ encoder (csrc/cpu/encode_states.cpp, vllm_lowbit_kv.ops.cpu.encode_states /
store) against the codecs (the reference store), field by field (tests/_state_agreement.py:
min-max codes, scales, zeros and masks bit-identical; codes decided by a float32 mean only
at ties, fp16 levels within one step; RVQ indices up to float32 ties of two codes'
distances); pages poisoned first, nothing else written. Also:
where the serving path takes it (bf16 / fp16 models) and where it does not (float32, STP).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_lowbit_kv.codecs.bitpack import unpack_bits
from vllm_lowbit_kv.ops import cpu, reference

from _state_agreement import assert_states_agree, fields
from test_cpu_kernel import built, layout_for  # noqa: F401 (built: the library, autouse)

POISON = 0xAB
#: (scheme, codec overrides): every format the encoder writes, and its codec variants
FORMATS = [
    ("vidkv", {}), ("vidkv_paper", {}), ("kivi2", {}), ("kivi4", {}), ("vidkv_k2v2", {}),
    ("vidkv_k15v2", {}), ("vidkv", {"fft": False}), ("vidkv", {"one_bit": "sign"}),
    ("vidkv", {"one_bit": "minmax", "k": 0.75}), ("vidkv", {"k": 0.25}),
    ("kivi2", {"group_size": 16}), ("kivi4", {"bits": 8}), ("vidkv", {"gamma": 0.4}),
]
#: RVQ schemes (seeded random codebooks): 11-bit indices (rvq) and 8-bit ones
RVQ_SCHEMES = ["rvq", "rvq8x256", "rvq4x256", "rvq2x256"]
#: formats the encoder leaves to the codecs (STP needs the relevance scores)
CODEC_ONLY = [("vidkv_stp", {}), ("vidkv_visual", {})]


def kv(E, T, H, D, dtype, seed, key_scale=3.0):
    g = torch.Generator().manual_seed(seed)
    offset = torch.randn(D, generator=g) * 2  # per-channel offsets, as real keys have
    k = torch.randn(E, T, H, D, generator=g) * key_scale + offset
    v = torch.randn(E, T, H, D, generator=g)
    return k.to(dtype), v.to(dtype)


def stored(store, layout, k, v, gids, blocks):
    pages = torch.full(layout.page_shape(blocks), POISON, dtype=torch.uint8)
    store(k, v, gids, pages, layout)
    return pages


def check_store(layout, k, v, seed=0):
    E = k.shape[0]
    blocks = -(-E // layout.groups_per_block) + 1
    gids = torch.randperm(blocks * layout.groups_per_block,
                          generator=torch.Generator().manual_seed(seed))[:E]
    ref = stored(reference.store, layout, k, v, gids, blocks)
    got = stored(cpu.store, layout, k, v, gids, blocks)
    assert cpu.encode_reason(layout.format) is None
    assert_states_agree(layout, layout.read_states(ref, gids), layout.read_states(got, gids),
                        k, v, None)
    untouched = ref.clone()
    layout.write_states(untouched, gids, layout.read_states(got, gids))
    assert torch.equal(got, untouched)  # nothing else written: other states, sinks, padding
    return ref, got, gids


@pytest.mark.parametrize("scheme,params", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encoder_matches_the_codecs(scheme, params, dtype):
    T, H = 32, 3
    layout = layout_for(scheme, params, H, T, 64, sinks=2)  # sink areas stay untouched
    k, v = kv(7, T, H, 64, dtype, seed=len(scheme) + T)
    k[0, :, 1, 5] = 0.75  # a constant channel: zero scale
    v[1, :, 0, 9] = -2.0
    v[2, 3] = v[2, 4]  # duplicated tokens: tied ranges
    k[3, :, 2, 7] = k[3, :, 2, 8]  # tied channel ranges: the lower channel wins
    ref, got, gids = check_store(layout, k, v)
    dk, dv = layout.decode(layout.read_states(got, gids))
    rk, rv = layout.decode(layout.read_states(ref, gids))
    for a, b in ((dk, rk), (dv, rv)):
        assert (a - b).norm() / b.norm() < 1e-3


@pytest.mark.parametrize("scheme,params", FORMATS[:5] + [(s, None) for s in RVQ_SCHEMES[1:2]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_encoder_reads_model_rows_as_they_are(scheme, params, dtype, rvq_codebook_file):
    """bf16 / fp16 groups given as a strided view of a step's rows (a prefill chunk's
    fresh K/V inside its QKV output, paged/write.py) encode to the very bytes of their
    float32 copy."""
    if params is None:
        params = {"codebook": str(rvq_codebook_file(scheme))}
    T, H, D, E = 32, 3, 64, 4
    layout = layout_for(scheme, params, H, T, 64)
    g = torch.Generator().manual_seed(11)
    qkv = (torch.randn(E * T, H + 2 * H, D, generator=g) * 2).to(dtype)  # q, then k and v
    k = qkv[:, H:2 * H].unflatten(0, (E, T))
    v = qkv[:, 2 * H:].unflatten(0, (E, T))
    assert not k.is_contiguous()
    got = cpu.encode_states(layout.format, k, v)
    assert torch.equal(got, cpu.encode_states(layout.format, k.float().contiguous(),
                                              v.float().contiguous()))


@settings(max_examples=25, deadline=None)
@given(scheme=st.sampled_from([f for f in FORMATS]), T=st.sampled_from([8, 16, 48, 128]),
       H=st.integers(1, 4), D=st.sampled_from([16, 32, 64, 128]), E=st.integers(1, 5),
       scale=st.sampled_from([1e-3, 1.0, 300.0]), seed=st.integers(0, 2**16))
def test_encoder_matches_the_codecs_random_shapes(scheme, T, H, D, E, scale, seed):
    name, params = scheme
    layout = layout_for(name, params, H, T, T * 2, D=D)
    k, v = kv(E, T, H, D, torch.float32, seed, key_scale=3.0 * scale)
    check_store(layout, k, v * scale, seed)


def rvq_layout(scheme, codebook_file, H, T):
    return layout_for(scheme, {"codebook": str(codebook_file)}, H, T, 2 * T, sinks=2)


@pytest.mark.parametrize("scheme", RVQ_SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rvq_encoder_matches_the_codecs(scheme, dtype, rvq_codebook_file):
    """The greedy search (Algorithm 1), the fp16 std and the index packing against the
    codecs; a constant token (std 0: scale 1) included."""
    layout = rvq_layout(scheme, rvq_codebook_file(scheme), 3, 32)
    assert cpu.encode_reason(layout.format) is None
    k, v = kv(5, 32, 3, 64, dtype, seed=len(scheme))
    k[1, 4, 2] = 0.5
    v[2, 7, 0] = 0.0
    ref, got, gids = check_store(layout, k, v)
    for a, b in zip(layout.decode(layout.read_states(got, gids)),
                    layout.decode(layout.read_states(ref, gids))):
        assert (a - b).norm() / b.norm() < 1e-3


@pytest.mark.parametrize("group_size,T,D", [(16, 32, 64), (64, 8, 64), (64, 24, 64),
                                             (32, 4, 64), (96, 16, 96), (128, 8, 128)])
def test_rvq_encoder_matches_the_codecs_for_each_search_path(group_size, T, D, rvq_codebook_file):
    """The search's first pass, 16 rows at a time, by vdpbf16ps (group 16, and every group
    where the CPU has AVX-512 BF16 but no AMX) or by AMX tile multiplies (groups of 32, 64,
    96 and 128: one to four tiles of channels), including a last block of fewer rows (T x
    D / group rows: 8, 24, 8 and 8)."""
    from vllm_lowbit_kv.codecs.base import ModelIdentity

    model = ModelIdentity("SmolLM2-135M-Instruct", 30, 3, D)
    path = rvq_codebook_file("rvq4x256", model=model, group_size=group_size)
    layout = layout_for("rvq4x256", {"codebook": str(path), "group_size": group_size}, 3, T,
                        2 * T, sinks=2, D=D)
    k, v = kv(3, T, 3, D, torch.float32, seed=group_size + T)
    check_store(layout, k, v)


@settings(max_examples=15, deadline=None)
@given(scheme=st.sampled_from(RVQ_SCHEMES), T=st.sampled_from([8, 16, 64]), H=st.integers(1, 3),
       E=st.integers(1, 4), scale=st.sampled_from([1e-3, 1.0, 300.0]), seed=st.integers(0, 2**16))
def test_rvq_encoder_matches_the_codecs_random_shapes(rvq_codebook_file, scheme, T, H, E, scale,
                                                     seed):
    layout = rvq_layout(scheme, rvq_codebook_file(scheme), H, T)
    k, v = kv(E, T, H, 64, torch.float32, seed, key_scale=3.0 * scale)
    check_store(layout, k, v * scale, seed)


def twin_codebooks(path, apart, seed=7):
    """rvq4x256 codebooks whose upper half is the lower half moved ``apart``: 0 (exact
    twins), "bf16 step" (every element of a bf16-exact lower half one bf16 step up or
    down) or a float (that fraction of each element, random signs); the file's path."""
    from vllm_lowbit_kv.codecs.base import ModelIdentity
    from vllm_lowbit_kv.codecs.rvq import RVQCodebooks, RVQSettings

    g = torch.Generator().manual_seed(seed)
    shape = (1, 4, 256, 32)
    key, value = (torch.randn(shape, generator=g) * 0.3 for _ in range(2))
    for books in (key, value):
        signs = torch.randint(0, 2, books[:, :, 128:].shape, generator=g) * 2 - 1
        if apart == "bf16 step":
            books.copy_(books.bfloat16().float())
            bits = books[:, :, :128].bfloat16().view(torch.int16)
            books[:, :, 128:] = (bits + signs.to(torch.int16)).view(torch.bfloat16).float()
        else:
            books[:, :, 128:] = books[:, :, :128] * (1 + apart * signs)
    return RVQCodebooks(key, value, ModelIdentity("test", 1, 2, 64),
                        RVQSettings(4, 256, 32, "strided", "contiguous"), {}).save(path)


def test_rvq_encoder_takes_the_lowest_of_tied_codes(tmp_path):
    """Every code has a twin in the codebook's upper half: each search ties exactly, and
    the lowest index wins, as torch's argmin (the codecs) decides."""
    layout = rvq_layout("rvq4x256", twin_codebooks(tmp_path / "twins.safetensors", 0.0), 2, 16)
    k, v = kv(3, 16, 2, 64, torch.float32, seed=2)
    ref, got, gids = check_store(layout, k, v)
    states, kb = layout.read_states(got, gids), layout.format.k_bytes
    for codec, part in ((layout.key_codec, states[..., :kb]),
                        (layout.value_codec, states[..., kb:])):
        codes = fields(codec, part)["codes"]
        assert int(unpack_bits(codes, 8, codes.shape[-1]).max()) < 128


@pytest.mark.parametrize("apart,signs", [(2.0 ** -10, False), ("bf16 step", False),
                                         (2.0 ** -10, True)])
@pytest.mark.parametrize("seed", [0, 1])
def test_rvq_encoder_separates_codes_closer_than_bf16_resolves(tmp_path, apart, signs, seed):
    """Twins a fraction of bf16's step apart, or one step apart with bf16-exact codes: the
    bf16 pass often orders a pair wrongly, by the codes' rounding or by the residual's,
    and only its error bound keeps the nearest among the codes decided in float32 (a
    bound that is too tight picks the other twin). ``signs``: tokens of 32 ones and 32
    minus ones (std 1), so that the first stage's residual is bf16-exact and the codes'
    rounding alone moves the pass."""
    layout = rvq_layout("rvq4x256", twin_codebooks(tmp_path / "near.safetensors", apart, seed),
                        2, 64)
    k, v = kv(4, 64, 2, 64, torch.float32, seed=seed)
    if signs:
        g = torch.Generator().manual_seed(seed)
        ones = torch.tensor([1.0, -1.0]).repeat_interleave(32)
        k, v = (ones[torch.argsort(torch.rand(4, 64, 2, 64, generator=g), -1)] for _ in "kv")
    check_store(layout, k, v, seed)


def test_rvq_encoder_decides_crowds_of_candidates(tmp_path):
    """Every stage's 256 codes one vector with each element moved by 2^-10 of itself at
    random: the bf16 pass tells few of them apart, so a row has dozens of candidates (the
    AMX search lists more than one 32-code word of them) and float32 decides."""
    from vllm_lowbit_kv.codecs.base import ModelIdentity
    from vllm_lowbit_kv.codecs.rvq import RVQCodebooks, RVQSettings

    g = torch.Generator().manual_seed(3)
    key, value = (torch.randn(1, 4, 1, 32, generator=g) * 0.3
                  * (1 + 2.0 ** -10 * torch.randn(1, 4, 256, 32, generator=g)) for _ in "kv")
    path = RVQCodebooks(key, value, ModelIdentity("test", 1, 2, 64),
                        RVQSettings(4, 256, 32, "strided", "contiguous"), {}).save(
                            tmp_path / "crowd.safetensors")
    layout = rvq_layout("rvq4x256", path, 2, 32)
    k, v = kv(3, 32, 2, 64, torch.float32, seed=5)
    check_store(layout, k, v)


@pytest.mark.parametrize("magnitude", [1e-6, 3e4])
def test_encoder_is_bit_exact_for_kivi_at_extreme_magnitudes(magnitude):
    """Tiny ranges (subnormal fp16 scales) and values near the fp16 limit."""
    layout = layout_for("kivi2", {}, 2, 16, 16)
    k, v = (x * magnitude for x in kv(4, 16, 2, 64, torch.float32, seed=3))
    k, v = k.clamp(-65504, 65504), v.clamp(-65504, 65504)
    gids = torch.tensor([3, 0, 2, 1])
    assert torch.equal(stored(cpu.store, layout, k, v, gids, 4),
                       stored(reference.store, layout, k, v, gids, 4))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 7e4])
@pytest.mark.parametrize("which", ["k", "v"])
def test_encoder_refuses_what_fp16_metadata_cannot_hold(bad, which):
    layout = layout_for("vidkv", {}, 2, 16, 16)
    k, v = kv(2, 16, 2, 64, torch.float32, seed=1)
    (k if which == "k" else v)[1, 3, 0, 5] = bad
    with pytest.raises(ValueError, match="65504"):
        cpu.encode_states(layout.format, k, v)


@pytest.mark.parametrize("scheme,params", CODEC_ONLY)
def test_stp_formats_stay_with_the_codecs(scheme, params):
    layout = layout_for(scheme, params, 2, 32, 32)
    assert "STP" in cpu.encode_reason(layout.format)
    k, v = kv(3, 32, 2, 64, torch.float32, seed=5)
    assert cpu.encode_states(layout.format, k, v) is None
    gids = torch.tensor([2, 0, 1])
    assert torch.equal(stored(cpu.store, layout, k, v, gids, 3),
                       stored(reference.store, layout, k, v, gids, 3))


@pytest.mark.parametrize("dtype,reference_arithmetic", [
    (torch.bfloat16, False), (torch.float16, False), (torch.float32, False),
    (torch.float32, True)])
def test_serving_writes_take_the_encoder_unless_reference_arithmetic(monkeypatch, dtype,
                                                                     reference_arithmetic):
    """paged.forward_layer through chunked prefill and decode: a model's groups go through
    the C++ encoder (sink groups included) whatever its dtype, through the codecs with
    ``reference_arithmetic`` (the engines' float32 parity checks). That the encoder stores
    what the codecs would: the tests above."""
    import functools

    import vllm_lowbit_kv.paged.layout as paged_layout
    from test_paged import make, run_schedule
    from vllm_lowbit_kv.paged import forward_layer

    calls = []

    def spy(fmt, k, v):
        calls.append(k.shape[0])
        return cpu.encode_states(fmt, k, v)

    monkeypatch.setattr(paged_layout, "encode_states", spy)
    torch.manual_seed(4)
    seqs = [tuple(torch.randn(L, 3, 64).to(dtype) for _ in range(2)) + (
        torch.randn(L, 9, 64).to(dtype),) for L in (70, 37)]  # test_paged's 3 KV heads
    tables = [torch.arange(i * 8, (i + 1) * 8) for i in range(2)]
    layout, pages, staging, alloc = make("vidkv", T=16, block_size=32, sinks=2)
    run_schedule(layout, pages, staging, alloc, seqs, tables, [[40, 20], [30, 17], [1, 1]],
                 forward=functools.partial(forward_layer,
                                           reference_arithmetic=reference_arithmetic))
    takes_cpp = not reference_arithmetic
    assert (sum(calls) == 6) == takes_cpp and bool(calls) == takes_cpp  # 4 + 2 full groups


def test_encoder_does_not_depend_on_the_default_dtype_at_import(tmp_path):
    """vLLM imports the backend under ``set_default_torch_dtype(model dtype)``: the module's
    shared empty tensors made then must still be what the kernels take (a bf16 ``_NONE``
    once refused every encode of a bf16 server's RVQ-less formats)."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    script = textwrap.dedent(f"""
        import torch
        torch.set_default_dtype(torch.bfloat16)
        from vllm_lowbit_kv.ops import cpu
        from test_cpu_kernel import layout_for
        from test_cpu_encoder import kv
        assert cpu.load_library() is None
        torch.set_default_dtype(torch.float32)
        layout = layout_for("vidkv", {{}}, 2, 16, 32)
        k, v = kv(3, 16, 2, 64, torch.bfloat16, seed=5)
        torch.save(cpu.encode_states(layout.format, k, v), {str(tmp_path / "states.pt")!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=Path(__file__).parent)
    layout = layout_for("vidkv", {}, 2, 16, 32)
    k, v = kv(3, 16, 2, 64, torch.bfloat16, seed=5)
    assert torch.equal(torch.load(tmp_path / "states.pt"), cpu.encode_states(layout.format, k, v))
