"""The test vision-language model (vllm_lowbit_kv.vlm_model): an Idefics3 whose text model
is the embedded SmolLM2, built into a temporary cache from the normally cached SmolLM2."""

import hashlib

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor,
                          AutoTokenizer)

from vllm_lowbit_kv.model import MODEL_NAME, VLM_NAME, prepare_model, prepare_vlm
from vllm_lowbit_kv.vlm_model import IMAGE_SPECIAL_TOKENS, IMAGE_TOKENS, SEED, write_vlm

TEXT = "The capital of France is Paris. The quick brown fox jumps over the lazy dog while"


@pytest.fixture(scope="module")
def text_model():
    return prepare_model(progress=False)  # cached by the set-up; no network


@pytest.fixture(scope="module")
def vlm(text_model, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    (cache / MODEL_NAME).symlink_to(text_model)  # the cached SmolLM2, not a second conversion
    folder = prepare_vlm(cache, progress=False)
    assert folder == cache / VLM_NAME
    return folder


def gradient_image(width, height, flip=False):
    x = np.linspace(0, 255, width, dtype=np.uint8)[None, :].repeat(height, 0)
    y = np.linspace(0, 255, height, dtype=np.uint8)[:, None].repeat(width, 1)
    return Image.fromarray(np.stack([y, x, 255 - x] if flip else [x, y, 255 - y], -1))


def test_config_is_idefics3_around_smollm2(vlm):
    config = AutoConfig.from_pretrained(vlm)
    tokenizer = AutoTokenizer.from_pretrained(vlm)
    assert config.architectures == ["Idefics3ForConditionalGeneration"]
    text = config.text_config
    assert (text.model_type, text.num_hidden_layers, text.num_key_value_heads, text.head_dim) == (
        "llama", 30, 3, 64)
    assert text.vocab_size == len(tokenizer) == 49152 + len(IMAGE_SPECIAL_TOKENS)
    assert config.image_token_id == tokenizer.convert_tokens_to_ids("<image>")


def test_processor_gives_64_image_tokens_per_image(vlm):
    processor = AutoProcessor.from_pretrained(vlm)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                             {"type": "image"}, {"type": "text", "text": "?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert prompt.count("<image>") == 2
    # any size or shape becomes one 512x512 view (no tiles)
    images = [gradient_image(512, 512), gradient_image(900, 300)]
    batch = processor(text=prompt, images=images, return_tensors="pt")
    ids = batch.input_ids[0].tolist()
    token_id = processor.tokenizer.convert_tokens_to_ids
    assert IMAGE_TOKENS == 64
    assert ids.count(token_id("<image>")) == 2 * IMAGE_TOKENS
    assert ids.count(token_id("<fake_token_around_image>")) == 4 and ids.count(token_id("<global-img>")) == 2
    assert tuple(batch.pixel_values.shape) == (1, 2, 3, 512, 512)


def test_text_only_is_exactly_smollm2(vlm, text_model):
    processor, tokenizer = AutoProcessor.from_pretrained(vlm), AutoTokenizer.from_pretrained(text_model)
    chat = [{"role": "user", "content": "What is 2+2?"}]
    assert (processor.apply_chat_template(chat, add_generation_prompt=True)
            == tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    assert torch.equal(processor.tokenizer(TEXT, return_tensors="pt").input_ids, ids)
    model = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.bfloat16)
    smollm2 = AutoModelForCausalLM.from_pretrained(text_model, dtype=torch.bfloat16)
    text_vocab = smollm2.config.vocab_size
    assert torch.equal(model.get_input_embeddings().weight[:text_vocab], smollm2.get_input_embeddings().weight)
    with torch.no_grad():
        logits, expected = model(input_ids=ids).logits, smollm2(input_ids=ids).logits
    assert logits.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(logits[..., :text_vocab], expected)  # bit for bit, not just close
    # the added tokens (mean embedding, tied output rows) are never the most likely
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_images_reach_the_text_model(vlm):
    processor = AutoProcessor.from_pretrained(vlm)
    model = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.bfloat16)
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
        add_generation_prompt=True)
    last = []
    for image in (gradient_image(512, 512), gradient_image(512, 512, flip=True)):
        with torch.no_grad():
            logits = model(**processor(text=prompt, images=[image], return_tensors="pt")).logits[0, -1]
        assert torch.isfinite(logits).all()
        last.append(logits)
    assert not torch.equal(*last)


def sha256s(folder):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


def test_rebuild_is_byte_identical(vlm, text_model, tmp_path):
    stamp = (vlm / "model.safetensors").stat().st_mtime_ns
    assert prepare_vlm(vlm.parent, progress=False) == vlm  # cached: not rebuilt
    assert (vlm / "model.safetensors").stat().st_mtime_ns == stamp
    again, other_seed = tmp_path / "again", tmp_path / "other"
    again.mkdir(), other_seed.mkdir()
    write_vlm(text_model, again, seed=SEED, progress=False)
    write_vlm(text_model, other_seed, seed=SEED + 1, progress=False)
    assert sha256s(again) == sha256s(vlm)
    assert sha256s(other_seed)["model.safetensors"] != sha256s(vlm)["model.safetensors"]
