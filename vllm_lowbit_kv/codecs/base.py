"""The block codec interface every KV method implements.

A block is the quantization group along tokens: ``block_tokens`` tokens of one
layer's K (or V), all KV heads. A codec turns each (block, head) slice of
shape [block_tokens, head_dim] into exactly ``nbytes`` bytes, and back. Every
stored byte (payload, scales, zero points, masks) is part of ``nbytes``, so
``effective_bits`` is the honest figure (DESIGN.md, "Honest accounting").

Codecs are pure PyTorch, vectorized over (block, head) groups and
device-agnostic; they import nothing from vLLM.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import torch

# Metadata is stored as fp16; larger magnitudes cannot be represented.
FP16_MAX = 65504.0


def require_fp16_range(x: torch.Tensor) -> None:
    """Refuse a KV block the fp16 metadata cannot represent. One reduction catches NaN
    (comparisons are false), Inf and fp16 overflow."""
    if not bool((x.abs() <= FP16_MAX).all()):
        raise ValueError(
            "KV block contains NaN, Inf or a magnitude above 65504 (the fp16 metadata "
            "range); refusing to encode it rather than store a wrong value")


def require(cond: bool, field: str, allowed: str, got: object) -> None:
    """Raise the project's standard ValueError naming the field and its allowed values."""
    if not cond:
        raise ValueError(f"{field} must be {allowed}, got {got!r}")


@dataclass(frozen=True)
class Layout:
    """Named byte fields of one encoded (block, head) group, in storage order."""

    fields: tuple[tuple[str, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.fields)

    def join(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """Concatenate uint8 [G, n] parts into [G, nbytes] in layout order."""
        out = []
        for name, n in self.fields:
            part = parts[name]
            assert part.dtype == torch.uint8 and part.shape[-1] == n, (name, part.shape, n)
            out.append(part)
        return torch.cat(out, dim=-1)

    def split(self, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        """Inverse of :meth:`join`."""
        sizes = [n for _, n in self.fields]
        return dict(zip((name for name, _ in self.fields), torch.split(packed, sizes, dim=-1)))


@dataclass(frozen=True)
class ModelIdentity:
    """The model a codec's learned state (e.g. RVQ codebooks) was made for.

    ``name`` is the last component of the model's path or hub id (so a local copy
    of ``org/Model`` is ``Model`` too); the geometry is what the state's shapes
    depend on, and ``config_sha`` fingerprints it.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, name_or_path: Any, num_layers: int, num_kv_heads: int, head_dim: int) -> "ModelIdentity":
        name = PurePosixPath(str(name_or_path or "").replace("\\", "/").rstrip("/")).name
        return cls(name, int(num_layers), int(num_kv_heads), int(head_dim))

    @classmethod
    def from_hf_config(cls, config: Any, name_or_path: Any = None) -> "ModelIdentity":
        """From a transformers config (its text config for multimodal models)."""
        cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        name = name_or_path or getattr(config, "_name_or_path", "") or getattr(cfg, "_name_or_path", "")
        return cls.of(name, cfg.num_hidden_layers, kv_heads, head_dim)

    @property
    def config_sha(self) -> str:
        geometry = {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
                    "head_dim": self.head_dim}
        return hashlib.sha256(json.dumps(geometry, sort_keys=True).encode()).hexdigest()[:16]

    def describe(self) -> str:
        return (f"{self.name or '(unnamed model)'} ({self.num_layers} layers, "
                f"{self.num_kv_heads} KV heads, head_dim {self.head_dim})")

    def mismatches(self, other: "ModelIdentity") -> list[str]:
        """``field self != other`` for every field that differs."""
        return [f"{f} {getattr(self, f)!r} != {getattr(other, f)!r}"
                for f in ("name", "num_layers", "num_kv_heads", "head_dim")
                if getattr(self, f) != getattr(other, f)]


class BlockCodec(ABC):
    """Encode/decode K or V blocks of shape [..., block_tokens, kv_heads, head_dim].

    Subclasses implement :meth:`layout`, :meth:`encode_groups` and
    :meth:`decode_groups` on flattened groups [G, block_tokens, head_dim] in
    float32; this class handles shapes, dtypes and input checks.
    """

    #: True when the codec uses a per-token relevance score (STP).
    uses_relevance: bool = False

    def __init__(self, block_tokens: int, head_dim: int):
        require(isinstance(block_tokens, int) and 1 <= block_tokens <= 4096,
                "block_tokens", "an int in [1, 4096]", block_tokens)
        require(isinstance(head_dim, int) and 1 <= head_dim <= 1024,
                "head_dim", "an int in [1, 1024]", head_dim)
        self.block_tokens = block_tokens
        self.head_dim = head_dim

    # -- subclass contract -------------------------------------------------
    @abstractmethod
    def layout(self) -> Layout:
        """The byte fields of one (block, head) group."""

    @abstractmethod
    def encode_groups(self, x: torch.Tensor, relevance: torch.Tensor | None) -> torch.Tensor:
        """float32 [G, T, D] (+ relevance [G, T]) -> uint8 [G, nbytes]."""

    @abstractmethod
    def decode_groups(self, packed: torch.Tensor) -> torch.Tensor:
        """uint8 [G, nbytes] -> float32 [G, T, D]."""

    # -- public API ---------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes per (block, head)."""
        return self.layout().nbytes

    @property
    def effective_bits(self) -> float:
        """Every stored bit divided by the elements it encodes."""
        return self.nbytes * 8 / (self.block_tokens * self.head_dim)

    def bits_breakdown(self) -> dict[str, float]:
        """Bits per element contributed by each stored field."""
        elems = self.block_tokens * self.head_dim
        return {name: n * 8 / elems for name, n in self.layout().fields}

    def encode(self, x: torch.Tensor, relevance: torch.Tensor | None = None) -> torch.Tensor:
        """[..., T, H, D] -> uint8 [..., H, nbytes]. ``relevance``: [..., T, H] (STP scores)."""
        T, D = self.block_tokens, self.head_dim
        require(x.dim() >= 3 and x.shape[-3] == T and x.shape[-1] == D,
                "x.shape", f"[..., {T}, kv_heads, {D}]", tuple(x.shape))
        x32 = x.float()
        require_fp16_range(x32)
        lead, H = x.shape[:-3], x.shape[-2]
        groups = x32.movedim(-2, -3).reshape(-1, T, D)
        rel = None
        if self.uses_relevance and relevance is not None:
            require(relevance.shape == x.shape[:-1], "relevance.shape",
                    f"{tuple(x.shape[:-1])}", tuple(relevance.shape))
            rel = relevance.float().movedim(-1, -2).reshape(-1, T)
        packed = self.encode_groups(groups, rel)
        return packed.reshape(*lead, H, self.nbytes)

    def decode(self, packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """uint8 [..., H, nbytes] -> [..., T, H, D] in ``dtype``."""
        require(packed.dtype == torch.uint8 and packed.shape[-1] == self.nbytes,
                "packed", f"uint8 [..., kv_heads, {self.nbytes}]", (packed.dtype, tuple(packed.shape)))
        lead, H = packed.shape[:-2], packed.shape[-2]
        x = self.decode_groups(packed.reshape(-1, self.nbytes))
        x = x.reshape(*lead, H, self.block_tokens, self.head_dim).movedim(-3, -2)
        return x.to(dtype)

    def describe(self) -> str:
        return f"{type(self).__name__}(T={self.block_tokens}, D={self.head_dim}, {self.effective_bits:.3f} bits)"
