"""The quality yardstick: perplexity, passkey retrieval and greedy agreement per KV scheme.

    python -m bench.quality                                   # every registered scheme
    python -m bench.quality --kv-cache-dtype kivi2,kivi4 --json out.json --png out.png
    python -m bench.quality --quick                           # a few minutes
    python -m bench.quality --kv-cache-dtype rvq4x256 --scheme-params '{"rvq4x256": {"codebook": "cb.safetensors"}}'

Metrics (DESIGN.md, "How quality is measured"), each scheme against the
``bfloat16`` reference row, which is always run first:

* ``ppl``: teacher-forced perplexity over the first ``--max-tokens`` tokens of
  the text, prefilled in chunks of ``--chunk`` tokens, so that every chunk
  after the first attends to the (quantized) cache of the earlier chunks.
* ``passkey_acc``: a seeded random 5-digit number hidden in filler text at
  ``len(DEPTHS)`` depths for each context length, ``--passkey-trials`` numbers
  per (length, depth); prefilled in ``--passkey-chunks`` chunks (of at least
  ``--chunk`` tokens), greedy decode, exact match of the
  first number in the answer. ``passkey_by_length`` breaks it down.
* ``agreement``: greedy tokens generated before the first divergence from the
  bf16 reference (at most ``--agreement-tokens``), averaged over
  ``--agreement-prompts`` prompts cut from the text after the perplexity span.

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
* ``agreement``: each prompt is prefilled and evicted, then decoded.

An engine runs all variants of one prompt from one prefill
(:meth:`Engine.logprobs_variants`, :meth:`Engine.greedy_variants`).

The model runs behind an :class:`Engine` (``--engine``); ``hf`` is
transformers + :class:`vllm_lowbit_kv.hf_cache.LowBitKVCache`. A serving
engine (vLLM) implements the same methods.

Schemes with learned codebooks (the ``rvq*`` schemes) need a codebook file
made for the model: ``--scheme-params`` can name one per scheme; otherwise the
default calibration of ``python -m vllm_lowbit_kv.calibrate --kv-cache-dtype
NAME --seed SEED`` is used (its file in the cache, calibrated on first use on
the held-out calibration text; :func:`vllm_lowbit_kv.calibrate.ensure_codebook`).
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
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from bench.plotting import pyplot, save

REFERENCE = "bfloat16"
DEPTHS = (0.1, 0.5, 0.9)
PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
                 "memorize it. I will quiz you about the important information there.\n\n")
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"
PASSKEY_GEN_TOKENS = 8


# ----------------------------------------------------------------------------- engines
class Engine(ABC):
    """One model with one KV cache dtype. Token ids in, numbers out."""

    kv_cache_dtype: str
    head_dim: int
    max_positions: int
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
def _load_hf(model_dir: str):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    return model.eval()


class HFEngine(Engine):
    """transformers model + LowBitKVCache (DynamicCache for the bf16 reference)."""

    supports_eviction = True
    variants_share_prefill = True

    def __init__(self, model_dir: str | Path, kv_cache_dtype: str, *, block_tokens: int | None = None,
                 sink_tokens: int | None = None, skip_layers: Sequence[int] = (),
                 relevance: str = "auto", params: dict[str, Any] | None = None):
        from vllm_lowbit_kv.schemes import get_scheme
        self.model = _load_hf(str(model_dir))
        self.kv_cache_dtype = kv_cache_dtype
        cfg = self.model.config.get_text_config(decoder=True)
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_positions = cfg.max_position_embeddings
        self.scheme = None if kv_cache_dtype == REFERENCE else get_scheme(kv_cache_dtype)
        if self.scheme is not None and params:
            self.scheme = self.scheme.with_params(**params)
        self.cache_kw = dict(block_tokens=block_tokens, sink_tokens=sink_tokens,
                             skip_layers=tuple(skip_layers), relevance=relevance)
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
        return self.scheme.effective_bits(self.head_dim, self.cache_kw["block_tokens"])

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
def passkey_prompt(tok, length: int, depth: float, key: int) -> list[int]:
    """Token ids of a passkey prompt of about ``length - PASSKEY_GEN_TOKENS`` tokens."""
    def n_tok(s: str) -> int:
        return len(tok(s, add_special_tokens=False).input_ids)
    needle = PASSKEY_NEEDLE.format(key=key)
    budget = length - PASSKEY_GEN_TOKENS
    fixed = n_tok(PASSKEY_INTRO + needle + PASSKEY_QUESTION)
    per_unit = (n_tok(PASSKEY_FILLER * 11) - n_tok(PASSKEY_FILLER)) / 10  # marginal cost in a run
    units = max(int((budget - fixed) / per_unit), 1)
    while True:
        before = round(depth * units)
        text = (PASSKEY_INTRO + PASSKEY_FILLER * before + needle + PASSKEY_FILLER * (units - before)
                + PASSKEY_QUESTION)
        ids = tok(text).input_ids
        if len(ids) <= budget or units == 1:
            return ids[-budget:]
        units -= max(1, int((len(ids) - budget) / per_unit))


def passkey_cells(lengths: Sequence[int], trials: int, seed: int) -> list[dict]:
    cells = []
    for L in lengths:
        for di, depth in enumerate(DEPTHS):
            for trial in range(trials):
                rng = random.Random(f"{seed}-{L}-{di}-{trial}")
                cells.append(dict(length=L, depth=depth, trial=trial, passkey=rng.randint(10000, 99999)))
    return cells


def agreement_prompts(ids: list[int], start: int, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens from the text, from ``start`` on (wrapping around)."""
    if n == 0:
        return []
    if len(ids) < length:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than --agreement-prompt-tokens={length}")
    span = len(ids) - length
    return [ids[(start + i * length) % (span + 1):][:length] for i in range(n)]


# ----------------------------------------------------------------------------- output
def format_table(rows: list[dict], lengths: Sequence[int]) -> str:
    head = ["scheme", "bits", "PPL", "xbf16", "passkey"] + [f"pk@{L}" for L in lengths] + ["agree", "s"]
    lines = []
    for r in rows:
        by = r.get("passkey_by_length") or {}
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        lines.append([r.get("label", r["scheme"]), fmt(r["effective_bits"], ".3f"), fmt(r["ppl"], ".3f"),
                      fmt(r["ppl_ratio_vs_bf16"], ".3f"), fmt(r["passkey_acc"], ".2f")]
                     + [fmt(by.get(str(L)), ".2f") for L in lengths]
                     + [fmt(r["agreement"], ".1f"), fmt(r.get("seconds"), ".0f")])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths)))]
    out.append("  ".join("-" * w for w in widths))
    for line in lines:
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(line, widths))))
    return "\n".join(out)


def plot(rows: list[dict], path: str | Path, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    pts = [r for r in rows if r["ppl"] is not None and math.isfinite(r["ppl"])]
    for r in pts:
        ref = r["scheme"] == REFERENCE
        ax.scatter(r["effective_bits"], r["ppl"], s=40, marker="*" if ref else "o",
                   color="black" if ref else "tab:blue", zorder=3)
        ax.annotate(r["scheme"], (r["effective_bits"], r["ppl"]), textcoords="offset points",
                    xytext=(5, 4), fontsize=8)
    ref = next((r for r in pts if r["scheme"] == REFERENCE), None)
    if ref is not None:
        ax.axhline(ref["ppl"], color="gray", ls="--", lw=0.8, label=f"{REFERENCE} PPL {ref['ppl']:.2f}")
        ax.legend(loc="upper right")
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.xaxis.set_major_locator(FixedLocator([1, 1.5, 2, 3, 4, 6, 8, 12, 16]))
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_xlim(min([1.0] + [0.9 * r["effective_bits"] for r in pts]), 20)
    ax.set_xlabel("effective bits per KV element (every stored byte counted)")
    ax.set_ylabel("teacher-forced chunked perplexity (log)")
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
                   help="comma-separated scheme names (default: every registered scheme); "
                        f"the {REFERENCE} reference row is always included")
    p.add_argument("--model", default=None, help="HF model folder (default: prepare_model())")
    p.add_argument("--engine", default="hf", choices=sorted(ENGINES))
    p.add_argument("--text-file", default=None, help="evaluation text (default: bench.corpus.default_text())")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--png", default=None, help="plot PPL vs effective bits here")
    p.add_argument("--max-tokens", type=int, default=None, help="perplexity tokens [2048]")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk (tokens)")
    p.add_argument("--passkey-lengths", default=None,
                   help="comma-separated context lengths, or 'none' [1024,2048,4096,8192]")
    p.add_argument("--passkey-trials", type=int, default=None,
                   help=f"passkeys per (length, depth); {len(DEPTHS)} depths {DEPTHS} [1]")
    p.add_argument("--passkey-chunks", type=int, default=4,
                   help="passkey prompts are prefilled in this many chunks (each at least --chunk "
                        "tokens): the needle is read back through the quantized cache, at a "
                        "fraction of the cost of --chunk-sized steps over 8K tokens")
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
                   help="smaller defaults: 1024 PPL tokens, passkey 1024,2048, 32 agreement tokens")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    quick = dict(max_tokens=1024, passkey_lengths="1024,2048", passkey_trials=1,
                 agreement_prompts=4, agreement_tokens=32)
    full = dict(max_tokens=2048, passkey_lengths="1024,2048,4096,8192", passkey_trials=1,
                agreement_prompts=4, agreement_tokens=64)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.passkey_lengths = _int_list(args.passkey_lengths)
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
    for name in ("max_tokens", "chunk", "agreement_prompt_tokens", "passkey_chunks"):
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

    names = list(SCHEMES) if args.kv_cache_dtype is None else \
        [s.strip() for s in args.kv_cache_dtype.split(",") if s.strip()]
    names = [REFERENCE] + [n for n in dict.fromkeys(names) if n != REFERENCE]
    for n in names[1:]:
        if n in ENGINE_NATIVE_DTYPES.get(args.engine, ()):
            continue
        get_scheme(n)  # refuse unknown names before any work
        if args.block_tokens is not None or args.sink_tokens is not None:
            get_scheme(n).with_params(**{k: v for k, v in (("block_tokens", args.block_tokens),
                                                           ("sink_tokens", args.sink_tokens))
                                         if v is not None})

    variants = eviction_variants(args)  # refuse bad eviction settings before any work

    if args.model is None:
        from vllm_lowbit_kv.model import prepare_model
        args.model = str(prepare_model())
    if args.text_file is None:
        from bench.corpus import default_text
        text, text_src = default_text(), "bench.corpus.default_text()"
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
    cells = passkey_cells(args.passkey_lengths, args.passkey_trials, args.seed)
    eng_kw = dict(block_tokens=args.block_tokens, sink_tokens=args.sink_tokens, skip_layers=args.skip_layers,
                  relevance=args.relevance)
    params, codebooks = scheme_params(names[1:], args)
    probe = make_engine(args.engine, args.model, REFERENCE, **eng_kw)
    if args.kv_eviction and not probe.supports_eviction:
        raise SystemExit(f"--kv-eviction with --engine {args.engine}: {probe.eviction_refusal()}")
    too_long = [L for L in args.passkey_lengths if L > probe.max_positions]
    if too_long:
        raise SystemExit(f"--passkey-lengths {too_long} exceed the model's {probe.max_positions} positions")

    result: dict[str, Any] = dict(
        command="python -m bench.quality " + shlex.join(argv),
        model=str(args.model), engine=args.engine,
        text=dict(source=text_src, sha256=hashlib.sha256(text.encode()).hexdigest(),
                  chars=len(text), tokens=len(all_ids)),
        settings=dict(max_tokens=args.max_tokens, ppl_tokens=len(ppl_ids), chunk=args.chunk,
                      passkey_lengths=args.passkey_lengths, passkey_chunks=args.passkey_chunks, passkey_depths=list(DEPTHS),
                      passkey_trials=args.passkey_trials, passkey_gen_tokens=PASSKEY_GEN_TOKENS,
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
    )
    work_per_scheme = (len(ppl_ids) + sum(c["length"] for c in cells)
                       + len(prompts) * (args.agreement_prompt_tokens + args.agreement_tokens))
    bar = tqdm(total=work_per_scheme * len(names), unit="tok", unit_scale=True, dynamic_ncols=True,
               disable=args.no_progress, desc="quality")
    ref: dict[str, Any] = dict(ppl=None, gen=[])
    t_all = time.time()

    def run_group(name: str, eng: Engine, group: list[tuple[str, Any]]) -> None:
        """One engine, its variants (eviction policies, None first if present): rows."""
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
            ids = passkey_prompt(tok, c["length"], c["depth"], c["passkey"])
            gens = (eng.greedy_variants(ids, PASSKEY_GEN_TOKENS, passkey_chunk(c["length"], args), policies)
                    if args.kv_eviction else [eng.greedy(ids, PASSKEY_GEN_TOKENS, passkey_chunk(c["length"], args))])
            for v, gen in enumerate(gens):
                answer = tok.decode(gen, skip_special_tokens=True)
                m = re.search(r"\d+", answer)
                details[v].append(dict(c, prompt_tokens=len(ids), answer=answer,
                                       correct=bool(m and m.group(0) == str(c["passkey"]))))

        bar.set_postfix_str(f"{name}: agreement")
        agree: list[list[int]] = [[] for _ in range(V)]
        for i, p in enumerate(prompts):
            if name == REFERENCE and policies[0] is None:  # the reference: bf16 without eviction
                ref["gen"].append(eng.greedy(p, args.agreement_tokens, args.chunk))
            refs = [ref["gen"][i]] * V
            gens = (eng.greedy_variants(p, args.agreement_tokens, args.chunk, policies, refs)
                    if args.kv_eviction else [eng.greedy(p, args.agreement_tokens, args.chunk, reference=refs[0])])
            for v, gen in enumerate(gens):
                agree[v].append(next((j for j, (a, b) in enumerate(zip(gen, refs[v])) if a != b),
                                     min(len(gen), len(refs[v]))))

        if name == REFERENCE and policies[0] is None:
            ref["ppl"] = ppls[0]
        seconds = round(time.time() - t0, 1)
        for v, ((label, pol), run_, ppl) in enumerate(zip(group, ppl_runs, ppls)):
            det = details[v]
            memory = run_["kv_memory"]
            row = dict(
                scheme=name, eviction=pol.name if pol else None, retention=pol.retention if pol else None,
                label=f"{name}+{label}" if pol else name, effective_bits=eng.effective_bits(), ppl=ppl,
                ppl_ratio_vs_bf16=None if ppl is None else ppl / ref["ppl"],
                passkey_acc=(sum(d["correct"] for d in det) / len(det)) if det else None,
                passkey_by_length={str(L): sum(d["correct"] for d in det if d["length"] == L)
                                   / max(1, sum(d["length"] == L for d in det)) for L in args.passkey_lengths},
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
                for k in ("eviction", "retention", "label", "eviction_plan"):
                    row.pop(k)
            result["rows"].append(row)
            tqdm.write(f"{row.get('label', name)}: bits {row['effective_bits']:.3f}  ppl {ppl}  "
                       f"(x{row['ppl_ratio_vs_bf16']})  passkey {row['passkey_acc']}  "
                       f"agreement {row['agreement']}", file=sys.stderr)
        tqdm.write(f"{name}: {seconds:.0f}s", file=sys.stderr)
        result["elapsed_s"] = round(time.time() - t_all, 1)
        if args.json:  # after every group, so that an interrupted run keeps what it has
            _write_json(result, args.json)

    for name in names:
        eng = probe if name == REFERENCE else make_engine(args.engine, args.model, name, **eng_kw,
                                                          params=params.get(name))
        if not args.kv_eviction or eng.variants_share_prefill:
            run_group(name, eng, variants)
        else:  # one engine (server) per eviction setting
            run_group(name, eng, variants[:1])
            if eng.eviction_refusal():
                tqdm.write(f"{name}: no eviction rows ({eng.eviction_refusal()})", file=sys.stderr)
                continue
            for v in variants[1:]:
                run_group(name, make_engine(args.engine, args.model, name, eviction=v[1], **eng_kw,
                                            params=params.get(name)), [v])
        bar.update(work_per_scheme)
    bar.close()
    print(format_table(result["rows"], args.passkey_lengths))
    if args.png:
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        title = f"{Path(args.model).name}, {len(ppl_ids)} tokens, chunk {args.chunk}"
        if args.kv_eviction:
            plot_eviction(result["rows"], args.png, title + f", evicted after {prompt_tokens}")
        else:
            plot(result["rows"], args.png, title)
    return result


def scheme_params(names: Sequence[str], args: argparse.Namespace) -> tuple[dict[str, dict], dict[str, dict]]:
    """Per scheme: its codec parameters (``--scheme-params``, plus the default codebook file
    for schemes with learned codebooks that name none) and a record of each codebook file."""
    from vllm_lowbit_kv.calibrate import CalibrationConfig, ensure_codebook
    from vllm_lowbit_kv.codecs.rvq import RVQCodebooks
    from vllm_lowbit_kv.schemes import SCHEMES

    unknown = sorted(set(args.scheme_params) - set(names))
    if unknown:
        raise SystemExit(f"--scheme-params names schemes not measured here: {unknown} (measured: {list(names)})")
    params = {n: dict(p) for n, p in args.scheme_params.items()}
    records = {}
    for n in names:
        if n not in SCHEMES or not SCHEMES[n].key.accepts("codebook"):
            continue
        if "codebook" not in params.get(n, {}):
            path = ensure_codebook(args.model, CalibrationConfig(scheme=n, seed=args.seed),
                                   progress=not args.no_progress)
            params.setdefault(n, {})["codebook"] = str(path)
        path = Path(params[n]["codebook"])
        books = RVQCodebooks.load(path)
        records[n] = dict(path=str(path), sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
                          codebook_bytes=books.nbytes, file_bytes=path.stat().st_size,
                          model=books.model.describe(), provenance=books.provenance)
    return params, records


def _write_json(result: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = resolve(build_parser().parse_args(argv))
    return run(args, argv)


if __name__ == "__main__":
    main()
