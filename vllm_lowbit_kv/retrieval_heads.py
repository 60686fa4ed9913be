"""Retrieval heads: the few KV heads that fetch facts from far back in the context.

Wu et al. 2024 ("Retrieval Head Mechanistically Explains Long-Context
Factuality") find that fewer than 5% of a model's attention heads do the
copying in needle-in-a-haystack retrieval, and that the rest can be damaged
without losing it; DuoAttention (Xiao et al. 2024) keeps full KV only for such
heads. At 1.5-2 bits the damage is exactly there: the needle must win a softmax
against thousands of filler keys whose quantization noise raises the floor.
So a scheme may code its ``retrieval_heads`` highest-scoring KV heads with a
higher-precision codec pair (``retrieval_scheme``, default ``kivi4``), the
other heads with its own codecs; the page of a layer holds both
(:class:`~vllm_lowbit_kv.paged.layout.HeadSplitLayout`) and every byte is
counted in the bits.

The score of a KV head (one number per layer and KV head, measured once per
model with transformers and cached on disk): on needle prompts built from the
held-out calibration text (never the yardstick's text, needle or filler), the
attention mass that the queries writing the answer put on the needle's tokens,
averaged over the prompts, the maximum over the query heads that share the KV
head. Reproducible: fixed needles, depths and text offsets.

    python -m vllm_lowbit_kv.retrieval_heads            # the embedded model: scores, top heads
    python -m vllm_lowbit_kv.retrieval_heads --model DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from .codecs.base import require
from .corpus import calibration_text
from .paths import cache_root

#: the needle and question of the calibration prompts (the yardstick uses other words)
NEEDLE = " The special magic number is {key}. "
QUESTION = "\nWhat is the special magic number? The special magic number is"
#: needle depths (fraction of the haystack before it) and draws per depth
DEPTHS = (0.15, 0.4, 0.65, 0.9)
DRAWS = 2
HAYSTACK_TOKENS = 900
SEED = 7
#: bumped whenever the measurement changes, so cached files of an older one are not reused
VERSION = 1


def _load(model_dir: str | Path):
    """transformers model (float32, eager attention: the weights are returned) and tokenizer;
    vision-language models load whole and are read text-only."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    cfg = AutoConfig.from_pretrained(str(model_dir))
    text_only = cfg.get_text_config(decoder=True) is cfg
    cls = AutoModelForCausalLM if text_only else AutoModelForImageTextToText
    model = cls.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    return model.eval(), AutoTokenizer.from_pretrained(str(model_dir))


def calibration_prompts(tok, text: str | None = None) -> list[tuple[list[int], list[int], int]]:
    """(prompt ids, answer ids, position of the answer's first token inside the needle) per
    prompt: a 5-7 digit key hidden at each of :data:`DEPTHS` in ``HAYSTACK_TOKENS`` tokens of
    the calibration text, :data:`DRAWS` draws each."""
    hay = tok(text or calibration_text(), add_special_tokens=False).input_ids
    require(len(hay) > 2 * HAYSTACK_TOKENS, "calibration text", f"> {2 * HAYSTACK_TOKENS} tokens",
            len(hay))
    rng, out = random.Random(SEED), []
    for depth in DEPTHS:
        for _ in range(DRAWS):
            key = rng.randint(10_000, 9_999_999)
            start = rng.randrange(0, len(hay) - HAYSTACK_TOKENS)
            ctx = hay[start:start + HAYSTACK_TOKENS]
            needle = tok(NEEDLE.format(key=key), add_special_tokens=False).input_ids
            answer = tok(f" {key}", add_special_tokens=False).input_ids
            cut = int(depth * len(ctx))
            ids = ctx[:cut] + needle + ctx[cut:] + tok(QUESTION, add_special_tokens=False).input_ids
            first = next(i for i in range(cut, cut + len(needle)) if ids[i:i + len(answer)] == answer)
            out.append((ids, answer, first))
    return out


@torch.inference_mode()
def measure(model, tok, text: str | None = None) -> torch.Tensor:
    """float32 [layers, kv_heads]: each KV head's retrieval score (module docstring)."""
    cfg = model.config.get_text_config(decoder=True)
    n_layers, n_q, n_kv = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    score = torch.zeros(n_layers, n_q)
    prompts = calibration_prompts(tok, text)
    for ids, answer, first in prompts:
        out = model(input_ids=torch.tensor([ids + answer]), output_attentions=True)
        q0 = len(ids) - 1  # the query that writes the answer's first token
        lo, hi = max(first - 2, 0), first + len(answer) + 1  # the key and its neighbours
        for layer, att in enumerate(out.attentions):  # [1, Hq, S, S]
            score[layer] += att[0, :, q0:q0 + len(answer), lo:hi].sum(-1).mean(-1).float()
    score /= len(prompts)
    return score.view(n_layers, n_kv, n_q // n_kv).amax(-1)


def scores_path(model_dir: str | Path) -> Path:
    """Cache file of a model's scores: named after the model, keyed by its config and the
    measurement (text, needle, version)."""
    model_dir = Path(model_dir)
    config = (model_dir / "config.json").read_bytes() if (model_dir / "config.json").is_file() else b""
    key = hashlib.sha256(config + json.dumps([VERSION, NEEDLE, QUESTION, DEPTHS, DRAWS,
                                               HAYSTACK_TOKENS, SEED]).encode()
                         + hashlib.sha256(calibration_text().encode()).digest()).hexdigest()[:16]
    return cache_root() / "retrieval_heads" / f"{model_dir.name}-{key}.json"


def model_scores(model_dir: str | Path, log=None) -> torch.Tensor:
    """A model's scores [layers, kv_heads], measured on first use (tens of seconds for a
    small model on a CPU) and cached (:func:`scores_path`)."""
    path = scores_path(model_dir)
    if path.is_file():
        return torch.tensor(json.loads(path.read_text())["scores"])
    if log:
        log(f"measuring the retrieval heads of {Path(model_dir).name} (once; cached in {path.name})")
    t0 = time.time()
    model, tok = _load(model_dir)
    scores = measure(model, tok)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(dict(model=Path(model_dir).name, scores=scores.tolist(),
                                   seconds=round(time.time() - t0, 1), needle=NEEDLE,
                                   depths=DEPTHS, draws=DRAWS, version=VERSION)))
    tmp.replace(path)  # atomic: a concurrent reader sees a whole file or none
    return scores


def top_heads(scores: torch.Tensor, n: int) -> tuple[tuple[int, int], ...]:
    """The ``n`` (layer, kv_head) pairs with the highest scores, sorted by (layer, head);
    ties go to the lower layer, then head."""
    L, H = scores.shape
    require(isinstance(n, int) and 0 <= n <= L * H, "retrieval_heads",
            f"an int in [0, {L * H}] (the model's KV heads)", n)
    order = sorted(range(L * H), key=lambda i: (-float(scores.flatten()[i]), i))[:n]
    return tuple(sorted((i // H, i % H) for i in order))


def heads_by_layer(heads: Sequence[tuple[int, int]]) -> dict[int, tuple[int, ...]]:
    """{layer: its retrieval KV heads, sorted}."""
    out: dict[int, list[int]] = {}
    for layer, head in heads:
        out.setdefault(int(layer), []).append(int(head))
    return {k: tuple(sorted(v)) for k, v in sorted(out.items())}


def model_retrieval_heads(model_dir: str | Path, n: int, skip_layers: Sequence[int] = (),
                          log=None) -> dict[int, tuple[int, ...]]:
    """{layer: retrieval KV heads}: the ``n`` top scores of the model (:func:`model_scores`),
    none in ``skip_layers`` (layers kept in the model dtype)."""
    scores = model_scores(model_dir, log=log).clone()
    scores[sorted(skip_layers)] = float("-inf")
    return heads_by_layer(top_heads(scores, n))


def layer_parts(retrieval: Sequence[int], num_kv_heads: int) -> list[tuple[bool, tuple[int, ...]]]:
    """A layer's KV heads as parts of one format each: ``(False, the other heads)`` then
    ``(True, its retrieval heads)``, empty parts left out."""
    rest = tuple(h for h in range(num_kv_heads) if h not in retrieval)
    return [(is_retrieval, heads) for is_retrieval, heads in ((False, rest), (True, tuple(retrieval)))
            if heads]


def part_implementations(retrieval: Sequence[int], num_kv_heads: int, scheme_impl, retrieval_impl
                         ) -> list:
    """The packed-attention implementation reading each part of :func:`layer_parts`: the
    scheme's for the other heads, the retrieval codecs' for the retrieval heads (a layer
    whose every head retrieves has that part only)."""
    return [retrieval_impl if is_retrieval else scheme_impl
            for is_retrieval, _ in layer_parts(retrieval, num_kv_heads)]


def query_heads(kv_heads: torch.Tensor, group: int) -> torch.Tensor:
    """The query heads (GQA: ``group`` per KV head, consecutive) of ``kv_heads``."""
    return (kv_heads[:, None] * group + torch.arange(group, device=kv_heads.device)).flatten()


def main(argv: Sequence[str] | None = None) -> None:
    from .model import prepare_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    p.add_argument("--top", type=int, default=8, help="how many of the top heads to list")
    args = p.parse_args(argv)
    model_dir = args.model or prepare_model()
    scores = model_scores(model_dir, log=print)
    print(json.dumps(dict(file=scores_path(model_dir).name,
                          top=[dict(layer=l, kv_head=h, score=round(float(scores[l, h]), 3))
                               for l, h in sorted(top_heads(scores, args.top),
                                                  key=lambda lh: -float(scores[lh]))]), indent=1))


if __name__ == "__main__":
    main()
