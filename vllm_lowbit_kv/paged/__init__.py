"""Packed paged KV: one KV block's trip from the attention layer to its page and back.

Pure PyTorch; nothing here imports vLLM, so the layout and the attention math
are tested alone (tests/test_paged.py) and reused by any engine. One file per
step of the trip:

    layout     page geometry, honest bytes, the codec calls that fill and read a page
    plan       vLLM's slot mapping -> groups completed, staging slots, what each request reads
    write      staging buffers; encode completed groups, write sinks, stage the rest
    attention  the exact parts, context keys and the STP attention mass
    forward    one layer, one step: what the attention backend calls

Terms
-----
group  ``T = codec.block_tokens`` consecutive tokens of one sequence, starting at
       a position multiple of T: the unit a codec encodes (per-channel
       statistics run over these T tokens).
block  vLLM's allocation unit of ``block_size`` tokens; ``block_size`` is a
       multiple of T, so a block holds ``N = block_size // T`` groups.
page   the bytes of one block of one layer, per KV head ``P = S + N * C`` bytes:
       an optional sink area of ``S`` bytes, then for every group the K
       codes+metadata followed by the V codes+metadata (``C = key_codec.nbytes +
       value_codec.nbytes`` rounded up to 4 bytes). A layer's cache is ``uint8 [num_blocks, H, P]``
       (vLLM views it as ``[num_blocks, H, N, C]`` when S = 0, else
       ``[num_blocks, H, 1, P]``).
gid    global group id ``= block_id * N + group_in_block``; a token in vLLM slot
       ``s`` (``= block_id * block_size + offset``) lies in group ``s // T`` at
       offset ``s % T``.

Staging. A group is encoded into its page in the step that writes its last
token (offset T-1). Until then its tokens live in the model dtype (or int8 with a
scale per token and head: the scheme's ``staging_dtype``) in a *staging slot*: a
fixed pool of slots per layer (sized once at start-up), handed out by
:class:`StagingAllocator`. A running request has at most one
partial group (its last), so ``max_num_seqs`` slots always suffice: slots of
groups completed in a step are returned before new groups take theirs, and the
engine returns the slots of finished, aborted and preempted requests
(:meth:`StagingAllocator.release_blocks`) before the next step is planned.
Anything else (a group continuing without its staged tokens, an exhausted
pool) is a bookkeeping bug and raises: never attend to made-up values.

Windows. A completed group may keep its slot for the sequence that staged it:
its last ``W = residual_tokens / T`` complete groups (the residual window) and
its first ``A = leading_tokens / T`` (the leading window: sinks and a system
prompt) are read by that sequence from their slots instead of their pages, so
``A + W + 1`` slots per running request. The pages are written all the same, so
another sequence sharing such a block through the prefix cache reads its
packed bytes (and the sink area), never a slot it does not own.

Sinks. With ``sink_tokens = s > 0`` (s <= T) the first s tokens of every
sequence are also kept exactly, in the model dtype, in the sink area of the
sequence's first block (every page carries the area, used only in a
sequence's first block: that is what makes it survive prefix caching, where a
cached first block is shared as bytes). The group holding them (group 0) is
still encoded when it fills, with the sink rows replaced by copies of its
first other row so they do not stretch its statistics (and never win
STP protection); once group 0 is packed, reads take positions < s from the sink
area (before, the staged group holds them as staged: ``ReadPlan.skip_tokens``).

Relevance (STP). For codecs with ``uses_relevance``: the relevance of a token is
the attention mass it receives from the *observation window*, the last
``obs_window`` queries of its sequence up to the last token written in the step
that completes its group: softmax over every key the sequence has (context as
stored + fresh tokens exact, causal mask), summed over the window's queries and
over the query heads sharing the KV head. This is the definition of
:mod:`vllm_lowbit_kv.hf_cache` (forward = the request's chunk in this step).
With ``obs_window <= T`` the window's queries from earlier steps always belong
to the group being completed, so the staging slot keeps each staged token's
query alongside its K and V. In a multimodal request the planner is told its
visual (image, video-frame) token positions: a group protects its most relevant
visual tokens first, text tokens only with the rows left (VidKV's rule), or, with
``protect_first: text`` (the visual-only mode), its text tokens first
(:func:`rank_protected`), in both engines.

Each step: :meth:`StagingAllocator.plan_step` (once, for all layers) gives a
:class:`ReadPlan` (each request's context, as stored before this step) and a
:class:`WritePlan` (where the fresh tokens go); each layer then runs
:func:`forward_layer`: attention (and relevance) first, writes second.
"""

from .attention import attend, attention_mass, context_keys, exact_attention
from .forward import forward_layer, forward_split_layer
from .layout import (SINK_RELEVANCE, HeadSplitLayout, PagedLayout, mask_sink_rows,
                     protected_visual, rank_protected, sink_dtype)
from .plan import ExactBatch, ReadPlan, StagingAllocator, WritePlan, make_read_plan
from .write import Staging, StagedTokens, apply_writes, encode_groups, stage_tokens

__all__ = [
    "ExactBatch", "HeadSplitLayout", "PagedLayout", "ReadPlan", "SINK_RELEVANCE", "StagedTokens",
    "Staging",
    "StagingAllocator", "WritePlan", "apply_writes", "attend", "attention_mass", "context_keys",
    "encode_groups", "exact_attention", "forward_layer", "forward_split_layer", "make_read_plan",
    "mask_sink_rows", "protected_visual", "rank_protected", "sink_dtype",
    "stage_tokens",
]
