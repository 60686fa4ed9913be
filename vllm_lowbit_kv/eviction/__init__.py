"""KV eviction after prefill (FlashCache, seed 002, and baselines). Pure PyTorch, no vLLM.

    from vllm_lowbit_kv.eviction import make_policy
    plan = make_policy("flashcache", 0.2).plan(keys, values)  # per layer [N, H, D]
    plan.kept[layer]  # sorted positions that layer keeps

:mod:`.dct` (the orthonormal DCT), :mod:`.flashcache` (outlier deviations, energy
ratios, budget allocation), :mod:`.policies` (the policies and their common rules).
"""

from .dct import cutoff, dct2, idct2
from .flashcache import allocate_budgets, outlier_analysis
from .policies import (DEFAULT_GAMMA, DEFAULT_RECENT_WINDOW, DEFAULT_SINK_TOKENS, POLICIES,
                       EvictionPlan, EvictionPolicy, make_policy)

__all__ = ["cutoff", "dct2", "idct2", "allocate_budgets", "outlier_analysis", "POLICIES",
           "EvictionPlan", "EvictionPolicy", "make_policy", "DEFAULT_GAMMA",
           "DEFAULT_RECENT_WINDOW", "DEFAULT_SINK_TOKENS"]
