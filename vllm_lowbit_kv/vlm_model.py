"""A test vision-language model: the embedded SmolLM2 behind a seeded random vision tower.

No trained vision-language model can be installed on these machines, so the
multimodal serving path is tested on one we build: an Idefics3 model (the
SmolVLM layout, ``Idefics3ForConditionalGeneration``) whose text model is
exactly the embedded SmolLM2-135M-Instruct (:mod:`vllm_lowbit_kv.model`) and
whose vision tower and connector are seeded random weights. Text-only prompts
give SmolLM2's own logits; **what it says about an image is meaningless** (the
vision part is untrained): it exercises image preprocessing, placeholder
tokens and image embeddings in the KV cache, not visual quality.

Each image becomes one 512x512 view of 32x32 patches, pixel-shuffled by 4 into
:data:`IMAGE_TOKENS` (64) ``<image>`` tokens, wrapped as Idefics3 expects
(``<fake_token_around_image><global-img><image>...<fake_token_around_image>``).

    python -m vllm_lowbit_kv.model --vlm    # build it once (cached) and print the folder
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

SEED = 0
IMAGE_SIZE = 512
PATCH_SIZE = 16
#: pixel shuffle: each scale x scale square of patches becomes one token
SCALE_FACTOR = 4
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
VISION_CONFIG = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE}
#: the tokens Idefics3's processor writes around images, in SmolVLM's order; SmolLM2
#: lacks them, so they are appended after its 49,152 and every text id keeps its row
IMAGE_SPECIAL_TOKENS = (["<global-img>"]
                        + [f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7)]
                        + ["<fake_token_around_image>", "<image>", "<end_of_utterance>"])
#: SmolLM2's own chat template (so text-only chats are tokenized exactly as for SmolLM2),
#: extended to OpenAI-style content lists whose image parts become ``<image>``
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_vlm(text_model: Path, out: Path, seed: int = SEED, progress: bool = True) -> None:
    """Write the test VLM's Hugging Face folder into ``out`` (an empty folder), from the
    text model's folder ``text_model``. The same ``seed`` writes the same bytes."""
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import AddedToken
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.utils import logging as transformers_logging

    steps = tqdm(total=3, desc="building the test VLM", disable=not progress)
    steps.set_postfix_str("tokenizer and processor"); steps.update(0)
    tokenizer = AutoTokenizer.from_pretrained(text_model)
    text_vocab = len(tokenizer)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in IMAGE_SPECIAL_TOKENS],
                         special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    # longest edge 512 both ways: every image is one 512x512 view (no tiles), IMAGE_TOKENS tokens
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": IMAGE_SIZE}, max_image_size={"longest_edge": IMAGE_SIZE},
        image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                  image_seq_len=IMAGE_TOKENS, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
    shutil.copyfile(text_model / "generation_config.json", out / "generation_config.json")

    text_config = json.loads((text_model / "config.json").read_text())
    text_config["vocab_size"] = len(tokenizer)
    config = Idefics3Config(
        text_config=text_config, vision_config=VISION_CONFIG, scale_factor=SCALE_FACTOR,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        pad_token_id=text_config["pad_token_id"], tie_word_embeddings=text_config["tie_word_embeddings"])
    config.architectures = ["Idefics3ForConditionalGeneration"]
    config.dtype = "bfloat16"
    # save_pretrained diffs against a default Idefics3Config, whose own pad id (Llama 3's
    # 128002) transformers warns about: a false alarm about a config we never use
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        config.save_pretrained(out)
    finally:
        transformers_logging.set_verbosity(verbosity)
    steps.update(1)

    steps.set_postfix_str("seeded vision tower")
    with torch.device("meta"):  # names and shapes only: every weight is set below
        shapes = {name: tuple(tensor.shape)
                  for name, tensor in Idefics3ForConditionalGeneration(config).state_dict().items()}
    text_weights = load_file(text_model / "model.safetensors")
    embeddings = text_weights["model.embed_tokens.weight"]
    assert embeddings.shape[0] == text_vocab, (embeddings.shape, text_vocab)
    # New tokens get the mean text embedding: no randomness, and as tied output rows they
    # score exactly the mean of the text tokens' logits, far below the most likely one.
    new_rows = embeddings.float().mean(0).to(embeddings.dtype).expand(len(tokenizer) - text_vocab, -1)
    text_weights["model.embed_tokens.weight"] = torch.cat([embeddings, new_rows])
    weights = {name.replace("model.", "model.text_model.", 1): tensor for name, tensor in text_weights.items()}
    # image features enter the text model where token embeddings would: give them the embeddings' scale
    embedding_rms = embeddings.float().pow(2).mean().sqrt().item()
    vision_shapes = {name: shape for name, shape in shapes.items()
                     if name.startswith(("model.vision_model.", "model.connector."))}
    weights.update(_seeded_vision_weights(vision_shapes, config.vision_config.initializer_range, seed,
                                          embedding_rms, embeddings.dtype))
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()  # not stored: it is embed_tokens
    assert {name: tuple(w.shape) for name, w in weights.items()} == {
        name: shape for name, shape in shapes.items() if name not in tied}
    steps.update(1)

    steps.set_postfix_str("writing safetensors")
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    steps.update(1)
    steps.close()


def _seeded_vision_weights(shapes: dict[str, tuple[int, ...]], std: float, seed: int,
                          embedding_rms: float, dtype) -> dict:
    """The vision tower's and connector's weights (``shapes``: name -> shape), drawn in
    name order from one seeded generator, so independent of transformers' own
    initialization: matrices normal with ``std``, layer norms 1, biases 0, and the
    connector scaled so that image features come out at about ``embedding_rms``."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith(".bias"):
            weight = torch.zeros(shape)
        elif "norm" in name:  # layer_norm1, layer_norm2, post_layernorm
            weight = torch.ones(shape)
        elif name.startswith("model.connector."):
            # its input, the pixel-shuffled post_layernorm output, has unit scale
            weight = torch.randn(shape, generator=generator) * (embedding_rms / shape[1] ** 0.5)
        else:
            weight = torch.randn(shape, generator=generator) * std
        weights[name] = weight.to(dtype)
    return weights
