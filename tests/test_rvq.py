"""RVQ (seed 001): the codec against a brute-force transcription of Algorithm 1, honest
bits, the codebook file and its refusals, calibration on the embedded model's real KV,
and a vLLM server with --kv-cache-dtype rvq4x256."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vllm_lowbit_kv.codecs.base import ModelIdentity
from vllm_lowbit_kv.codecs.bitpack import from_bytes, unpack_bits
from vllm_lowbit_kv.codecs.rvq import RVQCodebooks, RVQKeyCodec, RVQSettings, RVQValueCodec
from vllm_lowbit_kv.config import LowBitKVConfig, LowBitKVConfigError
from vllm_lowbit_kv.schemes import get_scheme

SMOLLM2 = ModelIdentity("SmolLM2-135M-Instruct", 30, 3, 64)
CODECS = {"key": RVQKeyCodec, "value": RVQValueCodec}


def make_books(K, C, d, head_dim, *, layers=2, kv_heads=2, name="tiny", key_grouping="strided",
               value_grouping="contiguous", seed=0, scale=0.5) -> RVQCodebooks:
    g = torch.Generator().manual_seed(seed)
    shape = (layers, K, C, d)
    return RVQCodebooks(torch.randn(shape, generator=g) * scale, torch.randn(shape, generator=g) * scale,
                        ModelIdentity(name, layers, kv_heads, head_dim),
                        RVQSettings(K, C, d, key_grouping, value_grouping), {"seed": str(seed)})


# --------------------------------------------------------------------------- brute force
def channels_of(D, d, grouping):
    """Channel indices of each group, spelled out (sec. 3.1)."""
    n = D // d
    if grouping == "contiguous":
        return [list(range(j * d, (j + 1) * d)) for j in range(n)]
    return [[j + n * i for i in range(d)] for j in range(n)]  # channels n apart


def brute_force_check(x, codec, books, packed):
    """Algorithm 1 by exhaustive per-level search in float64 over plain lists, for one
    token-head vector ``x`` [D]; checks the codec's stored std, that each code the codec
    chose is a nearest one (within float32 rounding of the distances), and returns the
    reconstruction from the codec's indices: std * sum of codes."""
    D, d, K = codec.head_dim, codec.group_size, codec.num_codebooks
    vals = [float(v) for v in x]
    mean = sum(vals) / D
    std_ref = math.sqrt(sum((v - mean) ** 2 for v in vals) / D)
    std16 = float(from_bytes(packed["std"], torch.float16))
    assert abs(std16 - std_ref) <= 2 ** -10 * std_ref + 2 ** -24, (std16, std_ref)  # fp16 rounding
    scale = std16 if std16 > 0 else 1.0
    idx = packed["idx"]  # [n_groups, K]
    out = [0.0] * D
    for g, chans in enumerate(channels_of(D, d, codec.grouping)):
        z = [vals[c] / scale for c in chans]
        for level in range(K):
            dist = [sum((zi - float(ci)) ** 2 for zi, ci in zip(z, code)) for code in books[level]]
            chosen = int(idx[g][level])
            best = min(dist)
            tol = 1e-4 * (sum(zi * zi for zi in z) + 1.0)
            assert dist[chosen] <= best + tol, (g, level, chosen, dist[chosen], best)
            z = [zi - float(ci) for zi, ci in zip(z, books[level][chosen])]
        for i, c in enumerate(chans):
            out[c] = scale * (vals[c] / scale - z[i])  # z_q = z_1 - z_{K+1}
    return out


@st.composite
def rvq_case(draw):
    D = draw(st.sampled_from([8, 16, 32]))
    d = draw(st.sampled_from([g for g in (4, 8, 16) if D % g == 0]))
    K = draw(st.integers(1, 3))
    C = draw(st.sampled_from([2, 5, 16, 33]))  # 33: not a power of two (6-bit indices)
    role = draw(st.sampled_from(["key", "value"]))
    grouping = draw(st.sampled_from(["strided", "contiguous"]))
    T, H = draw(st.sampled_from([1, 3, 8])), draw(st.integers(1, 2))
    seed = draw(st.integers(0, 2**31 - 1))
    xscale = draw(st.sampled_from([1e-3, 1.0, 300.0]))
    return D, d, K, C, role, grouping, T, H, seed, xscale


@given(case=rvq_case())
def test_encode_decode_match_brute_force(case):
    D, d, K, C, role, grouping, T, H, seed, xscale = case
    books = make_books(K, C, d, D, layers=2, kv_heads=H, seed=seed,
                       **{f"{role}_grouping": grouping})
    codec = CODECS[role](T, D, num_codebooks=K, codebook_size=C, group_size=d, grouping=grouping,
                         codebook=books, layer=1)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, H, D, generator=g) * xscale
    packed = codec.encode(x)
    assert packed.dtype == torch.uint8 and packed.shape == (H, codec.nbytes)
    fields = codec.layout().split(packed)
    bits = max(1, (C - 1).bit_length())
    idx = unpack_bits(fields["codes"], bits, T * (D // d) * K).reshape(H, T, D // d, K)
    assert int(idx.max()) < C
    y = codec.decode(packed)
    layer_books = books.tensor(role)[1].double().tolist()
    for h in range(H):
        for t in range(T):
            ref = brute_force_check(x[t, h], codec, layer_books,
                                    {"std": fields["std"][h, 2 * t:2 * t + 2], "idx": idx[h, t].tolist()})
            torch.testing.assert_close(y[t, h].double(), torch.tensor(ref, dtype=torch.float64),
                                       rtol=1e-5, atol=1e-5 * xscale)


@given(case=rvq_case(), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       lead=st.sampled_from([(), (2,), (2, 3)]))
def test_round_trip_shapes_and_nbytes(case, dtype, lead):
    D, d, K, C, role, grouping, T, H, seed, xscale = case
    books = make_books(K, C, d, D, kv_heads=H, seed=seed, **{f"{role}_grouping": grouping})
    codec = CODECS[role](T, D, num_codebooks=K, codebook_size=C, group_size=d, grouping=grouping,
                         codebook=books, layer=0)
    x = (torch.randn(*lead, T, H, D, generator=torch.Generator().manual_seed(seed)) * xscale).to(dtype)
    packed = codec.encode(x)
    bits = max(1, (C - 1).bit_length())
    assert packed.shape == (*lead, H, codec.nbytes)
    assert codec.nbytes == -(-T * (D // d) * K * bits // 8) + 2 * T  # indices + fp16 std per token
    assert codec.effective_bits == codec.nbytes * 8 / (T * D)
    y = codec.decode(packed, dtype=dtype)
    assert y.shape == x.shape and y.dtype == dtype and bool(torch.isfinite(y.float()).all())
    if lead:  # each block decodes as if encoded alone
        torch.testing.assert_close(codec.decode(packed)[(0,) * len(lead)],
                                   codec.decode(codec.encode(x[(0,) * len(lead)])))


def test_bits_are_honest():
    """Indices plus one fp16 std per token-head vector, nothing else in the pages."""
    expect = {"rvq": 2.75 + 0.25, "rvq8x256": 2.0 + 0.25, "rvq4x256": 1.0 + 0.25, "rvq2x256": 0.5 + 0.25}
    for name, bits in expect.items():
        k, v = get_scheme(name).codecs(64)
        assert k.effective_bits == v.effective_bits == get_scheme(name).effective_bits(64) == bits
        assert sum(k.bits_breakdown().values()) == bits and k.bits_breakdown()["std"] == 0.25
    k, _ = get_scheme("rvq").codecs(64)
    assert k.layout().fields == (("codes", 64 * 2 * 8 * 11 // 8), ("std", 128))
    assert k.codebook_bytes == 8 * 2048 * 32 * 2  # per layer, outside the pages


def test_startup_line_counts_what_the_codebooks_hold_in_memory(rvq_codebook_file):
    """Beside the file's fp16 codebooks, every packed layer holds per K/V role: the codecs'
    float32 codes (which the C++ kernel reads too, not a copy) and norms, the search's
    transposed codes, norms, bound terms (3 K C + 2 K floats) and bf16 pair words (K C d / 2
    int32); the start-up line adds them up."""
    from vllm_lowbit_kv.ops import cpu

    K, C, d, layers = 4, 256, 32, 30
    cfg = LowBitKVConfig.parse({"codebook": str(rvq_codebook_file("rvq4x256"))})
    scheme = cfg.scheme("rvq4x256")
    kc, vc = scheme.codecs(64, layer=0)
    fmt = scheme.layout(64, 3, 512, torch.bfloat16, 0).format
    tables = cpu.rvq_table_bytes(fmt)
    # one float32 copy of a layer's codebooks: its codecs' (every instance), the kernel's
    codes = kc.codewords.data_ptr()
    assert scheme.codecs(64, layer=0)[0].codewords.data_ptr() == codes
    assert vc.codewords.data_ptr() == codes + kc.codewords.nbytes
    assert cpu._descriptors(fmt).codebooks.data_ptr() == codes
    assert tables == 2 * 4 * (K * C * (d + 3) + 2 * K + K * C * d // 2)
    assert kc.working_bytes == vc.working_bytes == 4 * K * C * (d + 1)
    held = 2 * layers * (K * C * d * 2 + 4 * K * C * (d + 1)) + layers * tables
    line = cfg.summary("rvq4x256", scheme, head_dim=64, num_kv_heads=3, num_layers=layers,
                       block_size=512, kernel_table_bytes=tables)
    assert (f"codebooks {2 * layers * K * C * d * 2 / 2**20:.2f} MiB in fp16, held in memory "
            in line and f"search tables {held / 2**20:.2f} MiB" in line)


def test_fp16_bound_kept():
    """The full fp16 range is kept (beyond it is refused: test_codec_contract.py)."""
    books = make_books(2, 16, 8, 16)
    codec = RVQValueCodec(4, 16, num_codebooks=2, codebook_size=16, group_size=8, codebook=books, layer=0)
    ok = torch.full((4, 1, 16), 65504.0)
    ok[:, :, ::2] = -65504.0  # population std 65504: still fits fp16
    assert bool(torch.isfinite(codec.decode(codec.encode(ok))).all())


def test_zero_std_is_coded_unscaled():
    books = make_books(1, 4, 8, 8, seed=3)
    codec = RVQKeyCodec(1, 8, num_codebooks=1, codebook_size=4, group_size=8, codebook=books, layer=0)
    x = torch.zeros(1, 1, 8)
    y = codec.decode(codec.encode(x))
    codes = books.key[0, 0].float()
    nearest = codes[(codes * codes).sum(-1).argmin()]  # the code nearest to 0
    # strided grouping with one group is the identity permutation
    torch.testing.assert_close(y[0, 0], nearest)


def test_codec_needs_codebook_and_layer_to_code():
    x = torch.randn(4, 1, 16)
    c = RVQKeyCodec(4, 16, num_codebooks=2, codebook_size=16, group_size=8)
    assert c.nbytes == 4 * 2 * 2 * 4 // 8 + 8  # layout without any file
    with pytest.raises(ValueError, match="codebook"):
        c.encode(x)
    c = RVQKeyCodec(4, 16, num_codebooks=2, codebook_size=16, group_size=8,
                    codebook=make_books(2, 16, 8, 16))
    with pytest.raises(ValueError, match="layer index"):
        c.encode(x)
    with pytest.raises(ValueError, match=r"layer must be an index in \[0, 2\)"):
        RVQKeyCodec(4, 16, num_codebooks=2, codebook_size=16, group_size=8,
                    codebook=make_books(2, 16, 8, 16), layer=2)


@pytest.mark.parametrize("kw,field", [({"num_codebooks": 0}, "num_codebooks"),
                                      ({"codebook_size": 1}, "codebook_size"),
                                      ({"group_size": 5}, "group_size"), ({"group_size": 128}, "group_size"),
                                      ({"grouping": "random"}, "grouping"),
                                      ({"layer": -1}, "layer")])
def test_invalid_configuration_names_field(kw, field):
    with pytest.raises(ValueError, match=field):
        RVQValueCodec(8, 64, **kw)


def test_scheme_passes_layer_to_codecs(tmp_path):
    path = make_books(2, 16, 32, 64, name="m", layers=3).save(tmp_path / "b.safetensors")
    s = get_scheme("rvq2x256").with_params(codebook_size=16, codebook=str(path))
    books = RVQCodebooks.load(path)
    for layer in range(3):
        k, v = s.codecs(64, layer=layer)
        assert (k.layer, v.layer, k.grouping, v.grouping) == (layer, layer, "strided", "contiguous")
        torch.testing.assert_close(k._books, books.key[layer].float())
        torch.testing.assert_close(v._books, books.value[layer].float())
    assert s.codecs(64)[0].layer is None


# --------------------------------------------------------------------------- the file
def test_file_round_trip(tmp_path):
    books = make_books(3, 16, 8, 16, layers=4, kv_heads=2, name="TinyModel", seed=7)
    path = books.save(tmp_path / "cb.safetensors")
    back = RVQCodebooks.load(path)
    assert torch.equal(back.key, books.key) and torch.equal(back.value, books.value)
    assert back.key.dtype == torch.float16
    assert (back.model, back.settings, back.provenance) == (books.model, books.settings, {"seed": "7"})
    assert back.nbytes == 2 * 4 * 3 * 16 * 8 * 2
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    assert meta["model_name"] == "TinyModel" and meta["num_layers"] == "4" and meta["num_kv_heads"] == "2"
    assert meta["model_config_sha"] == books.model.config_sha
    assert (meta["num_codebooks"], meta["codebook_size"], meta["group_size"]) == ("3", "16", "8")
    assert (meta["key_grouping"], meta["value_grouping"]) == ("strided", "contiguous")
    # a codec reads the file by path and codes exactly as with the tensors in memory
    x = torch.randn(4, 2, 16)
    by_path = RVQKeyCodec(4, 16, num_codebooks=3, codebook_size=16, group_size=8, codebook=str(path), layer=2)
    in_mem = RVQKeyCodec(4, 16, num_codebooks=3, codebook_size=16, group_size=8, codebook=books, layer=2)
    assert torch.equal(by_path.encode(x), in_mem.encode(x))


def test_file_for_another_configuration_is_refused(tmp_path):
    path = str(make_books(4, 256, 32, 64, name="SmolLM2-135M-Instruct", layers=30, kv_heads=3)
               .save(tmp_path / "k4.safetensors"))
    with pytest.raises(ValueError, match=r"another configuration: num_codebooks=4 \(needed 8\), "
                                         r"codebook_size=256 \(needed 2048\)"):
        get_scheme("rvq").with_params(codebook=path)
    with pytest.raises(ValueError, match=r"key_grouping='strided' \(needed 'contiguous'\)"):
        get_scheme("rvq4x256").with_params(codebook=path, grouping="contiguous")
    with pytest.raises(LowBitKVConfigError, match=r"lowbit_kv config for rvq8x256: .*num_codebooks=4 \(needed 8\)"):
        LowBitKVConfig.parse({"codebook": path}).scheme("rvq8x256")
    assert get_scheme("rvq4x256").with_params(codebook=path).check_model(SMOLLM2) == []


def test_file_for_another_model_is_refused(tmp_path):
    other = str(make_books(4, 256, 32, 64, name="Llama-3-8B", layers=32, kv_heads=8)
                .save(tmp_path / "llama.safetensors"))
    scheme = get_scheme("rvq4x256").with_params(codebook=other)
    (reason,) = scheme.check_model(SMOLLM2)
    assert "was made for Llama-3-8B (32 layers, 8 KV heads, head_dim 64), not for " \
           "SmolLM2-135M-Instruct (30 layers, 3 KV heads, head_dim 64)" in reason
    assert "name 'Llama-3-8B' != 'SmolLM2-135M-Instruct'; num_layers 32 != 30; num_kv_heads 8 != 3" in reason
    cfg = LowBitKVConfig.parse({"codebook": other})
    reasons = cfg.check_model(cfg.scheme("rvq4x256"), head_dim=64, num_layers=30, model=SMOLLM2)
    assert reasons == [reason]
    # same geometry, another model name: refused too
    renamed = str(make_books(4, 256, 32, 64, name="OtherModel", layers=30, kv_heads=3)
                  .save(tmp_path / "renamed.safetensors"))
    assert "name 'OtherModel' != 'SmolLM2-135M-Instruct'" in \
        get_scheme("rvq4x256").with_params(codebook=renamed).check_model(SMOLLM2)[0]
    # the transformers cache refuses it before any token is stored
    from transformers import LlamaConfig

    from vllm_lowbit_kv.hf_cache import LowBitKVCache
    cfg_hf = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         hidden_size=576, name_or_path="/models/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="was made for Llama-3-8B"):
        LowBitKVCache(scheme, model_config=cfg_hf)


def test_missing_unreadable_and_absent_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"missing.safetensors: no such file \(python -m vllm_lowbit_kv.calibrate"):
        get_scheme("rvq").with_params(codebook=str(tmp_path / "missing.safetensors"))
    from safetensors.torch import save_file
    save_file({"key": torch.zeros(1)}, str(tmp_path / "other.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="not an RVQ codebook file"):
        get_scheme("rvq").with_params(codebook=str(tmp_path / "other.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        get_scheme("rvq").with_params(codebook=str(tmp_path / "junk.safetensors"))
    # no file configured: the scheme still has a layout, but cannot serve a model
    (reason,) = get_scheme("rvq").check_model(SMOLLM2)
    assert "set the lowbit_kv field 'codebook'" in reason


def test_vllm_config_refuses_codebook_of_another_model(tmp_path, rvq_codebook_file, model_dir):
    pytest.importorskip("vllm")
    from _vllm_config import vllm_config

    def build(lowbit):
        return vllm_config(model_dir, "rvq4x256", lowbit, max_model_len=512)

    other = str(make_books(4, 256, 32, 64, name="Llama-3-8B", layers=32, kv_heads=8)
                .save(tmp_path / "llama.safetensors"))
    with pytest.raises(ValueError, match=r"rvq4x256 cannot serve .*SmolLM2-135M-Instruct: RVQ codebook "
                                         r"file .* was made for Llama-3-8B .*Refusing to start"):
        build({"codebook": other})
    with pytest.raises(ValueError, match="rvq4x256 cannot serve .*set the lowbit_kv field 'codebook'"):
        build({})
    with pytest.raises(ValueError, match="no such file"):
        build({"codebook": str(tmp_path / "missing.safetensors")})
    assert build({"codebook": str(rvq_codebook_file("rvq4x256"))}).cache_config.cache_dtype == "rvq4x256"


# --------------------------------------------------------------------------- calibration
@pytest.fixture(scope="module")
def real_kv(model_dir):
    """Real K/V of the embedded model: 768 tokens of the calibration text (learning) and
    256 tokens of the yardstick text (held out)."""
    from vllm_lowbit_kv.corpus import calibration_text, default_text
    from vllm_lowbit_kv.calibrate import capture_kv, load_model
    model, tok = load_model(model_dir)
    return (capture_kv(model, tok(calibration_text()).input_ids[:768]),
            capture_kv(model, tok(default_text()).input_ids[:256]))


@pytest.mark.slow
def test_learning_lowers_held_out_error(real_kv):
    """Random points < k-means init < k-means + EMA, in reconstruction error of K and V
    tokens the codebooks never saw (2 codebooks of 64 codes, a few layers)."""
    from vllm_lowbit_kv.calibrate import CalibrationConfig, learn, relative_error, to_vectors
    train, held = real_kv
    errs = {"random": [], "kmeans": [], "ema": []}
    for layer in (0, 14, 29):
        for ri, grouping in enumerate(("strided", "contiguous")):
            vec = to_vectors(train[layer][ri], 32, grouping)
            test = to_vectors(held[layer][ri], 32, grouping).reshape(-1, 32)
            for kind, cfg in (("random", CalibrationConfig(kmeans_iters=0, steps=0, batch_tokens=256)),
                              ("kmeans", CalibrationConfig(kmeans_iters=8, steps=0, batch_tokens=256)),
                              ("ema", CalibrationConfig(kmeans_iters=8, steps=15, batch_tokens=256))):
                books, _ = learn(vec, 2, 64, cfg, torch.Generator().manual_seed(0))
                errs[kind].append(relative_error(test, books))
    mean = {k: sum(v) / len(v) for k, v in errs.items()}
    print({k: [round(e, 4) for e in v] for k, v in errs.items()})
    assert mean["ema"] < mean["kmeans"] < mean["random"], mean
    assert sum(e < k for e, k in zip(errs["ema"], errs["kmeans"])) >= 5, errs
    assert mean["ema"] < 0.5  # two 6-bit codes per 32 channels recover most of the energy


TINY = ["--kv-cache-dtype", "rvq4x256", "--tokens", "512", "--batch-tokens", "256", "--steps", "4",
        "--kmeans-iters", "4", "--no-progress"]


@pytest.fixture(scope="module")
def tiny_codebook(model_dir, tmp_path_factory):
    from vllm_lowbit_kv.calibrate import main
    out = tmp_path_factory.mktemp("calib") / "rvq4x256.safetensors"
    assert main([*TINY, "--model", model_dir, "--out", str(out)]) == out
    return out


@pytest.mark.slow
def test_calibrate_writes_a_reproducible_file(tiny_codebook, model_dir, tmp_path):
    from vllm_lowbit_kv.corpus import calibration_text
    from vllm_lowbit_kv.calibrate import main
    books = RVQCodebooks.load(tiny_codebook)
    assert books.model == SMOLLM2
    assert books.settings == RVQSettings(4, 256, 32, "strided", "contiguous")
    p = books.provenance
    assert p["seed"] == "0" and p["tokens"] == "512" and p["steps"] == "4" and p["decay"] == "0.99"
    assert p["calibration_text_sha256"] == hashlib.sha256(calibration_text().encode()).hexdigest()
    assert p["command"].startswith("python -m vllm_lowbit_kv.calibrate --model ") and "--seed 0" in p["command"]
    assert 0 < float(p["rel_error_key"]) < 1 and 0 < float(p["rel_error_value"]) < 1
    again = main([*TINY, "--model", model_dir, "--out", str(tmp_path / "again.safetensors")])
    assert torch.equal(RVQCodebooks.load(again).key, books.key)
    assert torch.equal(RVQCodebooks.load(again).value, books.value)


def test_calibrate_refuses_other_schemes_and_bad_settings(model_dir, tmp_path):
    from vllm_lowbit_kv.calibrate import main
    with pytest.raises(SystemExit, match="--kv-cache-dtype must be an RVQ scheme"):
        main(["--kv-cache-dtype", "kivi2", "--model", model_dir, "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="--batch-tokens must be an int >= 1"):
        main(["--batch-tokens", "0", "--model", model_dir, "--out", str(tmp_path / "x")])


# --------------------------------------------------------------------------- serving
@pytest.mark.slow
def test_vllm_serves_rvq_like_the_reference(tiny_codebook, model_dir):
    """One server, --kv-cache-dtype rvq4x256 with the calibrated file, prefill in chunks of
    64 tokens so every later chunk reads packed pages (the C++ kernel, decoding each group
    with its layer's codebooks): its log-probs agree with the
    transformers cache using the same codec and codebooks (a layer given another layer's
    codebooks would not), and a greedy continuation of a long prompt is fluent. Both
    engines run the model in float32 (the codec's path is the same; the CPU's bf16 GEMMs
    cost ~5x float32's without AVX-512 BF16, and float32 engines agree closely). With 7
    retrieval heads and 4 sink tokens: the layers of those heads hold pages of an RVQ part
    and a kivi4 part, the other layers plain RVQ pages (one server for both kinds: each
    start-up costs about a minute of CI)."""
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer

    from vllm_lowbit_kv.corpus import default_text
    from _servers import FLOAT32_WEIGHTS, SMALL_KV_BYTES
    from bench.quality import REFERENCE, HFEngine
    from bench.server import STATS_ROUTE, get_json, measurement_server
    from vllm_lowbit_kv.schemes import get_scheme

    C, N = 64, 384
    ids = AutoTokenizer.from_pretrained(model_dir)(default_text()).input_ids[:N]
    fields = {"retrieval_heads": 7, "sink_tokens": 4}
    params = {"codebook": str(tiny_codebook), **fields}
    bits = get_scheme("rvq4x256").with_params(**fields).effective_bits(64, model_kv_heads=90)
    assert get_scheme("rvq4x256").effective_bits(64, model_kv_heads=90) == 1.25 < bits
    server = measurement_server(model_dir, "rvq4x256", chunk=C, max_model_len=1024,
                                kv_cache_bytes=SMALL_KV_BYTES, max_num_seqs=2, additional_config=params,
                                extra_args=FLOAT32_WEIGHTS).launch()
    try:
        hf = HFEngine(model_dir, "rvq4x256", params=params,
                      dtype=torch.float32).logprobs_teacher_forced(ids, C)
        exact = HFEngine(model_dir, REFERENCE, dtype=torch.float32).logprobs_teacher_forced(ids, C)
        server.wait_ready()
        log = server.log_text()
        assert "lowbit-kv: --kv-cache-dtype rvq4x256" in log and "outside the pages: codebooks" in log
        assert "float32 copies and the kernel's search tables" in log
        # the C++ kernel reads RVQ pages: the start-up log and the stats say so
        assert server.attention_impls() == ["cpp"]
        assert get_json(server.port, STATS_ROUTE)["attention_impls"] == ["cpp"]
        assert server.served_bits()["groups"] == pytest.approx(bits, abs=0.001)
        vl = server.prompt_logprobs(ids)
        text = server.completion(prompt=ids[:300], max_tokens=32, temperature=0)["text"]
    finally:
        server.stop()
    later = slice(C - 1, None)  # positions that read the packed cache
    ppl = {k: math.exp(-v[later].mean().item()) for k, v in (("hf", hf), ("vllm", vl), ("exact", exact))}
    print(ppl, repr(text))
    damage = abs(math.log(ppl["hf"] / ppl["exact"]))
    assert damage > 0.01, ppl  # the codec really acts
    # float32 engines: 26.90723 vs 26.90713 here; a codebook or code difference moves it by far more
    assert abs(math.log(ppl["vllm"] / ppl["hf"])) <= max(0.1 * damage, 0.005), ppl
    assert ppl["vllm"] < 2 * ppl["exact"], ppl
    words = text.split()
    assert len(words) >= 12 and len(set(words)) >= 8, text  # fluent, not a collapsed loop
