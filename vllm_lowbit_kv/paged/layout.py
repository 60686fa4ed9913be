"""Page geometry: the bytes of one page, the codec calls that fill and read them, and the
sink area every page carries (the first step of a KV block's trip, see the package doc)."""

from __future__ import annotations

import torch

from ..codecs.base import BlockCodec, require
from ..codecs.vidkv import require_protect_first
from ..ops.cpu import encode_states, write_states
from ..ops.page_format import PageFormat
from ..rotation import HadamardRotation


#: relevance given to sink rows of group 0: below any attention mass (never protected)
SINK_RELEVANCE = -1.0


def rank_protected(relevance: torch.Tensor, visual: torch.Tensor, first: str = "visual"
                   ) -> torch.Tensor:
    """STP relevance [E, T, H] with the tokens of kind ``first`` (``visual`` [E, T] bool
    says which tokens are visual) ranked above the others, each kind in its own order:

    * ``"visual"``: VidKV protects the visual tokens most attended by the text (VidKV
      eq. 7); text tokens win only the protected rows a group has left over;
    * ``"text"``: the visual-only mode (seed 003's setting): text tokens are protected
      (kept at the higher precision), visual tokens get the low-bit codec and only the
      rows text leaves over.

    Groups whose tokens are all of one kind keep their order as it is. One definition
    for the pages and the transformers cache, so the two store the same bytes. ``first``
    was checked where it was set (:class:`~vllm_lowbit_kv.schemes.KVScheme`,
    :class:`PagedLayout`)."""
    chosen = visual if first == "visual" else ~visual
    mixed = chosen.any(dim=1) & ~chosen.all(dim=1)
    if not bool(mixed.any()):
        return relevance
    # per group, so a group ranks alike however many groups are encoded with it
    lift = relevance.amax(dim=(1, 2), keepdim=True).clamp(min=0) + 1.0
    return relevance + (chosen & mixed.unsqueeze(1)).unsqueeze(-1).to(relevance.dtype) * lift


def protected_visual(visual: torch.Tensor, rows: int, first: str = "visual",
                     candidates: torch.Tensor | None = None) -> torch.Tensor:
    """long [E]: visual tokens each group protects when STP keeps ``rows`` rows ranked by
    :func:`rank_protected`. ``visual`` [E, T] bool marks the visual tokens, ``candidates``
    [E, T] bool the tokens that compete for the rows (default all; sink rows rank last)."""
    n_visual = (visual if candidates is None else visual & candidates).sum(dim=1)
    if first == "visual":
        return n_visual.clamp(max=rows)
    text = ~visual if candidates is None else ~visual & candidates
    return torch.minimum(n_visual, (rows - text.sum(dim=1)).clamp(min=0))


def sink_dtype(model_dtype_bytes: int) -> torch.dtype:
    """The dtype of the sink area of a model whose K/V take ``model_dtype_bytes`` bytes per
    element (float32: 4; bf16 or fp16: 2, one size)."""
    return {4: torch.float32}.get(model_dtype_bytes, torch.bfloat16)


class PageBits:
    """Honest size figures of a layer's pages (``page_bytes`` per ``block_size`` tokens of
    ``H`` KV heads of ``D`` channels)."""

    page_bytes: int
    block_size: int
    H: int
    D: int

    @property
    def bytes_per_token(self) -> float:
        """Per layer, K and V together, sink area included."""
        return self.page_bytes / self.block_size

    @property
    def bits_per_element(self) -> float:
        """Every byte of a page over the K and V elements of its tokens."""
        return self.page_bytes * 8 / (self.block_size * self.H * self.D * 2)


class PagedLayout(PageBits):
    """A layer's pages: their :class:`~vllm_lowbit_kv.ops.PageFormat` (the group states, the
    one description every kernel reads), the sink area in the model dtype, the rotation of
    head vectors into codec space, and vLLM's block geometry."""

    def __init__(self, key_codec: BlockCodec, value_codec: BlockCodec, num_kv_heads: int,
                 block_size: int, sink_tokens: int = 0, sink_dtype: torch.dtype = torch.bfloat16,
                 rotation: HadamardRotation | None = None, protect_first: str = "visual"):
        T = key_codec.block_tokens
        require(value_codec.block_tokens == T, "value codec block_tokens",
                f"equal to the key codec's ({T})", value_codec.block_tokens)
        require(value_codec.head_dim == key_codec.head_dim, "value codec head_dim",
                f"equal to the key codec's ({key_codec.head_dim})", value_codec.head_dim)
        require(isinstance(block_size, int) and block_size > 0 and block_size % T == 0,
                "block_size", f"a positive multiple of the scheme's block_tokens ({T})",
                block_size)
        require(isinstance(num_kv_heads, int) and num_kv_heads >= 1, "num_kv_heads",
                "an int >= 1", num_kv_heads)
        require(isinstance(sink_tokens, int) and 0 <= sink_tokens <= T, "sink_tokens",
                f"an int in [0, block_tokens={T}] (the sinks live in a sequence's first group)",
                sink_tokens)
        self.key_codec, self.value_codec = key_codec, value_codec
        self.T, self.D, self.H = T, key_codec.head_dim, num_kv_heads
        self.block_size = block_size
        self.groups_per_block = block_size // T
        self.sink_tokens, self.sink_dtype = sink_tokens, sink_dtype
        #: K and V head vectors are rotated before encoding (codec space = rotated space)
        self.rotation = rotation
        require_protect_first(protect_first)
        #: which tokens of a group STP protects first (:func:`rank_protected`)
        self.protect_first = protect_first
        self._elt = torch.empty(0, dtype=sink_dtype).element_size()
        #: bytes of the sink area per head: K rows [s, D] then V rows [s, D]
        self.sink_bytes = 2 * sink_tokens * self.D * self._elt
        self.format = PageFormat.build(key_codec, value_codec, num_kv_heads,
                                       self.groups_per_block, self.sink_bytes)
        #: K then V bytes of one group of one head, padded (PageFormat)
        self.state_bytes = self.format.state_bytes
        #: bytes of one block of one KV head
        self.head_bytes = self.format.head_bytes
        self._sink_view: tuple | None = None  # (the pages' address and geometry, sink_kv)

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer (all heads: sink area and groups)."""
        return self.H * self.head_bytes

    def page_shape(self, num_blocks: int) -> tuple[int, int, int]:
        return (num_blocks, self.H, self.head_bytes)

    # -- codec ----------------------------------------------------------------
    def encode(self, k: torch.Tensor, v: torch.Tensor, relevance: torch.Tensor | None = None,
               cpp: bool = False) -> torch.Tensor:
        """K, V [G, T, H, D] (+ relevance [G, T, H]) -> uint8 states [G, H, C] (rotated
        first when the layout has a rotation). ``cpp``: by the C++ encoder
        (:func:`vllm_lowbit_kv.ops.cpu.encode_states`, which reads bf16 and fp16 rows as
        they are) where it runs, else the codecs (in float32)."""
        if self.rotation is not None:
            k, v = self.rotation.rotate(k.float()), self.rotation.rotate(v.float())
        states = encode_states(self.format, k, v) if cpp else None
        return self.format.encode(k.float(), v.float(), relevance) if states is None else states

    def decode(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 states [G, H, C] -> K, V [G, T, H, D] float32 in the model's space."""
        k, v = self.format.decode(states)
        if self.rotation is not None:
            k, v = self.rotation.unrotate(k), self.rotation.unrotate(v)
        return k, v

    # -- page addressing --------------------------------------------------------
    def read_states(self, pages: torch.Tensor, gids: torch.Tensor) -> torch.Tensor:
        """pages, gids [G] -> states [G, H, C]."""
        return self.format.read_states(pages, gids)

    def write_states(self, pages: torch.Tensor, gids: torch.Tensor, states: torch.Tensor) -> None:
        """states [G, H, C] -> the pages of groups gids [G]: by the C++ copy
        (:func:`vllm_lowbit_kv.ops.cpu.write_states`) where it runs, else the format's."""
        write_states(self.format, pages, gids, states)

    def _sinks(self, pages: torch.Tensor) -> torch.Tensor:
        """``[B, 2, s, H, D * elt]`` byte view of the sink areas (K then V)."""
        flat = self.format.flat_pages(pages)
        return (flat[:, :, :self.sink_bytes]
                .view(flat.shape[0], self.H, 2, self.sink_tokens, self.D * self._elt)
                .permute(0, 2, 3, 1, 4))

    def sink_kv(self, pages: torch.Tensor) -> torch.Tensor:
        """``[B, 2, s, H, D]`` view of the sink areas (K then V) in the sink dtype. The last
        one made is kept: a layer reads the same cache tensor at every step, and making it
        is four small tensor operations per layer and step (the kept view holds the memory,
        so no other tensor takes its address meanwhile)."""
        where = (pages.data_ptr(), pages.shape, pages.stride())
        if self._sink_view is None or self._sink_view[0] != where:
            self._sink_view = where, self._sinks(pages).view(self.sink_dtype)
        return self._sink_view[1]

    def write_sinks(self, pages: torch.Tensor, blocks: torch.Tensor, pos: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor) -> None:
        """Tokens at positions ``pos`` (< sink_tokens) of sequences whose first block is
        ``blocks``: K, V [n, H, D] -> the sink areas, in the model dtype."""
        sv = self._sinks(pages)
        to_bytes = lambda x: x.to(self.sink_dtype).contiguous().view(torch.uint8)  # noqa: E731
        sv[blocks, 0, pos] = to_bytes(k)
        sv[blocks, 1, pos] = to_bytes(v)

    def read_sinks(self, pages: torch.Tensor, block: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` sink tokens of the sequence whose first block is ``block``:
        K, V [n, H, D] float32."""
        k, v = self.read_sinks_batch(pages, torch.tensor([block]), n)
        return k[0], v[0]

    def read_sinks_batch(self, pages: torch.Tensor, blocks: torch.Tensor, n: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` sink tokens of each sequence whose first block is in ``blocks``:
        K, V [B, n, H, D] float32."""
        kv = self.sink_kv(pages).index_select(0, blocks.to(pages.device))[:, :, :n]
        return kv[:, 0].float(), kv[:, 1].float()


def mask_sink_rows(group: torch.Tensor, sinks: int, dim: int = 0) -> torch.Tensor:
    """Set the first ``sinks`` rows (along ``dim``) of a sequence's group 0 to copies of
    its first other row, in place, and return it: the sinks are read exactly from
    elsewhere, so they must not stretch the group's statistics. A copy of a real row
    keeps every per-channel range; the other rows' mean would not do, it is exactly
    the threshold of VidKV's 1-bit "mean" split, where float rounding (which differs
    between engines and devices) would pick the rows' bit and with it the levels of
    the whole channel. A group of sinks only is left as is."""
    T = group.shape[dim]
    if 0 < sinks < T:
        rows = group.narrow(dim, 0, sinks)
        rows.copy_(group.narrow(dim, sinks, 1).expand_as(rows))
    return group


class HeadSplitLayout(PageBits):
    """A layer whose KV heads are coded by different page formats: its retrieval heads
    (:mod:`vllm_lowbit_kv.retrieval_heads`) by a higher-precision codec pair, the others by
    the scheme's. Each part is a whole :class:`PagedLayout` over its heads; a page of the
    layer holds the parts one after the other (``[num_blocks, H_0, P_0]`` bytes, then
    ``[num_blocks, H_1, P_1]``), so every kernel reads a part as it reads any layer, through
    a strided view (:meth:`part_pages`). ``heads[i]`` are the layer's KV heads of part i."""

    def __init__(self, parts: list[PagedLayout], heads: list[tuple[int, ...]]):
        require(len(parts) == len(heads) and all(p.H == len(h) for p, h in zip(parts, heads)),
                "HeadSplitLayout heads", "one tuple of KV heads per part, as many as its layout's",
                [len(h) for h in heads])
        first = parts[0]
        require(all((p.T, p.D, p.block_size, p.sink_tokens) ==
                    (first.T, first.D, first.block_size, first.sink_tokens) for p in parts),
                "HeadSplitLayout parts", "the same groups, head_dim, block size and sinks",
                [(p.T, p.D, p.block_size, p.sink_tokens) for p in parts])
        every = sorted(h for hs in heads for h in hs)
        require(every == list(range(len(every))), "HeadSplitLayout heads",
                "each KV head in exactly one part", heads)
        self.parts, self.heads = parts, [tuple(h) for h in heads]
        self.T, self.D, self.H = first.T, first.D, len(every)
        self.block_size, self.sink_tokens = first.block_size, first.sink_tokens
        self.groups_per_block = first.groups_per_block
        self._offsets = [0]
        for p in parts:
            self._offsets.append(self._offsets[-1] + p.page_bytes)

    @property
    def page_bytes(self) -> int:
        return self._offsets[-1]

    def page_shape(self, num_blocks: int) -> tuple[int, int]:
        return (num_blocks, self.page_bytes)

    def part_pages(self, pages: torch.Tensor) -> list[torch.Tensor]:
        """A layer's cache (any view with ``page_bytes`` per block) -> per part a
        ``[num_blocks, H_i, P_i]`` view sharing its memory."""
        flat = pages.view(pages.shape[0], -1)  # raises rather than copy
        require(flat.shape[1] == self.page_bytes, "page bytes", f"{self.page_bytes} (the layer's)",
                flat.shape[1])
        return [flat[:, a:b].unflatten(1, (p.H, p.head_bytes))
                for p, a, b in zip(self.parts, self._offsets, self._offsets[1:])]

