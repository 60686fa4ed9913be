import pytest

from vllm_lowbit_kv.schemes import SCHEMES, get_scheme

REQUIRED = ["vidkv", "vidkv_stp", "vidkv_k2v2", "kivi2", "kivi4", "quantile1", "dynamic4", "dynamic2"]


#: SmolLM2-135M: 30 layers x 3 KV heads
SMOLLM2_KV_HEADS = 90


@pytest.mark.parametrize("name", REQUIRED)
def test_required_schemes_are_registered_and_build(name):
    scheme = get_scheme(name)
    k, v = scheme.codecs(head_dim=64)
    assert k.block_tokens == v.block_tokens == scheme.block_tokens
    assert 0 < scheme.effective_bits(64, model_kv_heads=SMOLLM2_KV_HEADS) < 16


def test_vidkv_is_under_two_honest_bits_at_its_default_block():
    """Every byte of its pages, retrieval heads included, over SmolLM2's 90 KV heads."""
    vidkv = get_scheme("vidkv")
    assert vidkv.effective_bits(64, model_kv_heads=SMOLLM2_KV_HEADS) < 2.0
    assert vidkv.effective_bits_at(1 << 24, 64, model_kv_heads=SMOLLM2_KV_HEADS) < 2.0  # pages
    assert vidkv.effective_bits_at(8192, 64, model_kv_heads=SMOLLM2_KV_HEADS) <= 2.25
    # the retrieval heads are counted: more of them cost more bits
    more = vidkv.with_params(retrieval_heads=12)
    assert more.effective_bits(64, model_kv_heads=90) > vidkv.effective_bits(64, model_kv_heads=90)
    with pytest.raises(ValueError, match="model_kv_heads"):
        vidkv.effective_bits(64)


def test_unknown_scheme_lists_valid_names():
    with pytest.raises(ValueError, match="kv_cache_dtype.*kivi2"):
        get_scheme("int3")


def test_with_params_routes_and_validates():
    s = get_scheme("kivi2").with_params(bits=4, block_tokens=32)
    assert s.key.params["bits"] == s.value.params["bits"] == 4 and s.block_tokens == 32
    assert get_scheme("kivi2").key.params["bits"] == 2  # registry entry untouched
    with pytest.raises(ValueError, match="parameter name"):
        get_scheme("kivi2").with_params(gamma=0.5)
    with pytest.raises(ValueError, match="bits"):
        get_scheme("kivi2").with_params(bits=3)
    with pytest.raises(ValueError, match="sink_tokens"):
        get_scheme("kivi2").with_params(sink_tokens=-1)


@pytest.mark.parametrize("params,field", [
    ({"k": 1.5}, "k"), ({"k": -0.1}, "k"), ({"gamma": 0.0}, "gamma"),
    ({"protect": 1.0}, "protect"), ({"protect": -0.2}, "protect"), ({"block_tokens": 0}, "block_tokens")])
def test_vidkv_invalid_params_name_the_field(params, field):
    name = "vidkv_stp" if "protect" in params else "vidkv"
    with pytest.raises(ValueError, match=field):
        get_scheme(name).with_params(**params)


def test_every_scheme_has_a_summary():
    assert all(s.summary for s in SCHEMES.values())


def test_effective_bits_at_counts_the_sink_area_in_the_model_dtype():
    """The pages hold the sink rows in the model dtype: a float32 model's cost twice bf16's."""
    scheme = get_scheme("kivi2").with_params(sink_tokens=4, staging_dtype="int8")
    tokens, head_dim = scheme.page_size, 64
    f32, bf16 = (scheme.effective_bits_at(tokens, head_dim, model_dtype_bytes=b) for b in (4, 2))
    extra_sink_bytes = 2 * 4 * head_dim * (4 - 2)  # K and V rows of 4 sinks, per head
    assert f32 - bf16 == pytest.approx(extra_sink_bytes * 8 / (tokens * 2 * head_dim))
