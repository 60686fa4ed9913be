"""Residual vector quantization of K/V vectors, with learned codebooks (seed 001).

Kumar, "Residual vector quantization for KV cache compression in large language
model" (seeds/001), section 2.2 and Algorithm 1. The paper numbers no
equations; references are to its sections and its Algorithm 1:

    sec. 2.2   x in R^d (one token of one KV head):  s = std(x),  z = x / s;
               z is split into d / d^ groups of d^ channels, each group coded by
               the same residual quantizer of K codebooks C_1..C_K of C codes
    sec. 3.1   keys: non-contiguous groups, channels d/d^ apart
               (group j = channels j, j + d/d^, j + 2 d/d^, ...);
               values: contiguous groups (group j = channels j d^ .. (j+1) d^ - 1)
    Alg. 1     z_1 = z;  for i = 1..K:  j_i = argmin_j ||z_i - C_ij||,
               z_q += C_{i j_i},  z_{i+1} = z_i - C_{i j_i}
    sec. 2.2   decode: x' = s * z_q  ("the sum of all the nearest codes found in the
               K codebooks multiplied by the standard deviation of the unquantized input")
    sec. 3     one quantizer per layer for keys and one for values; K = 8, C = 2048,
               d^ = 32; std kept in half precision; codebooks learned on calibration
               data by k-means initialization and EMA updates with decay 0.99
               (:mod:`vllm_lowbit_kv.calibrate`).

Decisions (the paper leaves these open or we depart from it on purpose):

* Keys are coded as the cache stores them, after RoPE (the paper quantizes the
  k_proj output before RoPE, inside its own model code; a serving cache only
  sees rotated keys). With Llama's rotate_half RoPE, channel c turns with
  channel c + d/2; the strided key groups keep each such pair in one group
  whenever d/d^ is even (64/32 = 2: even and odd channels).
* std is the population std (over the d channels, divided by d), rounded to
  fp16 before scaling so that encoder and decoder use the same value. The
  authors' code uses torch's unbiased std; the population std is at most
  max |x| and so always fits fp16 at the input bound 65504. A vector whose
  fp16 std is 0 (constant, or below fp16's range) is coded unscaled, with
  scale 1, as the authors' code does.
* Nearest code: squared Euclidean distance computed as ||c||^2 - 2 z.c (||z||^2
  is the same for every code), float32; ties go to the lowest index.

Stored per (block, head), T tokens, D channels, n = D / d^ groups, b = ceil(log2 C):
    codes   T * n * K indices of b bits, token-major, then group, then codebook;
            one little-endian bit stream (bitpack: 11-bit indices straddle bytes)
    std     fp16, one per token
Effective bits per element: n K b / D + 16 / D. At D = 64, d^ = 32: K=8, C=2048
gives 2.75 + 0.25 = 3.0 (the paper's "2.75 bits plus std"; at its D = 128 the std
costs 0.125); K=4, C=256: 1.25; K=2, C=256: 0.75.

Outside the pages: the codebooks, K * C * d^ fp16 values per layer and per K/V
(:attr:`RVQCodec.codebook_bytes`; K=8, C=2048: 1 MiB per layer and per K/V,
60 MiB for SmolLM2's 30 layers), in a safetensors file (:class:`RVQCodebooks`)
that records the model and the configuration it was made for; a file made for
another model or configuration is refused with the mismatch named.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import torch

from .base import BlockCodec, Layout, ModelIdentity, require
from .bitpack import from_bytes, pack_bits, packed_len, to_bytes, unpack_bits

GROUPINGS = ("strided", "contiguous")
ROLES = ("key", "value")
FILE_FORMAT = "vllm_lowbit_kv.rvq_codebooks"
FILE_VERSION = "1"
#: floats of one [rows, C] distance block: 2 MiB stays in cache for the argmin
#: (C=2048: 256 rows per block, 2x faster than 8192 rows on this machine's CPU)
SEARCH_BLOCK = 1 << 19
CALIBRATE_HINT = "python -m vllm_lowbit_kv.calibrate writes one"


# ----------------------------------------------------------------------------- search
def nearest(z: torch.Tensor, codes: torch.Tensor, norms: torch.Tensor | None = None) -> torch.Tensor:
    """Index of the nearest code for every row: z [M, d], codes [C, d] -> int64 [M].

    argmin_j ||z - c_j||^2 = argmin_j (||c_j||^2 - 2 z.c_j), SEARCH_BLOCK distances at a time.
    """
    if norms is None:
        norms = (codes * codes).sum(-1)
    ct = codes.t()
    rows = max(1, SEARCH_BLOCK // codes.shape[0])
    out = torch.empty(z.shape[0], dtype=torch.long, device=z.device)
    for s in range(0, z.shape[0], rows):
        out[s:s + rows] = torch.addmm(norms, z[s:s + rows], ct, alpha=-2).argmin(-1)
    return out


def residual_search(z: torch.Tensor, books: torch.Tensor, norms: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 1 (greedy residual search): z [M, d], books [K, C, d] ->
    (indices int64 [M, K], final residual z_{K+1} [M, d])."""
    if norms is None:
        norms = (books * books).sum(-1)
    r = z.clone()
    idx = torch.empty(z.shape[0], books.shape[0], dtype=torch.long, device=z.device)
    for i in range(books.shape[0]):
        idx[:, i] = nearest(r, books[i], norms[i])
        r -= books[i][idx[:, i]]
    return idx, r


def residual_decode(idx: torch.Tensor, books: torch.Tensor) -> torch.Tensor:
    """Sum of the chosen codes: idx [M, K], books [K, C, d] -> [M, d]."""
    K, C, d = books.shape
    flat = idx + torch.arange(K, device=idx.device) * C  # row of code j of book i: i * C + j
    return books.reshape(K * C, d).index_select(0, flat.reshape(-1)).reshape(-1, K, d).sum(1)


def channel_groups(x: torch.Tensor, group_size: int, grouping: str) -> torch.Tensor:
    """[..., D] -> [..., D / group_size, group_size] (sec. 3.1): ``contiguous`` groups
    consecutive channels, ``strided`` takes every (D / group_size)-th channel."""
    n = x.shape[-1] // group_size
    if grouping == "contiguous":
        return x.reshape(*x.shape[:-1], n, group_size)
    return x.reshape(*x.shape[:-1], group_size, n).transpose(-1, -2)


def channel_ungroup(g: torch.Tensor, grouping: str) -> torch.Tensor:
    """Inverse of :func:`channel_groups`."""
    if grouping == "contiguous":
        return g.reshape(*g.shape[:-2], -1)
    return g.transpose(-1, -2).reshape(*g.shape[:-2], -1)


def std_scale(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp16 population std of each vector [..., 1], float32 scale used: std, or 1 where 0)."""
    std = x.std(dim=-1, correction=0, keepdim=True).half()
    s = std.float()
    return std, torch.where(s > 0, s, torch.ones_like(s))


# ----------------------------------------------------------------------------- file
@dataclass(frozen=True)
class RVQSettings:
    """What a codebook file must agree on with the codecs that use it."""

    num_codebooks: int
    codebook_size: int
    group_size: int
    key_grouping: str
    value_grouping: str

    def grouping(self, role: str) -> str:
        return self.key_grouping if role == "key" else self.value_grouping


def _file_error(src: object, msg: str) -> ValueError:
    return ValueError(f"RVQ codebook file {src}: {msg}")


class RVQCodebooks:
    """One model's learned RVQ codebooks: ``key`` and ``value``, float16
    [num_layers, K, C, group_size], with the model and configuration they were
    made for and how (``provenance``: seed, calibration text sha256, command, ...)."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor, model: ModelIdentity,
                 settings: RVQSettings, provenance: dict[str, str] | None = None,
                 source: str = "<in memory>"):
        shape = (model.num_layers, settings.num_codebooks, settings.codebook_size, settings.group_size)
        for role, t in (("key", key), ("value", value)):
            if tuple(t.shape) != shape:
                raise _file_error(source, f"{role} codebooks have shape {tuple(t.shape)}, expected "
                                          f"[layers, K, C, group_size] = {list(shape)}")
            if not bool(torch.isfinite(t).all()):
                raise _file_error(source, f"{role} codebooks hold NaN or Inf")
        require(model.head_dim % settings.group_size == 0, "group_size",
                f"a divisor of the model's head_dim {model.head_dim}", settings.group_size)
        self.key, self.value = key.to(torch.float16).contiguous(), value.to(torch.float16).contiguous()
        self.model, self.settings = model, settings
        self.provenance = dict(provenance or {})
        self.source = source
        self._float_layers: dict[int, torch.Tensor] = {}

    def tensor(self, role: str) -> torch.Tensor:
        return self.key if role == "key" else self.value

    def layer_codewords(self, layer: int) -> torch.Tensor:
        """float32 [2, K, C, group_size]: one layer's key and value codebooks, made once:
        every codec of the layer reads its role's half, kernels the pair as it is."""
        if layer not in self._float_layers:
            self._float_layers[layer] = torch.stack([self.key[layer], self.value[layer]]).float()
        return self._float_layers[layer]

    @property
    def nbytes(self) -> int:
        """Bytes of all codebooks (every layer, K and V) as stored."""
        return sum(t.numel() * t.element_size() for t in (self.key, self.value))

    # -- checks ----------------------------------------------------------------
    def check_model(self, model: ModelIdentity) -> list[str]:
        diff = ModelIdentity(self.model.name, self.model.num_layers, self.model.num_kv_heads,
                             self.model.head_dim).mismatches(model)
        if not diff:
            return []
        return [f"RVQ codebook file {self.source} was made for {self.model.describe()}, not for "
                f"{model.describe()} ({'; '.join(diff)}); calibrate one for this model "
                f"({CALIBRATE_HINT})"]

    def check_settings(self, needed: dict[str, object]) -> list[str]:
        """Reasons the file does not have the :class:`RVQSettings` fields ``needed``."""
        mine = asdict(self.settings)
        diff = [f"{k}={mine[k]!r} (needed {v!r})" for k, v in needed.items() if mine[k] != v]
        if not diff:
            return []
        return [f"RVQ codebook file {self.source} was made for another configuration: "
                + ", ".join(diff)]

    # -- safetensors -----------------------------------------------------------
    def metadata(self) -> dict[str, str]:
        meta = {"format": FILE_FORMAT, "format_version": FILE_VERSION,
                "model_name": self.model.name, "num_layers": str(self.model.num_layers),
                "num_kv_heads": str(self.model.num_kv_heads), "head_dim": str(self.model.head_dim),
                "model_config_sha": self.model.config_sha}
        meta.update({k: str(v) for k, v in asdict(self.settings).items()})
        meta.update({f"provenance.{k}": str(v) for k, v in self.provenance.items()})
        return meta

    def save(self, path: str | os.PathLike) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_file({"key": self.key, "value": self.value}, str(tmp), metadata=self.metadata())
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RVQCodebooks":
        """Read a file (cached per path and modification time); errors name the file."""
        p = Path(path).expanduser()
        try:
            st = p.resolve().stat()
        except (FileNotFoundError, NotADirectoryError):
            raise _file_error(path, f"no such file ({CALIBRATE_HINT})") from None
        return _load_cached(str(p.resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _load_cached(path: str, mtime_ns: int, size: int) -> RVQCodebooks:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FILE_FORMAT:
                raise _file_error(path, f"not an RVQ codebook file (metadata format "
                                        f"{meta.get('format')!r}, expected {FILE_FORMAT!r})")
            if meta.get("format_version") != FILE_VERSION:
                raise _file_error(path, f"format_version {meta.get('format_version')!r}, this "
                                        f"version reads {FILE_VERSION!r}")
            key, value = f.get_tensor("key"), f.get_tensor("value")
    except SafetensorError as e:
        raise _file_error(path, f"not a readable safetensors file ({e})") from None
    try:
        model = ModelIdentity(meta["model_name"], int(meta["num_layers"]),
                              int(meta["num_kv_heads"]), int(meta["head_dim"]))
        settings = RVQSettings(int(meta["num_codebooks"]), int(meta["codebook_size"]),
                               int(meta["group_size"]), meta["key_grouping"], meta["value_grouping"])
    except (KeyError, ValueError) as e:
        raise _file_error(path, f"incomplete metadata ({e!r})") from None
    if meta.get("model_config_sha") != model.config_sha:
        raise _file_error(path, f"model_config_sha {meta.get('model_config_sha')!r} does not match "
                                f"its recorded geometry ({model.config_sha!r}): edited or corrupt")
    provenance = {k.removeprefix("provenance."): v for k, v in meta.items()
                  if k.startswith("provenance.")}
    return RVQCodebooks(key, value, model, settings, provenance, source=path)


# ----------------------------------------------------------------------------- codec
class RVQCodec(BlockCodec):
    """Residual vector quantization of each token's K or V head vector (seed 001).

    ``codebook``: an :class:`RVQCodebooks` or the path of its file; ``layer``: the
    attention layer whose codebooks to use (filled in by the scheme, per layer).
    Without both, the codec still knows its layout (bytes, bits) but refuses to
    encode or decode.
    """

    role: ClassVar[str]
    default_grouping: ClassVar[str]

    def __init__(self, block_tokens: int, head_dim: int, num_codebooks: int = 8,
                 codebook_size: int = 2048, group_size: int = 32, grouping: str | None = None,
                 codebook: str | os.PathLike | RVQCodebooks | None = None, layer: int | None = None):
        super().__init__(block_tokens, head_dim)
        require(isinstance(num_codebooks, int) and not isinstance(num_codebooks, bool)
                and 1 <= num_codebooks <= 64, "num_codebooks", "an int in [1, 64]", num_codebooks)
        require(isinstance(codebook_size, int) and not isinstance(codebook_size, bool)
                and 2 <= codebook_size <= 1 << 16, "codebook_size", "an int in [2, 65536]",
                codebook_size)
        require(isinstance(group_size, int) and group_size >= 1 and head_dim % group_size == 0,
                "group_size", f"a divisor of head_dim={head_dim}", group_size)
        grouping = self.default_grouping if grouping is None else grouping
        require(grouping in GROUPINGS, "grouping", f"one of {GROUPINGS}", grouping)
        require(layer is None or (isinstance(layer, int) and layer >= 0), "layer",
                "an int >= 0 or None", layer)
        self.num_codebooks, self.codebook_size = num_codebooks, codebook_size
        self.group_size, self.grouping, self.layer = group_size, grouping, layer
        self.n_groups = head_dim // group_size
        self.index_bits = (codebook_size - 1).bit_length()
        self.file: RVQCodebooks | None = None
        self.codebook = codebook.source if isinstance(codebook, RVQCodebooks) else codebook
        self._books: torch.Tensor | None = None
        if codebook is None:
            return
        books = codebook if isinstance(codebook, RVQCodebooks) else RVQCodebooks.load(codebook)
        reasons = books.check_settings({"num_codebooks": num_codebooks, "codebook_size": codebook_size,
                                        "group_size": group_size, f"{self.role}_grouping": grouping})
        if reasons:
            raise ValueError(reasons[0])
        self.file = books
        if layer is not None:
            require(layer < books.model.num_layers, "layer",
                    f"an index in [0, {books.model.num_layers}) (layers in {books.source})", layer)
            self._books = books.layer_codewords(layer)[ROLES.index(self.role)]  # [K, C, d^]
            self._norms = (self._books * self._books).sum(-1)

    @property
    def codebook_bytes(self) -> int:
        """Bytes of this codec's codebooks (one layer), stored outside the pages."""
        return self.num_codebooks * self.codebook_size * self.group_size * 2

    @property
    def working_bytes(self) -> int:
        """Bytes this codec holds for its layer beside the file: the codebooks in float32
        (:attr:`codewords`, what kernels read) and their squared norms."""
        return self.num_codebooks * self.codebook_size * (self.group_size + 1) * 4

    def check_model(self, model: ModelIdentity) -> list[str]:
        """Reasons these codebooks cannot serve ``model`` (empty: they can)."""
        if self.file is None:
            return [f"RVQ needs a codebook file made for this model: set the lowbit_kv field "
                    f"'codebook' ({CALIBRATE_HINT})"]
        return self.file.check_model(model)

    def layout(self) -> Layout:
        n_idx = self.block_tokens * self.n_groups * self.num_codebooks
        return Layout((("codes", packed_len(n_idx, self.index_bits)),
                       ("std", 2 * self.block_tokens)))

    @property
    def codewords(self) -> torch.Tensor:
        """float32 [K, C, d^]: this codec's codebooks (its layer's), what kernels read."""
        return self._codebooks()[0]

    def _codebooks(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._books is None:
            missing = "a codebook file (lowbit_kv field 'codebook')" if self.file is None else \
                "a layer index (the scheme passes it per layer)"
            raise ValueError(f"{type(self).__name__} cannot code without {missing}")
        return self._books, self._norms

    def encode_groups(self, x, relevance=None):
        books, norms = self._codebooks()
        G, T = x.shape[:2]
        std, scale = std_scale(x)
        z = channel_groups(x / scale, self.group_size, self.grouping)  # [G, T, n, d^]
        idx, _ = residual_search(z.reshape(-1, self.group_size), books.to(x.device),
                                 norms.to(x.device))
        return self.layout().join({
            "codes": pack_bits(idx.reshape(G, -1), self.index_bits),
            "std": to_bytes(std.reshape(G, T)),
        })

    def decode_groups(self, packed):
        books, _ = self._codebooks()
        G, T, K = packed.shape[0], self.block_tokens, self.num_codebooks
        f = self.layout().split(packed)
        idx = unpack_bits(f["codes"], self.index_bits, T * self.n_groups * K).long()
        zq = residual_decode(idx.reshape(-1, K), books.to(packed.device))
        x = channel_ungroup(zq.reshape(G, T, self.n_groups, self.group_size), self.grouping)
        s = from_bytes(f["std"], torch.float16).float().unsqueeze(-1)  # [G, T, 1]
        return x * torch.where(s > 0, s, torch.ones_like(s))


class RVQKeyCodec(RVQCodec):
    """RVQ of keys: non-contiguous channel groups by default (sec. 3.1)."""

    role = "key"
    default_grouping = "strided"


class RVQValueCodec(RVQCodec):
    """RVQ of values: contiguous channel groups (sec. 3.1)."""

    role = "value"
    default_grouping = "contiguous"


def joint_codewords(key: RVQKeyCodec, value: RVQValueCodec) -> torch.Tensor:
    """float32, flat: the keys' codebooks then the values', as kernels take them: the
    file's tensor of the layer (:meth:`RVQCodebooks.layer_codewords`), not a copy."""
    require(key.file is not None and key.file is value.file and key.layer == value.layer,
            "RVQ codecs", "keys and values of one codebook file and layer",
            (key.codebook, key.layer, value.codebook, value.layer))
    return key.file.layer_codewords(key.layer).reshape(-1)
