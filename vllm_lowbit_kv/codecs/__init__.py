"""Block codecs: one reference implementation per KV method."""

from .base import BlockCodec, Layout
from .kivi import KiviCodec

__all__ = ["BlockCodec", "Layout", "KiviCodec"]
