"""Retrieval heads: the score, its cache, the choice of heads, and the transformers cache
that codes them with another codec pair (the vLLM pages: tests/test_paged.py, the server:
tests/test_vllm_vs_hf.py)."""

import json

import pytest
import torch

from vllm_lowbit_kv import retrieval_heads as rh
from vllm_lowbit_kv.config import LowBitKVConfig, LowBitKVConfigError
from vllm_lowbit_kv.schemes import get_scheme


def test_top_heads_and_layers():
    scores = torch.tensor([[0.1, 0.9, 0.0], [0.5, 0.5, 0.7], [0.0, 0.2, 0.95]])
    assert rh.top_heads(scores, 3) == ((0, 1), (1, 2), (2, 2))
    assert rh.top_heads(scores, 4) == ((0, 1), (1, 0), (1, 2), (2, 2))  # tie: lower layer first
    assert rh.top_heads(scores, 0) == ()
    assert rh.heads_by_layer(rh.top_heads(scores, 5)) == {0: (1,), 1: (0, 1, 2), 2: (2,)}
    with pytest.raises(ValueError, match=r"retrieval_heads must be an int in \[0, 9\]"):
        rh.top_heads(scores, 10)


def test_calibration_prompts_hide_the_key_in_held_out_text(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = rh.calibration_prompts(tok)
    assert len(prompts) == len(rh.DEPTHS) * rh.DRAWS
    for ids, answer, first in prompts:
        assert ids[first:first + len(answer)] == answer  # the answer is copied from the needle
        assert "pass key" not in tok.decode(ids)  # not the yardstick's needle


@pytest.mark.slow
def test_scores_are_sparse_cached_and_reused(model_dir, monkeypatch):
    """In the machine's cache, as served: measured here or by the first server of the
    session with retrieval heads (vidkv's default), once (a minute of CI each time)."""
    scores = rh.model_scores(model_dir)
    assert scores.shape == (30, 3)
    # few heads retrieve: the best ones put most of their mass on the needle, most none
    assert float(scores.max()) > 0.4 and float(scores.median()) < 0.1
    path = rh.scores_path(model_dir)
    assert path.is_file() and json.loads(path.read_text())["model"] == "SmolLM2-135M-Instruct"
    monkeypatch.setattr(rh, "_load", lambda *a: pytest.fail("measured again"))
    assert torch.equal(rh.model_scores(model_dir), scores)


@pytest.mark.slow
def test_retrieval_heads_decode_with_their_own_codecs(model_dir):
    """In the transformers cache the chosen heads' K and V come back through kivi4's codecs,
    the other heads' through vidkv's (and with retrieval_keys_only, V through vidkv's)."""
    from transformers import AutoModelForCausalLM

    from vllm_lowbit_kv.hf_cache import LowBitKVCache
    from vllm_lowbit_kv.hf_cache.layer import HeadSplitLayer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    ids = torch.randint(100, 2000, (1, 256), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = model(ids, use_cache=True).past_key_values  # exact K/V of the same tokens
    for keys_only in (False, True):
        scheme = get_scheme("vidkv").with_params(residual_tokens=0, sink_tokens=0,
                                                 retrieval_keys_only=keys_only)
        G, S = scheme.block_tokens, ids.shape[1]
        cache = LowBitKVCache(scheme, model=model)
        heads = rh.heads_by_layer(rh.top_heads(rh.model_scores(model_dir), scheme.retrieval_heads))
        assert cache.retrieval == heads
        split = [i for i, layer in enumerate(cache.layers) if isinstance(layer, HeadSplitLayer)]
        assert split == sorted(heads)
        with torch.inference_mode():
            model(ids, past_key_values=cache, use_cache=True)
        for i in split:
            layer = cache.layers[i]
            codecs_r = scheme.retrieval_codecs(64, layer=i)
            codecs_b = scheme.codecs(64, layer=i)
            for side, exact in enumerate((ref.layers[i].keys, ref.layers[i].values)):  # [1, H, S, D]
                blocks = exact.float().reshape(1, 3, S // G, G, 64).permute(0, 2, 3, 1, 4)
                for part, hs in zip(layer.parts, layer.heads):
                    got = part._decode(*((part.key_codec, part.packed_k), (part.value_codec, part.packed_v))[side])
                    codec = (codecs_r if part is layer.parts[-1] else codecs_b)[side]
                    want = codec.decode(codec.encode(blocks[:, :, :, list(hs)]), torch.bfloat16)
                    want = want.permute(0, 3, 1, 2, 4).reshape(1, len(hs), S, 64)
                    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=0)
        values = type(cache.layers[split[0]].parts[-1].value_codec).__name__
        assert values == ("TernaryValueCodec" if keys_only else "KiviCodec")
    # the retrieval part really is kivi4 (4 bits) and the rest VidKV
    assert type(cache.layers[split[0]].parts[-1].key_codec).__name__ == "KiviCodec"
    assert type(cache.layers[split[0]].parts[0].key_codec).__name__ == "VidKVKeyCodec"
    plain = LowBitKVCache(scheme.with_params(retrieval_heads=0), model=model)
    with torch.inference_mode():
        model(ids, past_key_values=plain, use_cache=True)
    assert cache.memory_report()["packed_bytes"] > plain.memory_report()["packed_bytes"]
    assert cache.effective_bits > plain.effective_bits


@pytest.mark.parametrize("raw,match", [
    ({"retrieval_heads": -1}, r"retrieval_heads"),
    ({"retrieval_heads": "six"}, r"retrieval_heads"),
    ({"retrieval_scheme": "kivi9"}, r"retrieval_scheme must be a scheme without retrieval heads"),
    ({"retrieval_scheme": "vidkv"}, r"retrieval_scheme must be a scheme without retrieval heads"),
    ({"retrieval_keys_only": "yes"}, r"retrieval_keys_only"),
])
def test_bad_retrieval_fields_name_the_field(raw, match):
    with pytest.raises(LowBitKVConfigError, match=match):
        LowBitKVConfig.parse(raw).scheme("vidkv")


@pytest.mark.parametrize("parallel,lowbit,reason", [
    (dict(tensor_parallel_size=3), {}, r"retrieval_heads 7 with tensor/pipeline parallelism"),
    (dict(tensor_parallel_size=1, pipeline_parallel_size=2), {},
     r"retrieval_heads 7 with tensor/pipeline parallelism"),
    (dict(tensor_parallel_size=1, pipeline_parallel_size=1),
     {"eviction": "uniform", "retention": 0.5}, r"eviction with retrieval_heads 7"),
])
def test_vllm_refuses_what_retrieval_heads_cannot_serve(parallel, lowbit, reason):
    from types import SimpleNamespace

    from vllm.platforms.cpu import CpuPlatform

    from vllm_lowbit_kv.vllm.checks import check_vllm_config

    model = SimpleNamespace(
        is_hybrid=False, is_attention_free=False, is_encoder_decoder=False, use_mla=False,
        is_multimodal_model=False, architecture="LlamaForCausalLM", model="fake",
        dtype=torch.bfloat16, get_total_num_hidden_layers=lambda: 30, get_head_size=lambda: 64,
        get_num_kv_heads=lambda pc: 3, get_total_num_kv_heads=lambda: 3)
    cfg = SimpleNamespace(
        model_config=model, parallel_config=SimpleNamespace(**parallel), speculative_config=None,
        additional_config={"lowbit_kv": lowbit},
        scheduler_config=SimpleNamespace(async_scheduling=False, scheduler_cls=None),
        cache_config=SimpleNamespace(cache_dtype="vidkv", kv_cache_dtype_skip_layers=[],
                                     block_size=128, user_specified_block_size=True,
                                     enable_prefix_caching=False))
    with pytest.raises(ValueError, match=f"vidkv cannot serve fake: .*{reason}"):
        check_vllm_config(cfg, CpuPlatform)


def test_each_part_is_read_by_its_formats_implementation():
    """The backend and bench.paged_forward pick a layer's implementations here: the
    scheme's for the other heads, the retrieval one for retrieval heads, and the retrieval
    one alone for a layer whose every KV head retrieves (a single-format layer)."""
    assert rh.part_implementations((), 3, "scheme", "retrieval") == ["scheme"]
    assert rh.part_implementations((2, 0), 3, "scheme", "retrieval") == ["scheme", "retrieval"]
    assert rh.part_implementations((0, 1, 2), 3, "scheme", "retrieval") == ["retrieval"]
