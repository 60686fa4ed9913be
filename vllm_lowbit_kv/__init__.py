"""Low-bit paged KV cache for vLLM: codecs, page layouts and the vLLM plugin."""

from .schemes import SCHEMES, KVScheme, get_scheme

__all__ = ["SCHEMES", "KVScheme", "get_scheme"]
