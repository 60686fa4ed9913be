"""Eviction policies: which prompt KV pairs each layer keeps after prefill.

Every policy answers the same question the same way: given one sequence's prompt
K/V of every layer (``[N, H, D]`` each), return an :class:`EvictionPlan`, the
sorted kept token positions of every layer. Common rules:

* Global budget: ``round(retention * N * L)`` pairs over the L layers (all KV
  heads of a kept token are kept). Every layer's budget lies in
  ``[protected, N]``; they sum exactly to the global budget.
* Protected pairs, kept by every policy whatever their score: the first
  ``sink_tokens`` tokens (attention sinks) and the last ``recent_window``
  tokens. When the retention is too small to cover them, they are kept
  anyway and the plan's global budget is the protected count
  (:attr:`EvictionPlan.retention_effective` says what was kept).
* The rest of a layer's budget goes to its highest-scoring unprotected pairs
  (ties: the earlier position).
* Paged engines (:meth:`EvictionPolicy.plan` with ``keep_from``, ``group`` and
  ``max_layer_budget``): positions from ``keep_from`` on are protected too (the
  prompt's last, partial block stays in place), a layer keeps at most
  ``max_layer_budget`` pairs (so the scheduler knows how many blocks the
  compacted pairs need before seeing the data), and the kept pairs below
  ``keep_from`` come in whole groups of ``group`` (the next-best pairs fill the
  last group), so budgets may exceed the global budget by less than ``group``
  per layer.

Policies (``POLICIES``, the names ``--kv-eviction`` takes):

``flashcache``  FlashCache (seed 002): scores = deviation from the DCT low-pass
                Base KV (Eq. 10), budgets from each layer's outlier energy ratio
                (Eq. 12, Dynamic Budget Allocation); see :mod:`.flashcache`.
``uniform``     FlashCache's scores with equal budgets per layer (the paper's
                "w/o DBA" ablation).
``random``      uniform budgets, pairs drawn at random (seeded per layer).
``recency``     uniform budgets, the most recent pairs: sinks + a recent window
                that fills the budget (StreamingLLM).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..codecs.base import require
from .flashcache import allocate_budgets, outlier_analysis

__all__ = ["EvictionPlan", "EvictionPolicy", "FlashCachePolicy", "UniformPolicy", "RandomPolicy",
           "RecencyPolicy", "POLICIES", "make_policy", "DEFAULT_GAMMA", "DEFAULT_SINK_TOKENS",
           "DEFAULT_RECENT_WINDOW"]

#: the paper's best cut-off factors are 0.1-0.3 (Table 5)
DEFAULT_GAMMA = 0.2
DEFAULT_SINK_TOKENS = 4
DEFAULT_RECENT_WINDOW = 32


@dataclass(frozen=True)
class EvictionPlan:
    """Kept positions per layer for one sequence of ``num_tokens`` prompt tokens."""

    policy: str
    retention: float
    num_tokens: int
    kept: tuple[torch.Tensor, ...]  # per layer: sorted int64 positions in [0, num_tokens)
    budgets: torch.Tensor  # [L] int64, budgets[l] == kept[l].numel()
    weights: torch.Tensor | None  # [L] the layer weights the budgets follow (None: uniform)

    @property
    def num_layers(self) -> int:
        return len(self.kept)

    @property
    def total(self) -> int:
        return int(self.budgets.sum())

    @property
    def retention_effective(self) -> float:
        return self.total / max(1, self.num_tokens * self.num_layers)

    def summary(self) -> dict:
        b = self.budgets
        return dict(policy=self.policy, retention=self.retention, tokens=self.num_tokens,
                    kept=self.total, retention_effective=round(self.retention_effective, 6),
                    budget_min=int(b.min()), budget_max=int(b.max()), budgets=b.tolist())


class EvictionPolicy:
    """Base class: subclasses define per-layer scores and, optionally, layer weights."""

    name: ClassVar[str]
    #: True: budgets differ per layer (weights from score_layers)
    dynamic_budgets: ClassVar[bool] = False

    def __init__(self, retention: float, *, gamma: float = DEFAULT_GAMMA,
                 sink_tokens: int = DEFAULT_SINK_TOKENS, recent_window: int = DEFAULT_RECENT_WINDOW,
                 seed: int = 0):
        require(isinstance(retention, (int, float)) and not isinstance(retention, bool)
                and 0 < retention <= 1, "retention", "a number in (0, 1] (kept fraction of the "
                "prompt's KV pairs)", retention)
        require(isinstance(gamma, (int, float)) and not isinstance(gamma, bool) and 0 < gamma < 1,
                "gamma", "a number in (0, 1) (low-pass cut-off w = gamma * N)", gamma)
        require(isinstance(sink_tokens, int) and sink_tokens >= 0, "sink_tokens", "an int >= 0",
                sink_tokens)
        require(isinstance(recent_window, int) and recent_window >= 0, "recent_window",
                "an int >= 0", recent_window)
        require(isinstance(seed, int), "seed", "an int", seed)
        self.retention, self.gamma = float(retention), float(gamma)
        self.sink_tokens, self.recent_window, self.seed = sink_tokens, recent_window, seed

    def describe(self) -> dict:
        return dict(policy=self.name, retention=self.retention, gamma=self.gamma,
                    sink_tokens=self.sink_tokens, recent_window=self.recent_window, seed=self.seed)

    # -- subclass contract -----------------------------------------------------------
    def score_layers(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]
                     ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Per layer: scores [N] (higher = keep first); layer weights [L] or None (uniform)."""
        raise NotImplementedError

    # -- the plan ----------------------------------------------------------------------
    def protected(self, num_tokens: int) -> torch.Tensor:
        """bool [N]: the sinks and the recent window."""
        pos = torch.arange(num_tokens)
        return (pos < self.sink_tokens) | (pos >= num_tokens - self.recent_window)

    def plan(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], *,
             keep_from: int | None = None, max_layer_budget: int | None = None, group: int = 1
             ) -> EvictionPlan:
        """keys, values: per layer [N, H, D] (the same N for every layer). ``keep_from``,
        ``max_layer_budget``, ``group``: see the module docstring (paged engines)."""
        L = len(keys)
        require(L >= 1 and len(values) == L, "keys/values", "one [N, H, D] tensor per layer, "
                "as many values as keys", (L, len(values)))
        N = int(keys[0].shape[0])
        require(all(int(k.shape[0]) == N for k in keys), "prompt tokens per layer",
                f"equal across layers ({N})", [int(k.shape[0]) for k in keys])
        prot = self.protected(N)
        region = N if keep_from is None else keep_from
        require(isinstance(group, int) and group >= 1 and (region == N or region % group == 0),
                "group", f"an int >= 1 dividing keep_from ({region})", group)
        prot[region:] = True
        n_prot = int(prot.sum())
        hi = N if max_layer_budget is None else max(n_prot, min(N, max_layer_budget))
        scores, weights = self.score_layers(keys, values)
        total = min(max(_round_half_up(self.retention * N * L), n_prot * L), hi * L)
        budgets = allocate_budgets(torch.ones(L) if weights is None else weights, total,
                                   torch.full((L,), n_prot), torch.full((L,), hi))
        kept = tuple(_select(s, prot, int(b), region, group) for s, b in zip(scores, budgets))
        budgets = torch.tensor([k.numel() for k in kept], dtype=torch.long)
        return EvictionPlan(self.name, self.retention, N, kept, budgets, weights)


def _round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def _select(scores: torch.Tensor, protected: torch.Tensor, budget: int, region: int,
            group: int) -> torch.Tensor:
    """The protected positions plus the ``budget - protected`` best others, sorted; the
    kept positions below ``region`` rounded up to a multiple of ``group`` with the next best."""
    s = scores.float().masked_fill(protected, float("-inf"))
    order = torch.sort(s, descending=True, stable=True).indices  # ties: earlier position first
    n = budget - int(protected.sum())
    n += -(int(protected[:region].sum()) + n) % group  # protected pairs past region are all kept
    keep = protected.clone()
    keep[order[:n]] = True
    return torch.nonzero(keep).flatten()


class FlashCachePolicy(EvictionPolicy):
    """Outlier KVs (Eq. 10) under Dynamic Budget Allocation (Eq. 12)."""

    name = "flashcache"
    dynamic_budgets = True

    def score_layers(self, keys, values):
        scores, ratios = [], []
        for k, v in zip(keys, values):
            dev, r = outlier_analysis(k, v, self.gamma)
            scores.append(dev)
            ratios.append(r)
        return scores, (torch.tensor(ratios, dtype=torch.float64) if self.dynamic_budgets else None)


class UniformPolicy(FlashCachePolicy):
    """FlashCache's outlier scores, equal budgets (no Dynamic Budget Allocation)."""

    name = "uniform"
    dynamic_budgets = False


class RandomPolicy(EvictionPolicy):
    name = "random"

    def score_layers(self, keys, values):
        gens = [torch.Generator().manual_seed(self.seed * 1_000_003 + layer) for layer in range(len(keys))]
        return [torch.rand(k.shape[0], generator=g) for k, g in zip(keys, gens)], None


class RecencyPolicy(EvictionPolicy):
    """StreamingLLM: the sinks and the most recent tokens."""

    name = "recency"

    def score_layers(self, keys, values):
        return [torch.arange(k.shape[0], dtype=torch.float32) for k in keys], None


POLICIES: dict[str, type[EvictionPolicy]] = {
    p.name: p for p in (FlashCachePolicy, UniformPolicy, RandomPolicy, RecencyPolicy)}


def make_policy(name: str, retention: float, **kw) -> EvictionPolicy:
    """The policy ``name`` (one of :data:`POLICIES`) with its validated parameters."""
    require(name in POLICIES, "eviction policy", f"one of {sorted(POLICIES)}", name)
    return POLICIES[name](retention, **kw)
