"""A transformers ``Cache`` that stores K/V through our block codecs.

This is the public way to use the codecs from transformers::

    from vllm_lowbit_kv.hf_cache import LowBitKVCache

    cache = LowBitKVCache("kivi2", model=model)          # or model_config=model.config
    out = model(input_ids, past_key_values=cache, use_cache=True)
    out = model.generate(input_ids, past_key_values=LowBitKVCache("kivi2", model=model))
    print(cache.memory_report())

Storage, per layer and per sequence (tokens in position order)::

    [ block 0 | block 1 | ... | tail ]      + sinks: exact copies of the first tokens
      packed uint8 (codec)      model dtype, < block_tokens tokens

* The first ``sink_tokens`` tokens (attention sinks) are also kept in the model
  dtype and read from there once their block is packed (before, as staged), as the
  vLLM pages do (:mod:`vllm_lowbit_kv.paged`):
  block 0 is coded with the sink rows replaced by copies of its first other
  row, so they do not stretch its statistics.
* Every complete group of ``block_tokens`` tokens (from position 0) is encoded
  by the scheme's key and value codecs, and only the packed bytes are kept
  (``[B, n_blocks, kv_heads, nbytes]`` uint8, exactly ``codec.nbytes`` per
  (block, head)).
* The incomplete last block (the tail) stays in the model dtype; it is encoded
  as soon as it fills, whether by a prefill chunk or by decode steps.
* Residual window (the scheme's ``residual_tokens`` R, KIVI's and VidKV's
  full-precision residual): the last ``R / block_tokens`` encoded blocks are
  also kept exactly, and attention reads those copies instead of their codes,
  as the vLLM backend does (:mod:`vllm_lowbit_kv.paged`).
* Rotation (the scheme's ``rotate``): blocks are rotated per layer before
  encoding and un-rotated after decoding (:mod:`vllm_lowbit_kv.rotation`).
* Layers in ``skip_layers`` keep everything in the model dtype.
* Codecs with per-sequence state (``encode_stream(blocks, state) -> (packed,
  state)``, e.g. the dynamic scheme's EMA recorders) get their blocks in
  order with the state threaded per layer; each block still decodes alone.

What attention sees: ``update`` returns ``decode(packed blocks before the
window) ++ window ++ tail``, the sink positions taken from the sinks. The tokens written by the current forward are attended at model
precision in that forward (``attend_new_exact=True``, the default, as in KIVI /
VidKV Algorithm 1 and a fused kernel that attends the chunk it just wrote);
every later forward sees them through the codec once their block is full.
With ``attend_new_exact=False`` the blocks completed by this update are
already seen through the codec.

Relevance (Semantic Token Protection, for schemes with ``uses_relevance``):
the relevance of a token is the attention mass it receives from an
*observation window*: the ``obs_window`` most recent queries of the layer
(RoPE applied, softmax over every cached key with the causal mask, summed over
the window's queries and over the query heads sharing the KV head). The
queries are captured by a forward pre-hook on each attention module
(:func:`install_query_hooks`, installed when ``model=`` is given). When a block
is encoded, the window holds the last queries of the forward that completed
it: for a prefill chunk, the chunk's last tokens (DESIGN.md: "scores of prompt
tokens against the queries of the last text tokens"); in decode, the last
``obs_window`` generated tokens. Without a model (``model_config`` only) the
proxy is ``relevance="keynorm"``: minus the L2 norm of the key (low-norm keys
draw high attention; Devoto et al. 2024, "A Simple and Effective L2
Norm-Based Strategy for KV Cache Compression"). A callable can also be given
(see :data:`RelevanceFn`). Only the ranking inside a (block, head) matters to
the codecs.

Eviction (FlashCache and baselines, :mod:`vllm_lowbit_kv.eviction`): a cache
made with ``evictable=True`` also keeps the exact K/V of every token until
:meth:`LowBitKVCache.evict` runs, once, after the prompt's prefill (prompt
tokens only). The policy scores the *exact* prompt K/V of every layer (never
their codec reconstruction) and picks each layer's kept positions; each layer
then rebuilds its storage from its kept pairs, in position order, exactly as if
that compacted sequence had been written: the first ``sink_tokens`` kept pairs
in the sink area, every full group of ``block_tokens`` kept pairs encoded
from the exact values (each kept pair is quantized once, in a group of kept
pairs; STP relevance from the prompt's last queries, causal by original
position), the rest in the tail. Later tokens append as usual. Positions stay
logical (``get_seq_length()`` counts every token ever written, so RoPE
positions continue from the prompt's length), while the layers now hold
different numbers of pairs: :meth:`~LowBitKVCache.evict` switches the model to
:data:`COMPACTED_ATTENTION`, SDPA with the causal mask aligned to each layer's
own key count. ``scheme=None`` keeps every layer in the model dtype (the bf16
cache with eviction).
"""

from .cache import LowBitKVCache
from .hooks import (COMPACTED_ATTENTION, RELEVANCE_MODES, RelevanceFn, install_query_hooks,
                    use_compacted_attention)
from .layer import LowBitLayer

__all__ = ["LowBitKVCache", "LowBitLayer", "install_query_hooks", "RelevanceFn",
           "RELEVANCE_MODES", "COMPACTED_ATTENTION", "use_compacted_attention"]
