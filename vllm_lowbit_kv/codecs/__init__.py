"""Block codecs: one reference implementation per KV method, each in a file named after it."""

from .base import BlockCodec, Layout
from .dynamic import DynamicCodec
from .kivi import KiviCodec
from .quantile1 import QuantileCodec
from .rvq import RVQCodec, RVQKeyCodec, RVQValueCodec
from .vidkv import TernaryValueCodec, VidKVKeyCodec

__all__ = ["BlockCodec", "Layout", "DynamicCodec", "KiviCodec", "QuantileCodec", "RVQCodec",
           "RVQKeyCodec", "RVQValueCodec", "TernaryValueCodec", "VidKVKeyCodec"]
