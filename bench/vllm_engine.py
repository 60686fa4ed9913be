"""The yardstick's :class:`~bench.quality.Engine` through the real vLLM server path.

    python -m bench.quality --engine vllm --kv-cache-dtype fp8,kivi2,vidkv

Each KV dtype gets one server of the benchmarks' harness
(:func:`bench.server.measurement_server`: ``python -m serving --kv-cache-dtype X``,
scheme overrides as ``--additional-config '{"lowbit_kv": {...}}'``), started on
first use and again for each new chunk size (see :meth:`VllmEngine.server_for`).
The chunk is vLLM's ``--max-num-batched-tokens``: its chunked prefill then feeds a
long prompt C tokens per step, so every token after the first chunk attends to
the cached (quantized) KV, as the HF engine's chunked prefill does. Prefix
caching is off so that every request starts from an empty cache (a prefix hit
would make a later request read packed pages where the first one attended its
own chunk exactly). Servers of one dtype at a time are alive per process (the
current one and the engine's previous chunk size); an engine restarts its server
if used again after another engine's.

What goes over HTTP (``/v1/completions``, prompts as token-id lists):

* teacher-forced log-probs: ``max_tokens=1`` with vLLM's extra parameter
  ``prompt_logprobs=0``. vLLM 0.32 then returns ``choices[0].prompt_logprobs``,
  one entry per prompt token: ``null`` for the first, then ``{"<token id>":
  {"logprob", "rank", "decoded_token"}}`` holding the prompt token itself (0 =
  no extra top-k entries), i.e. log p(ids[i] | ids[:i]) computed from the
  prefill logits in float32. Entry i+1 is the yardstick's ``lp[i]``.
* greedy: ``temperature=0``, ``max_tokens=n``, ``ignore_eos=true`` (the HF
  engine does not stop at EOS either), ``return_token_ids=true``.
* KV capacity: ``/metrics``, gauge ``vllm:cache_config_info`` labels
  ``kv_cache_size_tokens`` / ``kv_cache_memory_bytes`` / ``num_gpu_blocks``
  (fallback: the start-up log line "KV cache size: N tokens").

Dtypes: ``bfloat16`` (the reference; vLLM's own CPU attention), ``fp8`` (vLLM's
own quantized cache) and every scheme of :mod:`vllm_lowbit_kv.schemes` the
backend agrees to serve. A server that refuses to start raises
:class:`bench.server.ServerRefused` with the reason from its log.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.quality import Engine
from bench.server import Server, measurement_server, stop_all

#: vLLM's own KV dtypes this engine runs (besides our schemes); bits per element.
#: Other stock dtypes are refused: vLLM 0.32's turboquant_* and int4_per_token_head
#: are silently broken on the CPU build (DESIGN.md).
NATIVE_DTYPES = {"bfloat16": 16.0, "auto": 16.0, "fp8": 8.0}


def model_geometry(model_dir: str | Path) -> dict[str, int]:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    return dict(layers=cfg["num_hidden_layers"], kv_heads=cfg.get("num_key_value_heads", heads),
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                max_positions=cfg.get("max_position_embeddings", 2048))


class VllmEngine(Engine):
    """A vLLM server with ``--kv-cache-dtype kv_cache_dtype``, driven over HTTP.

    Constructor as the yardstick's ``make_engine`` calls it. ``block_tokens`` /
    ``sink_tokens`` / ``skip_layers`` go to the server as
    ``--additional-config '{"lowbit_kv": {...}}'`` (the backend validates them and
    refuses what it cannot serve), and so do ``params`` (codec parameters, e.g. an
    RVQ ``codebook`` file); ``relevance`` must stay ``auto`` (the backend
    computes its own). They are ignored for vLLM's own dtypes, as the HF engine
    ignores them for the bf16 reference.

    ``eviction`` (an :class:`~vllm_lowbit_kv.eviction.EvictionPolicy`): the server
    evicts every request after its prefill (``lowbit_kv`` fields ``eviction``,
    ``retention``, ``eviction_gamma``, ``eviction_sinks``, ``recent_window``); one
    engine per policy (the yardstick makes them). Generation only: vLLM computes
    ``prompt_logprobs`` during the prefill, before the eviction, so there is no
    teacher-forced perplexity after eviction (its rows say ``ppl: null``).
    """

    supports_eviction = True

    def __init__(self, model_dir: str | Path, kv_cache_dtype: str, *, block_tokens: int | None = None,
                 sink_tokens: int | None = None, skip_layers: Sequence[int] = (), relevance: str = "auto",
                 params: dict[str, Any] | None = None, max_model_len: int | None = None,
                 kv_space_gib: int | None = None, extra_args: Sequence[str] = (), eviction: Any = None):
        self.model_dir = str(model_dir)
        self.eviction = eviction
        self.kv_cache_dtype = kv_cache_dtype
        geo = model_geometry(model_dir)
        self.geometry = geo
        self.head_dim = geo["head_dim"]
        self.num_layers = geo["layers"]
        self.kv_heads = geo["kv_heads"]
        self.skip_layers = tuple(skip_layers)
        self.max_positions = int(max_model_len or min(geo["max_positions"],
                                                      int(os.environ.get("VLLM_ENGINE_MAX_MODEL_LEN", 8192))))
        self.kv_space_gib, self.extra_args = kv_space_gib, list(extra_args)
        if relevance != "auto":
            raise ValueError(f"--engine vllm: --relevance {relevance!r} is not supported (the vLLM "
                             "backend computes relevance itself); use auto")
        self.scheme = None
        self.overrides: dict[str, Any] = {}
        if kv_cache_dtype in NATIVE_DTYPES:
            self._bits = NATIVE_DTYPES[kv_cache_dtype]
        else:
            from vllm_lowbit_kv.schemes import SCHEMES, get_scheme
            if kv_cache_dtype not in SCHEMES and (kv_cache_dtype.startswith(("fp8", "turboquant", "int"))):
                raise ValueError(f"--engine vllm runs vLLM's own KV dtypes {sorted(NATIVE_DTYPES)} only; "
                                 f"{kv_cache_dtype!r} is not measured here (vLLM 0.32's turboquant_* and "
                                 "int4_per_token_head give garbage on the CPU build)")
            scheme = get_scheme(kv_cache_dtype)  # unknown names: ValueError listing the valid ones
            self.overrides = {k: v for k, v in (("block_tokens", block_tokens), ("sink_tokens", sink_tokens))
                              if v is not None}
            if skip_layers:
                self.overrides["skip_layers"] = list(skip_layers)
            self.overrides.update(params or {})
            codec_overrides = {k: v for k, v in self.overrides.items() if k != "skip_layers"}
            self.scheme = scheme.with_params(self.head_dim, **codec_overrides) \
                if codec_overrides else scheme
            self._bits = self.scheme.effective_bits(self.head_dim, model_kv_heads=self.model_kv_heads)
            if eviction is not None:
                self.overrides.update(eviction=eviction.name, retention=eviction.retention,
                                      eviction_gamma=eviction.gamma, eviction_sinks=eviction.sink_tokens,
                                      recent_window=eviction.recent_window)
        if eviction is not None and self.eviction_refusal():
            raise ValueError(f"--kv-eviction: {self.eviction_refusal()}")
        self.server: Server | None = None
        self._servers: dict[int, Server] = {}
        self._main_chunk: int | None = None  # the first chunk asked for (the yardstick's --chunk)
        self._last_tokens: int | None = None

    # ------------------------------------------------------------------ server
    def server_for(self, chunk: int) -> Server:
        """The running server for this dtype and ``chunk`` (``max_num_batched_tokens``).

        A chunk is a server setting, so a new chunk means a new server. This engine
        keeps the server of its first chunk (the yardstick's ``--chunk``, to which it
        returns after passkey prompts prefilled in larger chunks) and the one of the
        latest other chunk alive; starting a server stops all others, those of other
        engines included (one dtype at a time: vLLM on
        CPU takes the cores, and the yardstick never goes back to a finished dtype).
        """
        if self.server is not None and self.server.alive and \
                self.server.arg("--max-num-batched-tokens") == str(chunk):
            return self.server
        cached = self._servers.get(chunk)
        if cached is not None and cached.alive:
            self.server = cached
            return cached
        if self._main_chunk is None:
            self._main_chunk = chunk
        stop_all(keep=self._servers.get(self._main_chunk))  # one dtype at a time
        self._servers = {c: s for c, s in self._servers.items() if s.alive}
        new = measurement_server(self.model_dir, self.kv_cache_dtype, chunk=chunk,
                                 max_model_len=self.max_positions, kv_space_gib=self.kv_space_gib,
                                 additional_config=self.overrides, extra_args=self.extra_args)
        new.start()
        self._servers[chunk] = self.server = new
        return new

    def close(self) -> None:
        for s in [*self._servers.values(), self.server]:
            if s is not None:
                s.stop()

    def _check_len(self, n: int) -> None:
        if n > self.max_positions:
            raise ValueError(f"{n} tokens exceed the server's --max-model-len {self.max_positions}")

    # ------------------------------------------------------------------ Engine
    def logprobs_teacher_forced(self, ids, chunk):
        ids = list(ids)
        self._check_len(len(ids))
        lp = self.server_for(chunk).prompt_logprobs(ids)
        self._last_tokens = len(ids)
        return lp

    def greedy(self, ids, n, chunk, reference=None):
        # ``reference`` (early stop) is not used: n is small and a request runs to the end.
        ids = list(ids)
        self._check_len(len(ids) + n)
        out = self.server_for(chunk).greedy(ids, n)
        self._last_tokens = len(ids) + len(out)
        return out

    def eviction_refusal(self) -> str | None:
        if self.scheme is None:
            return (f"vLLM's own attention for --kv-cache-dtype {self.kv_cache_dtype} cannot read "
                    "per-layer kept lengths (eviction needs a lowbit-kv scheme)")
        return None

    def _check_variants(self, policies) -> None:
        if list(policies) != [self.eviction]:
            raise ValueError(f"this engine's server runs eviction={self.eviction!r} only, asked for "
                             f"{policies!r}: make one engine per policy")

    def logprobs_variants(self, ids, chunk, prompt_tokens, policies):
        self._check_variants(policies)
        if self.eviction is None:
            return super().logprobs_variants(ids, chunk, prompt_tokens, policies)
        return [dict(logprobs=None, plan=None, kv_memory=None,
                     note="no teacher-forced PPL after eviction on vLLM (prompt_logprobs come "
                          "from the prefill, before the eviction)")]

    def greedy_variants(self, ids, n, chunk, policies, references=None):
        self._check_variants(policies)
        return [self.greedy(ids, n, chunk)]

    def chat_variants(self, ids, question, n, chunk, policies, stop_ids, tok):
        """The answer through the server's ``/v1/chat/completions`` (the model's chat
        template, greedy, stopping at the model's end of turn), as a user asks it."""
        from bench.factual_prompts import chat_messages
        self._check_variants(policies)
        self._check_len(len(ids) + n)
        server = self.server_for(chunk)
        out = server.post("/v1/chat/completions", dict(model=server.model_name, temperature=0,
                                                       messages=chat_messages(question), max_tokens=int(n)))
        self._last_tokens = (out.get("usage") or {}).get("total_tokens", self._last_tokens)
        return [(out["choices"][0]["message"]["content"] or "").strip()]

    def effective_bits(self) -> float:
        """Bits per element as served: the backend's own start-up figure over all layers
        (sink area and bf16 layers included) once a server has started, else the scheme's."""
        for s in (self.server, *self._servers.values()):
            served = s.served_bits() if s is not None else None
            if served:
                return served["overall"]
        return float(self._bits)

    def bytes_per_token(self) -> float:
        """KV bytes per token over all layers as vLLM's pages store them (blocks only)."""
        g = self.geometry
        return g["layers"] * 2 * g["kv_heads"] * g["head_dim"] * self.effective_bits() / 8

    def kv_memory(self) -> dict[str, Any] | None:
        if self._last_tokens is None:
            return None
        n = self._last_tokens
        g = self.geometry
        bf16_per_tok = g["layers"] * 2 * g["kv_heads"] * g["head_dim"] * 2
        rep: dict[str, Any] = dict(scheme=self.kv_cache_dtype, tokens=n,
                                   total_bytes=round(n * self.bytes_per_token()),
                                   bf16_bytes=n * bf16_per_tok,
                                   compression=16.0 / self.effective_bits(),
                                   scheme_bits=float(self._bits),
                                   note="pages only (the bf16 tail of the last partial group is "
                                        "in a staging area sized at start-up)")
        if self.server is not None and self.server.alive:
            rep["server"] = self.server.cache_info()
            rep["server"]["served_bits"] = self.server.served_bits()
            rep["server"]["startup_s"] = self.server.startup_s
            space = self.server.env().get("VLLM_CPU_KVCACHE_SPACE")  # None: --kv-cache-memory-bytes
            if space is not None:
                rep["server"]["kv_space_gib"] = int(space)
        return rep
