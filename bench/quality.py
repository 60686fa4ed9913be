"""The quality yardstick: perplexity, passkey retrieval, chat answers and greedy agreement per KV scheme.

    python -m bench.quality                                   # every registered scheme
    python -m bench.quality --kv-cache-dtype kivi2,kivi4 --json out.json --png out.png
    python -m bench.quality --quick                           # a few minutes
    python -m bench.quality --kv-cache-dtype rvq4x256 --scheme-params '{"rvq4x256": {"codebook": "cb.safetensors"}}'
    python -m bench.quality --kv-cache-dtype kivi4 --variants kivi2,kivi2@R0,kivi2@hadamard,kivi2@R0+hadamard

Metrics (DESIGN.md, "How quality is measured"), each scheme against the
``bfloat16`` reference row, which is always run first:

* ``ppl``: teacher-forced perplexity over the first ``--max-tokens`` tokens of
  the text, prefilled in chunks of ``--chunk`` tokens, so that every chunk
  after the first attends to the (quantized) cache of the earlier chunks.
* passkey: a seeded random 5-digit number hidden in filler text at every
  ``--passkey-depths`` depth for each ``--passkey-lengths`` context length,
  ``--passkey-trials`` draws per (length, depth) (each its own number and its
  own filler offset: the filler sentence the prompt starts with); prefilled in
  ``--passkey-chunks`` chunks (of at least ``--chunk`` tokens), greedy decode,
  exact match of the first number in the answer. ``passkey_hits`` of
  ``passkey_cases``, ``passkey_acc``, its 95% Wilson score interval
  ``passkey_ci95``; ``passkey_by_length`` / ``passkey_by_depth`` break it down;
  ``passkey_no_number``: the misses whose answer holds no number at all (the model
  wrote words, e.g. " the pass key is ...", instead of a key), against misses with a
  wrong number (each case's ``number``: the first number of its answer, or null).
* chat: ``--chat-prompts`` short factual questions (:mod:`bench.factual_prompts`)
  sent as chats (the model's chat template with a generation prompt; through
  the vLLM server ``/v1/chat/completions``, temperature 0) after a fixed
  neutral system message and worked examples of about 480 tokens
  (``chat_context_tokens``), so that the question and the answer read
  quantized groups; greedy, at most ``--chat-tokens`` tokens.
  ``chat_same_as_bf16``: answers equal to bf16's (after strip), of
  ``chat_prompts``; ``chat_answers`` keeps them. Against the questions' answer
  key: ``chat_correct`` right answers, ``chat_facts_kept`` of bf16's
  ``chat_bf16_correct`` right answers still right (a fact the cache lost, not a
  coin flip on a question bf16 gets wrong too, nor the same fact in other words).
* ``agreement``: greedy tokens generated before the first divergence from the
  bf16 reference (at most ``--agreement-tokens``), averaged over
  ``--agreement-prompts`` prompts cut from the text after the perplexity span.
* bits: ``effective_bits`` (the pages: every stored byte per element) and
  ``effective_bits_at_8k`` (:meth:`KVScheme.effective_bits_at` of one
  8,192-token sequence: its pages plus its model-dtype staging, residual window
  and partial group; layers of ``--skip-layers`` at 16 bits); bf16 16, fp8 8.

Variants (``--variants``, also accepted in ``--kv-cache-dtype``): a scheme with
cache fields changed, one row each, labelled as written:
``SCHEME[@MOD[+MOD...]]`` with MOD ``R<N>`` (``residual_tokens`` N, ``R0``: no
bf16 window), ``S<N>`` (``sink_tokens``), ``L<N>`` (``leading_tokens``), ``G<N>`` (``block_tokens``), ``P<N>``
(``page_tokens``), ``hadamard`` / ``norotate`` (``rotate``), ``seed<N>``
(``rotate_seed``), ``H<N>`` (``retrieval_heads``), ``Hk``
(``retrieval_keys_only``), ``Hkivi<B>`` (``retrieval_scheme``), ``k<F>`` (VidKV's
key parameter ``k``), ``g<F>`` (its value threshold ``gamma``), ``nofft`` (its keys
without the FFT), ``K<N>`` (RVQ's ``num_codebooks``, its default codebooks
calibrated for N), e.g.
``vidkv@R0``, ``kivi2@hadamard``, ``kivi2@R0+hadamard``, ``vidkv@k0.375+H9``.
They go through the scheme-parameter path (``--scheme-params``, which takes
scheme names or variant labels as keys), so
the vLLM engine passes them to the server as ``lowbit_kv`` fields.

The figure (``--png``): PPL as a ratio to bf16's against
``effective_bits_at_8k``, every row labelled, with the Pareto frontier (no row
both fewer bits and lower PPL; lower left is better).

Eviction (``--kv-eviction POLICY[,POLICY...] --kv-retention R[,R...]``,
policies of :mod:`vllm_lowbit_kv.eviction`): every scheme also runs once per
(policy, retention), each a row with ``eviction`` and ``retention`` set (the
scheme's plain row has both ``null``). The KV is evicted once per sequence,
after its prompt's prefill, prompt tokens only:

* ``ppl``: the first ``--eviction-prompt-tokens`` P tokens of the text (a
  multiple of ``--chunk``; default half of the text) are the prompt: prefilled
  in chunks, then evicted; the rest is fed in chunks of ``--chunk`` and the
  perplexity is over the tokens predicted after eviction, ``ids[P+1:]``. Every
  row of an eviction run, the plain ones included, scores exactly those tokens.
* ``passkey``: the whole prompt (filler, needle, question) is prefilled, the
  first answer token comes from the prefill, the KV is evicted, the rest of
  the answer is decoded from the evicted cache.
* ``agreement`` and chat: each prompt is prefilled and evicted, then decoded.

An engine runs all variants of one prompt from one prefill
(:meth:`Engine.logprobs_variants`, :meth:`Engine.greedy_variants`).

The model runs behind an :class:`Engine` (``--engine``); ``hf`` is
transformers + :class:`vllm_lowbit_kv.hf_cache.LowBitKVCache`. A serving
engine (vLLM) implements the same methods. A scheme whose server refuses to
start (e.g. vLLM's ``fp8`` on a CPU without AVX-512) gets no row: ``refused``
lists its label and the server's reason, the other schemes run on, and the
command exits with status 1.

Schemes with learned codebooks (the ``rvq*`` schemes) need a codebook file
made for the model: ``--scheme-params`` can name one per scheme; otherwise the
default calibration of ``python -m vllm_lowbit_kv.calibrate --kv-cache-dtype
NAME --seed SEED`` is used (its file in the cache, calibrated on first use on
the held-out calibration text; :func:`vllm_lowbit_kv.calibrate.default_codebook`).
Each row records the file, its sha256, size and the command that made it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import re
import shlex
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from bench.plotting import pyplot, save
from bench.server import ServerRefused

REFERENCE = "bfloat16"
#: default passkey depths (fraction of the filler before the needle)
DEPTHS = (0.1, 0.35, 0.6, 0.85)
PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
                 "memorize it. I will quiz you about the important information there.\n\n")
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"
PASSKEY_GEN_TOKENS = 8
#: the filler's sentences: a prompt's filler cycles through them from its filler offset
PASSKEY_SENTENCES = tuple(x.strip() + "." for x in PASSKEY_FILLER.split(".") if x.strip())
#: two-sided 95% normal quantile (Wilson score interval)
WILSON_Z95 = 1.959963984540054
#: the context length of ``effective_bits_at_8k``
BITS_AT_TOKENS = 8192
#: bits per element of the KV dtypes that are no lowbit-kv scheme
NATIVE_BITS = {REFERENCE: 16.0, "fp8": 8.0}


# ----------------------------------------------------------------------------- engines
class Engine(ABC):
    """One model with one KV cache dtype. Token ids in, numbers out."""

    kv_cache_dtype: str
    head_dim: int
    max_positions: int
    num_layers: int
    #: the lowbit-kv scheme as configured (overrides applied); None: the engine's own dtype
    scheme: Any = None
    skip_layers: tuple[int, ...] = ()
    #: False: an eviction policy is refused with :meth:`eviction_refusal`
    supports_eviction: bool = False
    #: True: one engine runs every eviction variant from one prefill (the variant
    #: methods); False: the driver makes one engine per variant (``eviction=`` policy)
    variants_share_prefill: bool = False

    @abstractmethod
    def logprobs_teacher_forced(self, ids: Sequence[int], chunk: int) -> torch.Tensor:
        """float32 [len(ids) - 1]: log p(ids[i+1] | ids[:i+1]), prefilled ``chunk`` tokens at a time."""

    @abstractmethod
    def greedy(self, ids: Sequence[int], n: int, chunk: int,
               reference: Sequence[int] | None = None) -> list[int]:
        """Greedy continuation of ``ids`` (prefilled in chunks), up to ``n`` tokens.

        With ``reference``, an engine may stop right after the first token that differs
        from it (an optimisation: only the agreeing prefix is used)."""

    def kv_memory(self) -> dict[str, Any] | None:
        """Memory report of the last sequence's KV cache, if the engine can tell."""
        return None

    def effective_bits(self) -> float:
        return 16.0

    @property
    def model_kv_heads(self) -> int:
        """KV heads of the packed layers (layers x KV heads): retrieval heads are a share of them."""
        return (self.num_layers - len(self.skip_layers)) * self.kv_heads

    def effective_bits_at(self, context_tokens: int) -> float:
        """Honest bits per element of one ``context_tokens`` sequence over all layers:
        :meth:`KVScheme.effective_bits_at` (pages plus model-dtype staging) for packed
        layers, 16 for ``skip_layers``; :meth:`effective_bits` for the engine's own dtypes."""
        if self.scheme is None:
            return self.effective_bits()
        packed = self.scheme.effective_bits_at(context_tokens, self.head_dim,
                                               model_kv_heads=self.model_kv_heads)
        s = len(self.skip_layers)
        return ((self.num_layers - s) * packed + s * 16.0) / self.num_layers

    def chat_variants(self, ids: Sequence[int], question: str, n: int, chunk: int,
                      policies: Sequence[Any], stop_ids: set[int], tok) -> list[str]:
        """Per eviction policy: the greedy answer (at most ``n`` tokens, cut at the first of
        ``stop_ids``) to the chat prompt ``ids`` of ``question``, as text."""
        gens = (self.greedy_variants(ids, n, chunk, policies) if any(p is not None for p in policies)
                else [self.greedy(ids, n, chunk)])
        cut = [g[:next((i for i, t in enumerate(g) if t in stop_ids), len(g))] for g in gens]
        return [tok.decode(g, skip_special_tokens=True).strip() for g in cut]

    def eviction_refusal(self) -> str | None:
        """Why this engine cannot evict (None: it can)."""
        return None if self.supports_eviction else f"{type(self).__name__} does not evict"

    def _refuse_eviction(self, policies: Sequence[Any]) -> None:
        if any(p is not None for p in policies) and self.eviction_refusal():
            raise ValueError(f"--kv-eviction: {self.eviction_refusal()}")

    def logprobs_variants(self, ids: Sequence[int], chunk: int, prompt_tokens: int,
                          policies: Sequence[Any]) -> list[dict[str, Any]]:
        """Per eviction policy (None: no eviction): ``logprobs`` float32 ``[len(ids) - 1 -
        prompt_tokens]``, log p(ids[i+1] | ids[:i+1]) for i >= prompt_tokens, with the first
        ``prompt_tokens`` tokens prefilled in chunks and then evicted; ``plan`` (the eviction
        plan's summary) and ``kv_memory``. Engines that cannot evict run None only."""
        self._refuse_eviction(policies)
        return [dict(logprobs=self.logprobs_teacher_forced(ids, chunk)[prompt_tokens:], plan=None,
                     kv_memory=self.kv_memory()) for _ in policies]

    def greedy_variants(self, ids: Sequence[int], n: int, chunk: int, policies: Sequence[Any],
                        references: Sequence[Sequence[int] | None] | None = None) -> list[list[int]]:
        """:meth:`greedy` per eviction policy (None: no eviction), the KV evicted after the
        prompt's prefill; ``references`` per policy as :meth:`greedy`'s."""
        self._refuse_eviction(policies)
        refs = references or [None] * len(policies)
        return [self.greedy(ids, n, chunk, reference=r) for r in refs]


@lru_cache(maxsize=2)
def model_head_dim(model_dir: str | Path) -> int:
    """The model's head size from its configuration (what scheme parameters are checked for)."""
    from transformers import AutoConfig

    from vllm_lowbit_kv.codecs.base import ModelIdentity
    return ModelIdentity.from_hf_config(AutoConfig.from_pretrained(model_dir)).head_dim


@lru_cache(maxsize=2)
def _load_hf(model_dir: str, dtype: torch.dtype = torch.bfloat16):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.eval()


class HFEngine(Engine):
    """transformers model + LowBitKVCache (DynamicCache for the bf16 reference); weights
    and activations in ``dtype`` (the served model's bfloat16 unless a comparison asks
    for float32)."""

    supports_eviction = True
    variants_share_prefill = True

    def __init__(self, model_dir: str | Path, kv_cache_dtype: str, *, block_tokens: int | None = None,
                 sink_tokens: int | None = None, skip_layers: Sequence[int] = (),
                 relevance: str = "auto", params: dict[str, Any] | None = None,
                 dtype: torch.dtype = torch.bfloat16):
        from vllm_lowbit_kv.schemes import get_scheme
        self.model = _load_hf(str(model_dir), dtype)
        self.kv_cache_dtype = kv_cache_dtype
        cfg = self.model.config.get_text_config(decoder=True)
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_positions = cfg.max_position_embeddings
        self.num_layers = cfg.num_hidden_layers
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.skip_layers = tuple(skip_layers)
        self.scheme = None if kv_cache_dtype == REFERENCE else get_scheme(kv_cache_dtype)
        overrides = {k: v for k, v in (("block_tokens", block_tokens), ("sink_tokens", sink_tokens))
                     if v is not None} | dict(params or {})
        if self.scheme is not None and overrides:
            self.scheme = self.scheme.with_params(self.head_dim, **overrides)
        self.cache_kw = dict(skip_layers=self.skip_layers, relevance=relevance)
        self._last_cache = None

    def new_cache(self, evictable: bool = False):
        from transformers import DynamicCache

        from vllm_lowbit_kv.hf_cache import LowBitKVCache
        if self.scheme is None and not evictable:
            cache = DynamicCache()
        elif self.scheme is None:  # bf16 with eviction: every layer in the model dtype
            cache = LowBitKVCache(None, model=self.model, evictable=True)
        else:
            cache = LowBitKVCache(self.scheme, model=self.model, evictable=evictable, **self.cache_kw)
        self._last_cache = cache
        return cache

    def effective_bits(self) -> float:
        if self.scheme is None:
            return 16.0
        return self.scheme.effective_bits(self.head_dim, model_kv_heads=self.model_kv_heads)

    def _prefill(self, cache, ids: torch.Tensor, chunk: int, keep_logits: bool):
        """Chunked prefill; the logits of every position (keep_logits) or of the last one."""
        out = []
        for s in range(0, ids.shape[1], chunk):
            logits = self.model(ids[:, s:s + chunk], past_key_values=cache, use_cache=True).logits
            out.append(logits[0].float() if keep_logits else logits[0, -1:].float())
        return torch.cat(out) if keep_logits else out[-1][0]

    @torch.inference_mode()
    def logprobs_teacher_forced(self, ids, chunk):
        t = torch.as_tensor(list(ids), dtype=torch.long)[None]
        cache = self.new_cache()
        lp = []
        for s in range(0, t.shape[1] - 1, chunk):  # no forward needed for the last token
            logits = self.model(t[:, s:s + chunk], past_key_values=cache, use_cache=True).logits[0]
            tgt = t[0, s + 1:s + 1 + logits.shape[0]]
            lp.append(torch.log_softmax(logits[:tgt.shape[0]].float(), -1)
                      .gather(-1, tgt[:, None])[:, 0])
        return torch.cat(lp)

    @torch.inference_mode()
    def greedy(self, ids, n, chunk, reference=None):
        t = torch.as_tensor(list(ids), dtype=torch.long)[None]
        cache = self.new_cache()
        logits = self._prefill(cache, t, chunk, keep_logits=False)
        out: list[int] = []
        while True:
            tok = int(logits.argmax())
            out.append(tok)
            if len(out) >= n or (reference is not None and
                                 (len(out) > len(reference) or tok != reference[len(out) - 1])):
                return out
            logits = self.model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True).logits[0, -1]

    def _variants(self, cache, policies):
        """(policy, a cache to evict with it) per policy; the last one reuses ``cache``."""
        import copy
        for i, pol in enumerate(policies):
            c = cache if i == len(policies) - 1 else copy.deepcopy(cache)
            plan = c.evict(pol, self.model).summary() if pol is not None else None
            yield c, plan

    @torch.inference_mode()
    def logprobs_variants(self, ids, chunk, prompt_tokens, policies):
        require_chunked(prompt_tokens, chunk)
        t = torch.as_tensor(list(ids), dtype=torch.long)[None]
        evicting = any(p is not None for p in policies)
        cache = self.new_cache(evictable=evicting)
        for s in range(0, prompt_tokens, chunk):
            self.model(t[:, s:s + chunk], past_key_values=cache, use_cache=True)
        out = []
        for c, plan in self._variants(cache, policies):
            lp = []
            for s in range(prompt_tokens, t.shape[1] - 1, chunk):
                logits = self.model(t[:, s:min(s + chunk, t.shape[1] - 1)], past_key_values=c,
                                    use_cache=True).logits[0]
                tgt = t[0, s + 1:s + 1 + logits.shape[0]]
                lp.append(torch.log_softmax(logits.float(), -1).gather(-1, tgt[:, None])[:, 0])
            self._last_cache = c
            out.append(dict(logprobs=torch.cat(lp), plan=plan, kv_memory=self.kv_memory()))
        return out

    @torch.inference_mode()
    def greedy_variants(self, ids, n, chunk, policies, references=None):
        t = torch.as_tensor(list(ids), dtype=torch.long)[None]
        cache = self.new_cache(evictable=any(p is not None for p in policies))
        first = int(self._prefill(cache, t, chunk, keep_logits=False).argmax())
        refs = references or [None] * len(policies)
        outs = []
        for (c, _), ref in zip(self._variants(cache, policies), refs):
            out, tok = [first], first
            while len(out) < n and not (ref is not None and (len(out) > len(ref) or tok != ref[len(out) - 1])):
                tok = int(self.model(torch.tensor([[tok]]), past_key_values=c,
                                     use_cache=True).logits[0, -1].argmax())
                out.append(tok)
            outs.append(out)
        return outs

    def kv_memory(self):
        c = self._last_cache
        if c is None:
            return None
        if hasattr(c, "memory_report"):
            rep = c.memory_report()
            rep.pop("per_layer", None)
            return rep
        n = c.get_seq_length()
        nbytes = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in c.layers)
        return dict(scheme=REFERENCE, tokens=n, total_bytes=nbytes, bf16_bytes=nbytes, compression=1.0)


#: ``--engine`` name -> Engine class, or "module:Class" imported on use (so that a
#: serving engine can be listed here without importing vLLM for the hf engine).
#: Constructor: ``(model_dir, kv_cache_dtype, *, block_tokens, sink_tokens,
#: skip_layers, relevance, params)`` (``params``: the scheme's codec parameters, the
#: lowbit_kv fields); refuse options it cannot honour.
ENGINES: dict[str, type[Engine] | str] = {"hf": HFEngine, "vllm": "bench.vllm_engine:VllmEngine"}
#: KV dtypes an engine serves itself (not schemes of vllm_lowbit_kv.schemes): vLLM's own fp8.
ENGINE_NATIVE_DTYPES: dict[str, tuple[str, ...]] = {"vllm": ("fp8",)}


def require_chunked(prompt_tokens: int, chunk: int) -> None:
    if prompt_tokens < 0 or prompt_tokens % chunk:
        raise ValueError(f"--eviction-prompt-tokens must be a multiple of --chunk ({chunk}) and >= 0, "
                         f"got {prompt_tokens}")


def make_engine(kind: str, model_dir, kv_cache_dtype: str, **kw) -> Engine:
    if kind not in ENGINES:
        raise ValueError(f"--engine must be one of {sorted(ENGINES)}, got {kind!r}")
    cls = ENGINES[kind]
    if isinstance(cls, str):
        import importlib
        mod, _, attr = cls.partition(":")
        cls = getattr(importlib.import_module(mod), attr)
    return cls(model_dir, kv_cache_dtype, **kw)


# ----------------------------------------------------------------------------- tasks
def _filler(n: int, offset: int) -> str:
    """``n`` filler sentences, cycling through :data:`PASSKEY_SENTENCES` from ``offset``."""
    S = len(PASSKEY_SENTENCES)
    return "".join(PASSKEY_SENTENCES[(offset + i) % S] + " " for i in range(n))


def passkey_prompt(tok, length: int, depth: float, key: int, filler_offset: int = 0) -> list[int]:
    """Token ids of a passkey prompt of about ``length - PASSKEY_GEN_TOKENS`` tokens: the
    needle after ``depth`` of the filler sentences, the filler starting at sentence
    ``filler_offset`` of :data:`PASSKEY_SENTENCES`."""
    def n_tok(s: str) -> int:
        return len(tok(s, add_special_tokens=False).input_ids)
    needle = PASSKEY_NEEDLE.format(key=key)
    budget = length - PASSKEY_GEN_TOKENS
    fixed = n_tok(PASSKEY_INTRO + needle + PASSKEY_QUESTION)
    per_unit = (n_tok(_filler(55, filler_offset)) - n_tok(_filler(5, filler_offset))) / 50  # per sentence
    units = max(int((budget - fixed) / per_unit), 1)
    while True:
        before = round(depth * units)
        text = (PASSKEY_INTRO + _filler(before, filler_offset) + needle
                + _filler(units - before, filler_offset + before) + PASSKEY_QUESTION)
        ids = tok(text).input_ids
        if len(ids) <= budget or units == 1:
            return ids[-budget:]
        units -= max(1, int((len(ids) - budget) / per_unit))


def passkey_cells(lengths: Sequence[int], trials: int, seed: int,
                  depths: Sequence[float] = DEPTHS) -> list[dict]:
    """The passkey cases: every (length, depth, trial), each trial its own draw (seeded by
    ``seed``, length, depth index and trial) of the 5-digit key and the filler offset."""
    cells = []
    for L in lengths:
        for di, depth in enumerate(depths):
            for trial in range(trials):
                rng = random.Random(f"{seed}-{L}-{di}-{trial}")
                cells.append(dict(length=L, depth=depth, trial=trial, passkey=rng.randint(10000, 99999),
                                  filler_offset=rng.randrange(len(PASSKEY_SENTENCES))))
    return cells


def wilson_interval(hits: int, n: int, z: float = WILSON_Z95) -> list[float] | None:
    """Wilson score interval ``[lo, hi]`` of a binomial proportion ``hits / n`` (None for n = 0)."""
    if n <= 0:
        return None
    if not 0 <= hits <= n:
        raise ValueError(f"hits must be in [0, n={n}], got {hits}")
    p, z2 = hits / n, z * z
    den = 1 + z2 / n
    centre = (p + z2 / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / den
    return [max(0.0, centre - half), min(1.0, centre + half)]


def pareto_frontier(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates (lower x and lower y are better: a point
    is dominated by one with x and y both <= its own, one of them <); sorted by x, then y.
    Equal points are all kept."""
    idx = [i for i, (x, y) in enumerate(points)
           if not any(x2 <= x and y2 <= y and (x2 < x or y2 < y) for x2, y2 in points)]
    return sorted(idx, key=lambda i: (points[i][0], points[i][1]))


# ----------------------------------------------------------------------------- variants
#: the modifiers of a variant: (regular expression, scheme field, value from the match, help)
VARIANT_MODIFIERS: tuple[tuple[str, str, Any, str], ...] = (
    (r"R(\d+)", "residual_tokens", lambda m: int(m.group(1)), "R<N> (residual_tokens N; R0: no bf16 window)"),
    (r"S(\d+)", "sink_tokens", lambda m: int(m.group(1)), "S<N> (sink_tokens N)"),
    (r"L(\d+)", "leading_tokens", lambda m: int(m.group(1)),
     "L<N> (leading_tokens N: the first N tokens read as staged; L0: none)"),
    (r"G(\d+)", "block_tokens", lambda m: int(m.group(1)), "G<N> (block_tokens N: tokens per group)"),
    (r"P(\d+)", "page_tokens", lambda m: int(m.group(1)), "P<N> (page_tokens N: tokens per vLLM page)"),
    (r"hadamard", "rotate", lambda m: "hadamard", "hadamard (rotate hadamard)"),
    (r"norotate", "rotate", lambda m: "none", "norotate (rotate none)"),
    (r"seed(\d+)", "rotate_seed", lambda m: int(m.group(1)), "seed<N> (rotate_seed N)"),
    (r"int8staging", "staging_dtype", lambda m: "int8",
     "int8staging (staging_dtype int8: partial group and window in int8)"),
    (r"modelstaging", "staging_dtype", lambda m: "model",
     "modelstaging (staging_dtype model: partial group and window in the model dtype)"),
    (r"H(\d+)", "retrieval_heads", lambda m: int(m.group(1)), "H<N> (retrieval_heads N)"),
    (r"Hk", "retrieval_keys_only", lambda m: True, "Hk (retrieval_keys_only: keys only)"),
    (r"H(kivi\d)", "retrieval_scheme", lambda m: m.group(1),
     "Hkivi<B> (retrieval_scheme kivi<B>: the retrieval heads' codecs)"),
    (r"k(\d*\.?\d+)", "k", lambda m: float(m.group(1)),
     "k<F> (VidKV keys: share k of the channels at 2 bits)"),
    (r"g(\d*\.?\d+)", "gamma", lambda m: float(m.group(1)),
     "g<F> (VidKV values: ternary threshold gamma times the channel's mean |v|)"),
    (r"nofft", "fft", lambda m: False, "nofft (VidKV keys without the FFT)"),
    (r"K(\d+)", "num_codebooks", lambda m: int(m.group(1)),
     "K<N> (RVQ: N codebooks, the default codebooks calibrated for N)"),
)
VARIANT_FORM = "SCHEME[@MOD[+MOD...]] with MOD one of " + ", ".join(h for *_, h in VARIANT_MODIFIERS)


@dataclass(frozen=True)
class Variant:
    """One measured row: ``label`` as written, its ``scheme`` (a KV dtype) and the scheme
    fields its modifiers set (``mods``)."""

    label: str
    scheme: str
    mods: dict[str, Any] = field(default_factory=dict, hash=False)


def parse_variant(spec: str, native: Sequence[str] = ()) -> Variant:
    """``SCHEME[@MOD[+MOD...]]`` -> :class:`Variant` (:data:`VARIANT_FORM`); ValueError naming
    the allowed forms for a bad one. The scheme name itself is checked by the caller."""
    spec = spec.strip()
    scheme, at, rest = spec.partition("@")
    scheme = scheme.strip()
    if not scheme or any(c.isspace() for c in scheme):
        raise ValueError(f"bad variant {spec!r}: no scheme name (or a blank in it); the form is "
                         f"{VARIANT_FORM}")
    if not at:
        return Variant(scheme, scheme, {})
    if scheme == REFERENCE or scheme in native or scheme in NATIVE_BITS:
        raise ValueError(f"bad variant {spec!r}: {scheme} is not a lowbit-kv scheme and takes no "
                         f"modifiers; the form is {VARIANT_FORM}")
    mods: dict[str, Any] = {}
    for mod in rest.split("+"):
        mod = mod.strip()
        for pattern, key, value, _ in VARIANT_MODIFIERS:
            m = re.fullmatch(pattern, mod)
            if m:
                break
        else:
            raise ValueError(f"bad variant {spec!r}: modifier {mod!r} is not one of the allowed "
                             f"forms; the form is {VARIANT_FORM}")
        val = value(m)
        if key in mods and mods[key] != val:
            raise ValueError(f"bad variant {spec!r}: {key} set twice ({mods[key]!r}, {val!r})")
        mods[key] = val
    return Variant(spec, scheme, mods)


# ----------------------------------------------------------------------------- chat
def chat_prompt_ids(tok, question: str) -> list[int]:
    """Token ids of one chat question (:func:`bench.factual_prompts.chat_messages`): the
    tokenizer's chat template with a generation prompt, tokenized as vLLM's chat endpoint
    does (no extra special tokens); a plain-text transcript if the tokenizer has no template."""
    from bench.factual_prompts import chat_messages
    msgs = chat_messages(question)
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False).input_ids
    text = "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in msgs) + "Assistant:"
    return tok(text).input_ids


def chat_facts(answers: Sequence[str], bf16_answers: Sequence[str]) -> dict[str, int | None]:
    """``chat_correct``: answers holding their question's key
    (:func:`bench.factual_prompts.answer_is_correct`); ``chat_bf16_correct``: bf16's;
    ``chat_facts_kept``: questions both answer correctly (None without questions)."""
    from bench.factual_prompts import answer_is_correct
    if not answers:
        return dict(chat_correct=None, chat_bf16_correct=None, chat_facts_kept=None)
    right = [answer_is_correct(i, a) for i, a in enumerate(answers)]
    ref = [answer_is_correct(i, a) for i, a in enumerate(bf16_answers)]
    return dict(chat_correct=sum(right), chat_bf16_correct=sum(ref),
                chat_facts_kept=sum(a and b for a, b in zip(right, ref)))


def chat_context_tokens(tok) -> int:
    """Tokens of a chat prompt before its question (the common prefix of two questions' prompts)."""
    from bench.factual_prompts import CHAT_QUESTIONS
    a, b = chat_prompt_ids(tok, CHAT_QUESTIONS[0]), chat_prompt_ids(tok, CHAT_QUESTIONS[1])
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def stop_token_ids(tok, model_dir: str | Path) -> set[int]:
    """Token ids that end a chat answer: the tokenizer's EOS and the generation config's."""
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    try:
        from transformers import GenerationConfig
        eos = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except (OSError, ValueError):
        pass
    return ids


def agreement_prompts(ids: list[int], start: int, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens from the text, from ``start`` on (wrapping around)."""
    if n == 0:
        return []
    if len(ids) < length:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than --agreement-prompt-tokens={length}")
    span = len(ids) - length
    return [ids[(start + i * length) % (span + 1):][:length] for i in range(n)]


# ----------------------------------------------------------------------------- output
def format_table(rows: list[dict]) -> str:
    """Markdown table: scheme/variant, page bits, bits@8K, PPL, PPL ratio, passkey hits/cases
    [95% CI], chat answers equal to bf16's, bf16's right answers kept, agreement, seconds
    (``passkey_by_length`` and ``passkey_by_depth`` are in the JSON)."""
    head = ["scheme/variant", "page bits", "bits@8K", "PPL", "xbf16", "passkey [95% CI]", "chat=bf16",
            "facts kept", "agree", "s"]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    lines = []
    for r in rows:
        ci = r.get("passkey_ci95")
        pk = "-" if not r.get("passkey_cases") else (
            f"{r['passkey_hits']}/{r['passkey_cases']} [{ci[0]:.2f}, {ci[1]:.2f}]")
        chat = "-" if not r.get("chat_prompts") or r.get("chat_same_as_bf16") is None else \
            f"{r['chat_same_as_bf16']}/{r['chat_prompts']}"
        facts = "-" if r.get("chat_facts_kept") is None else \
            f"{r['chat_facts_kept']}/{r['chat_bf16_correct']}"
        lines.append([r.get("label", r["scheme"]), fmt(r.get("effective_bits"), ".3f"),
                      fmt(r.get("effective_bits_at_8k"), ".3f"), fmt(r["ppl"], ".3f"),
                      fmt(r["ppl_ratio_vs_bf16"], ".3f"), pk, chat, facts, fmt(r["agreement"], ".1f"),
                      fmt(r.get("seconds"), ".0f")])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]

    def md(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    out = [md(head), "|" + "|".join((":" if i == 0 else "-") + "-" * w + (":" if i else "-")
                                    for i, w in enumerate(widths)) + "|"]
    return "\n".join(out + [md(line) for line in lines])


def plot(rows: list[dict], path: str | Path, title: str) -> None:
    """PPL / bf16 PPL against ``effective_bits_at_8k``, every row labelled, the Pareto frontier
    (lower left is better) drawn as a staircase through its rows."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 6))
    pts = [r for r in rows if r.get("ppl_ratio_vs_bf16") is not None and math.isfinite(r["ppl_ratio_vs_bf16"])
           and r.get("effective_bits_at_8k") is not None]
    xy = [(r["effective_bits_at_8k"], r["ppl_ratio_vs_bf16"]) for r in pts]
    front = pareto_frontier(xy)
    on_front = set(front)
    for i, (r, (x, y)) in enumerate(zip(pts, xy)):
        ref = r["scheme"] == REFERENCE
        variant = "@" in r.get("label", "")
        ax.scatter(x, y, s=70 if ref else 40, marker="*" if ref else ("D" if variant else "o"),
                   color="black" if ref else ("tab:orange" if variant else "tab:blue"),
                   edgecolor="tab:red" if i in on_front else "none", linewidth=1.5, zorder=3)
        ax.annotate(r.get("label", r["scheme"]), (x, y), textcoords="offset points", xytext=(5, 4),
                    fontsize=7)
    if front:
        fx, fy = zip(*(xy[i] for i in front))
        ax.step(fx, fy, where="post", color="tab:red", lw=1.2, alpha=0.8, zorder=2,
                label="Pareto frontier (lower left is better)")
    ax.axhline(1.0, color="gray", ls="--", lw=0.8, label=f"{REFERENCE} PPL")
    ax.legend(loc="upper right", fontsize=8)
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.xaxis.set_major_locator(FixedLocator([1, 1.5, 2, 3, 4, 6, 8, 12, 16]))
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_xlim(min([1.0] + [0.9 * x for x, _ in xy]), 20)
    ax.set_xlabel(f"effective bits per KV element at {BITS_AT_TOKENS:,} tokens "
                  "(pages + staging, every stored byte)")
    ax.set_ylabel("teacher-forced chunked perplexity / bf16's (log)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    save(fig, path, dpi=120)


def plot_eviction(rows: list[dict], path: str | Path, title: str) -> None:
    """PPL and passkey accuracy vs retention, one line per (scheme, policy); dashed: the
    scheme without eviction."""
    plt = pyplot()
    schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    policies = list(dict.fromkeys(r["eviction"] for r in rows if r["eviction"]))
    colors = dict(zip(policies, ["tab:red", "tab:blue", "tab:green", "tab:orange", "tab:purple"]))
    fig, axes = plt.subplots(2, len(schemes), figsize=(4.5 * len(schemes), 7), squeeze=False)
    for j, sch in enumerate(schemes):
        plain = next(r for r in rows if r["scheme"] == sch and not r["eviction"])
        for i, (key, label) in enumerate((("ppl", "PPL after eviction (log)"),
                                          ("passkey_acc", "passkey accuracy"))):
            ax = axes[i][j]
            if plain[key] is not None:
                ax.axhline(plain[key], color="gray", ls="--", lw=1, label=f"{sch}, no eviction")
            for pol in policies:
                pts = sorted((r["retention"], r[key]) for r in rows
                             if r["scheme"] == sch and r["eviction"] == pol and r[key] is not None)
                if pts:
                    ax.plot(*zip(*pts), marker="o", color=colors[pol], label=pol)
            ax.set_xscale("log")
            rets = sorted({r["retention"] for r in rows if r["retention"]})
            ax.set_xticks(rets, [f"{x:g}" for x in rets])
            ax.minorticks_off()
            if key == "ppl":
                ax.set_yscale("log")
                ax.set_title(f"{sch}", fontsize=10)
            else:
                ax.set_ylim(-0.05, 1.05)
                ax.set_xlabel("retention (kept fraction of prompt KV pairs)")
            ax.set_ylabel(label)
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    save(fig, path, dpi=120)


# ----------------------------------------------------------------------------- driver
def _int_list(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()] if s and s.strip().lower() != "none" else []


def passkey_chunk(length: int, args: argparse.Namespace) -> int:
    return max(args.chunk, -(-length // args.passkey_chunks))


def eviction_variants(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """``[(label, policy)]``: ``(scheme label, None)`` first, then every (policy, retention)."""
    if not args.kv_eviction:
        return [("", None)]
    from vllm_lowbit_kv.eviction import make_policy
    kw = {k: v for k, v in (("gamma", args.eviction_gamma), ("sink_tokens", args.eviction_sink_tokens),
                            ("recent_window", args.eviction_recent_window)) if v is not None}
    out: list[tuple[str, Any]] = [("", None)]
    for name in dict.fromkeys(args.kv_eviction):
        for r in dict.fromkeys(args.kv_retention):
            try:
                pol = make_policy(name, r, seed=args.seed, **kw)
            except ValueError as e:
                raise SystemExit(f"--kv-eviction {name} --kv-retention {r}: {e}") from None
            out.append((f"{name}@{r:g}", pol))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.quality",
                                description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--kv-cache-dtype", default=None,
                   help="comma-separated scheme names, or variants as --variants (default: every "
                        "registered scheme, or none when --variants is given); "
                        f"the {REFERENCE} reference row is always included")
    p.add_argument("--variants", default=None,
                   help="comma-separated extra rows, each a scheme with cache fields changed, "
                        f"labelled as written: {VARIANT_FORM}; e.g. "
                        "'vidkv,vidkv@R0,kivi2@hadamard,kivi2@R0+hadamard'. Applied through the "
                        "scheme parameters (on top of --scheme-params for the scheme; a "
                        "--scheme-params key may also be a variant label)")
    p.add_argument("--model", default=None, help="HF model folder (default: prepare_model())")
    p.add_argument("--engine", default="hf", choices=sorted(ENGINES))
    p.add_argument("--text-file", default=None, help="evaluation text (default: vllm_lowbit_kv.corpus.default_text())")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--png", default=None,
                   help=f"plot PPL / bf16 PPL vs effective bits at {BITS_AT_TOKENS} tokens, with the "
                        "Pareto frontier, here")
    p.add_argument("--max-tokens", type=int, default=None, help="perplexity tokens [2048]")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk (tokens)")
    p.add_argument("--passkey-lengths", default=None,
                   help="comma-separated context lengths, or 'none' [1024,2048,3072,4096; "
                        "--quick: 1024,2048]")
    p.add_argument("--passkey-depths", default=",".join(map(str, DEPTHS)),
                   help="comma-separated needle depths in [0, 1]")
    p.add_argument("--passkey-trials", type=int, default=None,
                   help="draws per (length, depth), each its own key and filler offset [2; --quick: 1]")
    p.add_argument("--passkey-chunks", type=int, default=4,
                   help="passkey prompts are prefilled in this many chunks (each at least --chunk "
                        "tokens): the needle is read back through the quantized cache, at a "
                        "fraction of the cost of --chunk-sized steps over 8K tokens")
    p.add_argument("--chat-prompts", type=int, default=None,
                   help="factual chat questions (bench.factual_prompts, at most 20; 0: none) "
                        "[20; --quick: 5]")
    p.add_argument("--chat-tokens", type=int, default=24, help="max tokens of a chat answer")
    p.add_argument("--agreement-prompts", type=int, default=None, help="greedy-agreement prompts [4]")
    p.add_argument("--agreement-prompt-tokens", type=int, default=512, help="tokens per agreement prompt")
    p.add_argument("--agreement-tokens", type=int, default=None, help="max agreeing tokens counted [64]")
    p.add_argument("--block-tokens", type=int, default=None, help="override every scheme's block size")
    p.add_argument("--sink-tokens", type=int, default=None, help="override every scheme's sink tokens")
    p.add_argument("--skip-layers", default="", help="comma-separated layers kept in bf16")
    p.add_argument("--relevance", default="auto", choices=["auto", "attention", "keynorm", "none"],
                   help="STP relevance (LowBitKVCache): auto = attention mass of the last queries")
    p.add_argument("--kv-eviction", default=None,
                   help="comma-separated eviction policies (flashcache, uniform, random, recency): "
                        "every scheme also runs with each (policy, retention), the KV evicted once "
                        "after each prompt's prefill")
    p.add_argument("--kv-retention", default="0.2",
                   help="comma-separated retention ratios in (0, 1] (kept fraction of the prompt's KV pairs)")
    p.add_argument("--eviction-gamma", type=float, default=None,
                   help="FlashCache low-pass cut-off factor in (0, 1) [0.2]")
    p.add_argument("--eviction-sink-tokens", type=int, default=None,
                   help="first prompt tokens every policy keeps [4]")
    p.add_argument("--eviction-recent-window", type=int, default=None,
                   help="last prompt tokens every policy keeps [32]")
    p.add_argument("--eviction-prompt-tokens", type=int, default=None,
                   help="perplexity with eviction: this many leading tokens (a multiple of --chunk) are "
                        "the prompt, evicted after their prefill; PPL is over the tokens after them "
                        "[half the PPL tokens]")
    p.add_argument("--scheme-params", default=None,
                   help="JSON object: scheme name -> its codec parameters (lowbit_kv fields), e.g. "
                        "'{\"rvq\": {\"codebook\": \"rvq.safetensors\"}}'")
    p.add_argument("--seed", type=int, default=0,
                   help="passkey seed; also the calibration seed of default RVQ codebooks")
    p.add_argument("--quick", action="store_true",
                   help="smaller defaults: 1024 PPL tokens, passkey 1024,2048 x 4 depths x 1 "
                        "trial, 5 chat questions, 32 agreement tokens")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    from bench.factual_prompts import CHAT_QUESTIONS
    quick = dict(max_tokens=1024, passkey_lengths="1024,2048", passkey_trials=1, chat_prompts=5,
                 agreement_prompts=4, agreement_tokens=32)
    full = dict(max_tokens=2048, passkey_lengths="1024,2048,3072,4096", passkey_trials=2,
                chat_prompts=len(CHAT_QUESTIONS), agreement_prompts=4, agreement_tokens=64)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.passkey_lengths = _int_list(args.passkey_lengths)
    try:
        args.passkey_depths = [float(x) for x in (args.passkey_depths or "").split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--passkey-depths must be comma-separated numbers in [0, 1], got "
                         f"{args.passkey_depths!r}") from None
    if not all(0 <= d <= 1 for d in args.passkey_depths) or (args.passkey_lengths and not args.passkey_depths):
        raise SystemExit(f"--passkey-depths must be comma-separated numbers in [0, 1], got {args.passkey_depths}")
    if not 0 <= args.chat_prompts <= len(CHAT_QUESTIONS):
        raise SystemExit(f"--chat-prompts must be in [0, {len(CHAT_QUESTIONS)}], got {args.chat_prompts}")
    try:
        args.variants = [parse_variant(v, ENGINE_NATIVE_DTYPES.get(args.engine, ()))
                         for v in (args.variants or "").split(",") if v.strip()]
    except ValueError as e:
        raise SystemExit(f"--variants: {e}") from None
    try:
        args.scheme_params = json.loads(args.scheme_params) if args.scheme_params else {}
    except json.JSONDecodeError as e:
        raise SystemExit(f"--scheme-params: not valid JSON ({e})") from None
    if not isinstance(args.scheme_params, dict) or \
            not all(isinstance(v, dict) for v in args.scheme_params.values()):
        raise SystemExit("--scheme-params must be a JSON object of scheme name -> object of parameters")
    args.skip_layers = _int_list(args.skip_layers)
    args.kv_eviction = [x.strip() for x in (args.kv_eviction or "").split(",") if x.strip()]
    try:
        args.kv_retention = [float(x) for x in args.kv_retention.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--kv-retention must be comma-separated numbers in (0, 1], got "
                         f"{args.kv_retention!r}") from None
    for name in ("max_tokens", "chunk", "agreement_prompt_tokens", "passkey_chunks", "chat_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("passkey_trials", "agreement_prompts", "agreement_tokens"):
        if getattr(args, name) < 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 0")
    return args


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict:
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from vllm_lowbit_kv.schemes import SCHEMES, get_scheme

    native = ENGINE_NATIVE_DTYPES.get(args.engine, ())
    specs = [] if args.kv_cache_dtype is None and args.variants else \
        list(SCHEMES) if args.kv_cache_dtype is None else \
        [x for x in args.kv_cache_dtype.split(",") if x.strip()]
    try:
        rows_to_run = [parse_variant(x, native) for x in specs] + list(args.variants)
    except ValueError as e:
        raise SystemExit(f"--kv-cache-dtype: {e}") from None
    rows_to_run = [Variant(REFERENCE, REFERENCE)] + list(
        {v.label: v for v in rows_to_run if v.label != REFERENCE}.values())
    eng_overrides = {k: x for k, x in (("block_tokens", args.block_tokens),
                                       ("sink_tokens", args.sink_tokens)) if x is not None}
    for v in rows_to_run[1:]:
        if v.scheme in native:
            continue
        get_scheme(v.scheme)  # refuse unknown names and bad modifiers before any work
        get_scheme(v.scheme).with_params(model_head_dim(args.model), **v.mods, **eng_overrides)

    variants = eviction_variants(args)  # refuse bad eviction settings before any work

    if args.model is None:
        from vllm_lowbit_kv.model import prepare_model
        args.model = str(prepare_model())
    if args.text_file is None:
        from vllm_lowbit_kv.corpus import default_text
        text, text_src = default_text(), "vllm_lowbit_kv.corpus.default_text()"
    else:
        text, text_src = Path(args.text_file).read_text(encoding="utf-8"), str(args.text_file)

    tok = AutoTokenizer.from_pretrained(args.model)
    all_ids = tok(text).input_ids
    ppl_ids = all_ids[:args.max_tokens]
    if len(ppl_ids) < 2:
        raise SystemExit("the text has fewer than 2 tokens")
    prompt_tokens = 0  # PPL scores ids[prompt_tokens + 1:]
    if args.kv_eviction:
        prompt_tokens = args.eviction_prompt_tokens
        if prompt_tokens is None:
            prompt_tokens = len(ppl_ids) // 2 // args.chunk * args.chunk
        if prompt_tokens < 1 or prompt_tokens % args.chunk or prompt_tokens >= len(ppl_ids) - 1:
            raise SystemExit(f"--eviction-prompt-tokens must be a positive multiple of --chunk "
                             f"({args.chunk}) below the {len(ppl_ids)} PPL tokens, got {prompt_tokens}")
    prompts = agreement_prompts(all_ids, len(ppl_ids), args.agreement_prompts, args.agreement_prompt_tokens)
    cells = passkey_cells(args.passkey_lengths, args.passkey_trials, args.seed, args.passkey_depths)
    from bench.factual_prompts import CHAT_QUESTIONS
    questions = CHAT_QUESTIONS[:args.chat_prompts]
    chat_ids = [chat_prompt_ids(tok, q) for q in questions]
    stop_ids = stop_token_ids(tok, args.model)
    eng_kw = dict(block_tokens=args.block_tokens, sink_tokens=args.sink_tokens, skip_layers=args.skip_layers,
                  relevance=args.relevance)
    params, codebooks = scheme_params(rows_to_run[1:], args)
    probe = make_engine(args.engine, args.model, REFERENCE, **eng_kw)
    if args.kv_eviction and not probe.supports_eviction:
        raise SystemExit(f"--kv-eviction with --engine {args.engine}: {probe.eviction_refusal()}")
    for v in rows_to_run[1:]:  # the bits against this model's heads, before bf16's row runs
        if v.scheme in native:
            continue
        try:
            get_scheme(v.scheme).with_params(probe.head_dim,
                                             **{**eng_overrides, **params.get(v.label, {})}) \
                .effective_bits(probe.head_dim, model_kv_heads=probe.model_kv_heads)
        except ValueError as e:
            raise SystemExit(f"{v.label} on {Path(args.model).name}: {e}") from None
    too_long = [L for L in args.passkey_lengths if L > probe.max_positions]
    if too_long:
        raise SystemExit(f"--passkey-lengths {too_long} exceed the model's {probe.max_positions} positions")

    result: dict[str, Any] = dict(
        command="python -m bench.quality " + shlex.join(argv),
        model=Path(args.model).name, engine=args.engine,  # by name: results name no local path
        text=dict(source=text_src, sha256=hashlib.sha256(text.encode()).hexdigest(),
                  chars=len(text), tokens=len(all_ids)),
        settings=dict(max_tokens=args.max_tokens, ppl_tokens=len(ppl_ids), chunk=args.chunk,
                      passkey_lengths=args.passkey_lengths, passkey_chunks=args.passkey_chunks,
                      passkey_depths=list(args.passkey_depths), passkey_trials=args.passkey_trials,
                      passkey_cases=len(cells), chat_prompts=len(questions), chat_tokens=args.chat_tokens,
                      chat_context_tokens=chat_context_tokens(tok) if questions else None, passkey_gen_tokens=PASSKEY_GEN_TOKENS,
                      agreement_prompts=len(prompts), agreement_prompt_tokens=args.agreement_prompt_tokens,
                      agreement_tokens=args.agreement_tokens, block_tokens=args.block_tokens,
                      sink_tokens=args.sink_tokens, skip_layers=args.skip_layers, seed=args.seed,
                      relevance=args.relevance, scheme_params=params,
                      eviction=dict(policies=args.kv_eviction, retentions=args.kv_retention,
                                    **{k: v for k, v in variants[-1][1].describe().items()
                                       if k not in ("policy", "retention")},
                                    ppl_prompt_tokens=prompt_tokens,
                                    ppl_scored_tokens=len(ppl_ids) - 1 - prompt_tokens)
                      if args.kv_eviction else None,
                      model_dtype="bfloat16", torch_threads=torch.get_num_threads()),
        rows=[],
        refused=[],
    )
    work_per_scheme = (len(ppl_ids) + sum(c["length"] for c in cells)
                       + sum(len(x) + args.chat_tokens for x in chat_ids)
                       + len(prompts) * (args.agreement_prompt_tokens + args.agreement_tokens))
    bar = tqdm(total=work_per_scheme * len(rows_to_run), unit="tok", unit_scale=True, dynamic_ncols=True,
               disable=args.no_progress, desc="quality")
    ref: dict[str, Any] = dict(ppl=None, gen=[], chat=[])
    t_all = time.time()

    def run_group(variant: Variant, eng: Engine, group: list[tuple[str, Any]]) -> None:
        """One engine, its variants (eviction policies, None first if present): rows."""
        name = variant.label
        is_ref = variant.scheme == REFERENCE and group[0][1] is None  # bf16 without eviction
        t0 = time.time()
        policies = [pol for _, pol in group]
        V = len(group)
        bar.set_postfix_str(f"{name}: ppl")
        if args.kv_eviction:
            ppl_runs = eng.logprobs_variants(ppl_ids, args.chunk, prompt_tokens, policies)
        else:  # the plain yardstick: every token of the text
            ppl_runs = [dict(logprobs=eng.logprobs_teacher_forced(ppl_ids, args.chunk), plan=None,
                             kv_memory=eng.kv_memory())]
        ppls = [None if r["logprobs"] is None else math.exp(-r["logprobs"].double().mean().item())
                for r in ppl_runs]

        bar.set_postfix_str(f"{name}: passkey")
        details: list[list[dict]] = [[] for _ in range(V)]
        for c in cells:
            ids = passkey_prompt(tok, c["length"], c["depth"], c["passkey"], c["filler_offset"])
            gens = (eng.greedy_variants(ids, PASSKEY_GEN_TOKENS, passkey_chunk(c["length"], args), policies)
                    if args.kv_eviction else [eng.greedy(ids, PASSKEY_GEN_TOKENS, passkey_chunk(c["length"], args))])
            for v, gen in enumerate(gens):
                answer = tok.decode(gen, skip_special_tokens=True)
                m = re.search(r"\d+", answer)
                details[v].append(dict(c, prompt_tokens=len(ids), answer=answer,
                                       number=m.group(0) if m else None,
                                       correct=bool(m and m.group(0) == str(c["passkey"]))))

        bar.set_postfix_str(f"{name}: chat")
        chats: list[list[str]] = [[] for _ in range(V)]
        for q, ids in zip(questions, chat_ids):
            for v, answer in enumerate(eng.chat_variants(ids, q, args.chat_tokens, args.chunk, policies,
                                                         stop_ids, tok)):
                chats[v].append(answer)
        if is_ref:
            ref["chat"] = chats[0]

        bar.set_postfix_str(f"{name}: agreement")
        agree: list[list[int]] = [[] for _ in range(V)]
        for i, p in enumerate(prompts):
            if is_ref:
                ref["gen"].append(eng.greedy(p, args.agreement_tokens, args.chunk))
            refs = [ref["gen"][i]] * V
            gens = (eng.greedy_variants(p, args.agreement_tokens, args.chunk, policies, refs)
                    if args.kv_eviction else [eng.greedy(p, args.agreement_tokens, args.chunk, reference=refs[0])])
            for v, gen in enumerate(gens):
                agree[v].append(next((j for j, (a, b) in enumerate(zip(gen, refs[v])) if a != b),
                                     min(len(gen), len(refs[v]))))

        if is_ref:
            ref["ppl"] = ppls[0]
        seconds = round(time.time() - t0, 1)
        for v, ((label, pol), run_, ppl) in enumerate(zip(group, ppl_runs, ppls)):
            det = details[v]
            memory = run_["kv_memory"]
            hits = sum(d["correct"] for d in det)
            row = dict(
                scheme=variant.scheme, variant=variant.mods, eviction=pol.name if pol else None,
                retention=pol.retention if pol else None, label=f"{name}+{label}" if pol else name,
                effective_bits=eng.effective_bits(), effective_bits_at_8k=eng.effective_bits_at(BITS_AT_TOKENS),
                ppl=ppl, ppl_ratio_vs_bf16=None if ppl is None else ppl / ref["ppl"],
                passkey_hits=hits, passkey_cases=len(det),
                passkey_acc=hits / len(det) if det else None, passkey_ci95=wilson_interval(hits, len(det)),
                passkey_no_number=sum(d["number"] is None for d in det),
                passkey_by_length={str(L): sum(d["correct"] for d in det if d["length"] == L)
                                   / max(1, sum(d["length"] == L for d in det)) for L in args.passkey_lengths},
                passkey_by_depth={str(D): sum(d["correct"] for d in det if d["depth"] == D)
                                  / max(1, sum(d["depth"] == D for d in det)) for D in args.passkey_depths},
                chat_prompts=len(chats[v]),
                chat_same_as_bf16=sum(a == b for a, b in zip(chats[v], ref["chat"])) if questions else None,
                **chat_facts(chats[v], ref["chat"]),
                chat_answers=chats[v],
                agreement=(sum(agree[v]) / len(agree[v])) if agree[v] else None,
                agreement_per_prompt=agree[v],
                kv_bytes_per_token=(memory["total_bytes"] / memory["tokens"]
                                    if memory and memory.get("tokens") else None),
                kv_memory=memory, eviction_plan=run_["plan"], passkey_details=det,
                seconds=seconds if v == 0 else None,
            )
            if name in codebooks:  # learned state outside the pages, and how it was made
                row["codebook"] = codebooks[name]
            if run_.get("note"):
                row["note"] = run_["note"]
            if not args.kv_eviction:
                for k in ("eviction", "retention", "eviction_plan"):
                    row.pop(k)
            result["rows"].append(row)
            tqdm.write(f"{row['label']}: bits {row['effective_bits']:.3f} (at 8K "
                       f"{row['effective_bits_at_8k']:.3f})  ppl {ppl} (x{row['ppl_ratio_vs_bf16']})  "
                       f"passkey {hits}/{len(det)}  chat=bf16 {row['chat_same_as_bf16']}  "
                       f"agreement {row['agreement']}", file=sys.stderr)
        tqdm.write(f"{name}: {seconds:.0f}s", file=sys.stderr)
        result["elapsed_s"] = round(time.time() - t_all, 1)
        if args.json:  # after every group, so that an interrupted run keeps what it has
            _write_json(result, args.json)

    def run_scheme(variant: Variant) -> None:
        name = variant.label
        eng = probe if name == REFERENCE else make_engine(args.engine, args.model, variant.scheme, **eng_kw,
                                                          params=params.get(name))
        if not args.kv_eviction or eng.variants_share_prefill:
            run_group(variant, eng, variants)
            return
        run_group(variant, eng, variants[:1])  # one engine (server) per eviction setting
        if eng.eviction_refusal():
            tqdm.write(f"{name}: no eviction rows ({eng.eviction_refusal()})", file=sys.stderr)
            return
        for v in variants[1:]:
            run_group(variant, make_engine(args.engine, args.model, variant.scheme, eviction=v[1],
                                           **eng_kw, params=params.get(name)), [v])

    for variant in rows_to_run:
        try:
            run_scheme(variant)
        except ServerRefused as refused:  # the other schemes' rows still count
            if variant.label == REFERENCE:
                raise
            result["refused"].append(dict(label=variant.label, reason=refused.reason))
            tqdm.write(f"{variant.label}: refused, no row: {refused.reason}", file=sys.stderr)
            if args.json:
                _write_json(result, args.json)
        bar.update(work_per_scheme)
    bar.close()
    print(format_table(result["rows"]))
    for r in result["refused"]:
        print(f"refused {r['label']}: {r['reason']}")
    if args.png:
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        title = f"{Path(args.model).name}, {len(ppl_ids)} tokens, chunk {args.chunk}"
        if args.kv_eviction:
            plot_eviction(result["rows"], args.png, title + f", evicted after {prompt_tokens}")
        else:
            plot(result["rows"], args.png, title)
    return result


def scheme_params(rows: Sequence[Variant], args: argparse.Namespace
                  ) -> tuple[dict[str, dict], dict[str, dict]]:
    """Per row label: its scheme parameters (``--scheme-params`` of its scheme, then of its
    label, then its variant modifiers; plus the default codebook file for schemes with
    learned codebooks that name none) and a record of each codebook file."""
    from vllm_lowbit_kv.calibrate import default_codebook
    from vllm_lowbit_kv.codecs.rvq import RVQCodebooks

    known = {v.scheme for v in rows} | {v.label for v in rows}
    unknown = sorted(set(args.scheme_params) - known)
    if unknown:
        raise SystemExit(f"--scheme-params names schemes not measured here: {unknown} "
                         f"(measured: {[v.label for v in rows]})")
    params: dict[str, dict] = {}
    records = {}
    for v in rows:
        p = {**args.scheme_params.get(v.scheme, {}), **args.scheme_params.get(v.label, {}), **v.mods}
        if p:
            params[v.label] = p
        if "codebook" not in p:
            path = default_codebook(args.model, v.scheme, seed=args.seed,
                                    num_codebooks=p.get("num_codebooks"), progress=not args.no_progress)
            if path is None:  # no learned codebooks
                continue
            params.setdefault(v.label, {})["codebook"] = str(path)
        path = Path(params[v.label]["codebook"])
        books = RVQCodebooks.load(path)
        records[v.label] = dict(file=path.name, sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
                                codebook_bytes=books.nbytes, file_bytes=path.stat().st_size,
                                model=books.model.describe(), provenance=books.provenance)
    return params, records


def _write_json(result: dict, path: str | Path) -> None:
    """The result as JSON, naming no path of this machine (e.g. a codebook file of the
    cache as ``$VLLM_LOWBIT_KV_CACHE/...``, :mod:`bench.portable`)."""
    from bench.portable import portable

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(portable(json.dumps(result, indent=1)))
    tmp.replace(path)


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = resolve(build_parser().parse_args(argv))
    return run(args, argv)


if __name__ == "__main__":
    sys.exit(1 if main()["refused"] else 0)  # every other row is written; the run is not whole
