"""Learn RVQ codebooks for a model's KV cache (seed 001, section 3).

    python -m vllm_lowbit_kv.calibrate                              # rvq (K=8, C=2048), embedded SmolLM2
    python -m vllm_lowbit_kv.calibrate --kv-cache-dtype rvq4x256 --out rvq4x256.safetensors
    python -m serving --kv-cache-dtype rvq4x256 --lowbit-config <(echo '{"codebook": "rvq4x256.safetensors"}')

What it does (the paper's recipe, scaled to a small calibration text):

1. Capture. The model (transformers, bf16, as served) reads the first
   ``--tokens`` tokens of the calibration text as one sequence, prefilled
   ``--chunk`` tokens at a time through a ``DynamicCache``. Per layer it keeps
   what the cache stores: K after RoPE and V, ``[tokens, kv_heads, head_dim]``.
   The default text is the project's held-out calibration text
   (``vllm_lowbit_kv.corpus.calibration_text()``, never the yardstick's evaluation text).
2. Vectors. Each token-head vector is std-scaled and split into channel groups
   exactly as :class:`~vllm_lowbit_kv.codecs.rvq.RVQCodec` does (keys strided,
   values contiguous), giving ``tokens * kv_heads * head_dim / group_size``
   vectors per layer for K and as many for V; one residual quantizer each.
3. k-means initialization on the first batch ("We initialize each codebook
   using k-means clustering on the first batch of the corresponding inputs"):
   codebook i is k-means (points initialization, ``--kmeans-iters`` Lloyd
   iterations, as scipy's ``kmeans2`` in the authors' code) of the residuals
   the codebooks before it leave (Algorithm 1).
4. EMA updates ("update them using exponential moving average with a decay
   factor of 0.99"), one per batch of ``--batch-tokens`` tokens for ``--steps``
   batches (the data reshuffled every epoch): each batch is coded by
   Algorithm 1 with the current codebooks, then for every codebook i, with
   n_j the vectors whose level-i code is j and s_j the sum of their level-i
   residuals (van den Oord et al. 2017, appendix A.1):
       N_j <- d N_j + (1 - d) n_j,   m_j <- d m_j + (1 - d) s_j,
       e_j  = m_j / N~_j,   N~_j = (N_j + eps) / (sum N + C eps) * sum N
   (Laplace smoothing, eps = 1e-5, and N_j = 1, m_j = e_j at the start, as the
   authors' code).
5. Writes a safetensors file (:class:`~vllm_lowbit_kv.codecs.rvq.RVQCodebooks`):
   float16 codebooks ``key``/``value`` [layers, K, C, group_size], metadata with
   the model (name, layers, KV heads, head_dim, config sha), the configuration
   (K, C, group size, groupings) and the provenance (seed, calibration text
   sha256, tokens, steps, the equivalent command). The codecs refuse a file
   made for another model or configuration.

Reproducible: the same arguments on the same machine give the same file (all
randomness comes from ``--seed``). Without ``--out`` the file goes to
``<cache>/codebooks/<model>/<scheme>-k<K>c<C>g<group>-seed<seed>-<hash>.safetensors``,
the hash covering every setting and the text, and an existing file is reused
(:func:`ensure_codebook`; :func:`default_codebook`, what the benches call). Time for SmolLM2 on
the whole 5,101-token text, one thread, on this project's 2-core machine while
shared with other jobs (load 10-25): rvq2x256 2.0 min, rvq4x256 2.4 min,
rvq8x256 3.2 min, rvq (K=8, C=2048) 20 min.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .codecs.base import ModelIdentity, require
from .codecs.rvq import (ROLES, RVQCodebooks, RVQCodec, RVQSettings, channel_groups, nearest,
                         residual_search, std_scale)
from .corpus import calibration_text

#: Laplace smoothing of the EMA cluster sizes (the authors' code)
EMA_EPS = 1e-5


@dataclass(frozen=True)
class CalibrationConfig:
    """Everything that determines a codebook file besides the model and the text."""

    scheme: str = "rvq"
    num_codebooks: int | None = None  # None: the scheme's
    codebook_size: int | None = None
    group_size: int | None = None
    grouping: str | None = None
    tokens: int | None = None  # None: the whole text
    batch_tokens: int = 1024
    steps: int = 20
    kmeans_iters: int = 10
    decay: float = 0.99
    seed: int = 0
    chunk: int = 512
    #: torch threads while calibrating. The learning loop is many small ops; on a shared
    #: 2-core machine one thread ran it 2-60x faster than two (thread barriers), and a
    #: fixed count keeps float sums, hence files, identical from run to run.
    threads: int = 1

    def codecs(self, head_dim: int) -> tuple[RVQCodec, RVQCodec]:
        """The scheme's key and value codecs with this configuration's overrides."""
        from .schemes import get_scheme

        overrides = {k: v for k, v in (("num_codebooks", self.num_codebooks),
                                       ("codebook_size", self.codebook_size),
                                       ("group_size", self.group_size),
                                       ("grouping", self.grouping)) if v is not None}
        scheme = get_scheme(self.scheme)
        require(all(isinstance(c, RVQCodec) for c in scheme.codecs(head_dim)), "--kv-cache-dtype",
                "an RVQ scheme (rvq, rvq8x256, rvq4x256, ...)", self.scheme)
        scheme = scheme.with_params(head_dim, **overrides) if overrides else scheme
        return scheme.codecs(head_dim)

    def settings(self, head_dim: int) -> RVQSettings:
        kc, vc = self.codecs(head_dim)
        return RVQSettings(kc.num_codebooks, kc.codebook_size, kc.group_size, kc.grouping, vc.grouping)

    def validate(self) -> None:
        for name in ("batch_tokens", "steps", "kmeans_iters", "chunk", "threads"):
            v = getattr(self, name)
            require(isinstance(v, int) and v >= (0 if name in ("steps", "kmeans_iters") else 1),
                    f"--{name.replace('_', '-')}", "a non-negative int" if name in ("steps", "kmeans_iters")
                    else "an int >= 1", v)
        require(self.tokens is None or (isinstance(self.tokens, int) and self.tokens >= 2),
                "--tokens", "an int >= 2", self.tokens)
        require(isinstance(self.decay, float) and 0.0 <= self.decay < 1.0, "--decay",
                "a float in [0, 1)", self.decay)

    def command(self, model_dir: str | Path, out: str | Path, text_file: str | Path | None) -> str:
        """The CLI command that makes this file."""
        args = ["python", "-m", "vllm_lowbit_kv.calibrate", "--model", str(model_dir)]
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None:
                args += ["--kv-cache-dtype" if f.name == "scheme" else f"--{f.name.replace('_', '-')}",
                         str(v)]
        if text_file is not None:
            args += ["--text-file", str(text_file)]
        return shlex.join(args + ["--out", str(out)])


# ----------------------------------------------------------------------------- capture
def load_model(model_dir: str | Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    return model, AutoTokenizer.from_pretrained(str(model_dir))


@torch.inference_mode()
def capture_kv(model, ids: Sequence[int], chunk: int = 512) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) float32 [tokens, kv_heads, head_dim] as a KV cache stores them
    (K after RoPE), from one sequence prefilled ``chunk`` tokens at a time."""
    from transformers import DynamicCache

    t = torch.as_tensor(list(ids), dtype=torch.long)[None]
    cache = DynamicCache()
    for s in range(0, t.shape[1], chunk):
        model(t[:, s:s + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1)
    return [(layer.keys[0].transpose(0, 1).float(), layer.values[0].transpose(0, 1).float())
            for layer in cache.layers]


def to_vectors(x: torch.Tensor, group_size: int, grouping: str) -> torch.Tensor:
    """[tokens, H, D] -> [tokens, H * D / group_size, group_size]: what the codec quantizes."""
    _, scale = std_scale(x)
    g = channel_groups(x / scale, group_size, grouping)
    return g.reshape(x.shape[0], -1, group_size)


# ----------------------------------------------------------------------------- learning
def segment_sums(x: torch.Tensor, idx: torch.Tensor, n: int) -> torch.Tensor:
    """Row sums of x [N, d] per index: [n, d] (scatter_add: index_add_ is much slower on CPU)."""
    return x.new_zeros(n, x.shape[1]).scatter_add_(0, idx.unsqueeze(-1).expand_as(x), x)


def kmeans(x: torch.Tensor, k: int, iters: int, gen: torch.Generator) -> torch.Tensor:
    """k centroids of x [N, d]: k distinct points drawn at random, then Lloyd iterations
    (a centroid left without points keeps its place)."""
    require(x.shape[0] >= k, "vectors in the first batch", f">= codebook_size {k} "
            "(raise --batch-tokens or --tokens)", x.shape[0])
    cent = x[torch.randperm(x.shape[0], generator=gen)[:k]].clone()
    for _ in range(iters):
        idx = nearest(x, cent)
        counts = torch.bincount(idx, minlength=k)
        sums = segment_sums(x, idx, k)
        filled = counts > 0
        cent[filled] = sums[filled] / counts[filled].unsqueeze(-1).float()
    return cent


class EMAResidualQuantizer:
    """K codebooks of C codes learned by EMA (module docstring, step 4)."""

    def __init__(self, books: torch.Tensor, decay: float):
        self.books, self.decay = books, decay
        K, C, _ = books.shape
        self.size = torch.ones(K, C)
        self.avg = books.clone()

    @classmethod
    def kmeans_init(cls, x: torch.Tensor, num_codebooks: int, codebook_size: int, iters: int,
                    decay: float, gen: torch.Generator) -> "EMAResidualQuantizer":
        books, r = [], x.clone()
        for _ in range(num_codebooks):
            c = kmeans(r, codebook_size, iters, gen)
            r -= c[nearest(r, c)]
            books.append(c)
        return cls(torch.stack(books), decay)

    def step(self, x: torch.Tensor) -> float:
        """One EMA update on a batch x [N, d]; returns the batch's relative squared error
        ||x - x_q||^2 / ||x||^2 under the codebooks before the update."""
        r = x.clone()
        levels = []
        for i in range(self.books.shape[0]):
            j = nearest(r, self.books[i])
            levels.append((j, r.clone()))
            r -= self.books[i][j]
        d = self.decay
        C = self.books.shape[1]
        for i, (j, ri) in enumerate(levels):
            self.size[i].mul_(d).add_(torch.bincount(j, minlength=C).float(), alpha=1 - d)
            self.avg[i].mul_(d).add_(segment_sums(ri, j, C), alpha=1 - d)
            n = self.size[i].sum()
            smoothed = (self.size[i] + EMA_EPS) / (n + C * EMA_EPS) * n
            self.books[i] = self.avg[i] / smoothed.unsqueeze(-1)
        return float((r * r).sum() / (x * x).sum().clamp_min(1e-30))


def relative_error(x: torch.Tensor, books: torch.Tensor) -> float:
    """||x - RVQ(x)||^2 / ||x||^2 over vectors x [N, d] (Algorithm 1 with ``books``)."""
    _, r = residual_search(x, books.float())
    return float((r * r).sum() / (x * x).sum().clamp_min(1e-30))


def learn(vectors: torch.Tensor, num_codebooks: int, codebook_size: int, cfg: CalibrationConfig,
          gen: torch.Generator) -> tuple[torch.Tensor, list[float]]:
    """Codebooks [K, C, d] for vectors [tokens, per_token, d]: k-means on the first batch,
    then ``cfg.steps`` EMA batches; also the relative error of each EMA batch."""
    n_tok, per_tok, d = vectors.shape
    B = min(cfg.batch_tokens, n_tok)
    order = torch.randperm(n_tok, generator=gen)
    first = vectors[order[:B]].reshape(-1, d)
    q = EMAResidualQuantizer.kmeans_init(first, num_codebooks, codebook_size, cfg.kmeans_iters,
                                         cfg.decay, gen)
    errors, pos = [], 0
    for _ in range(cfg.steps):
        if pos + B > n_tok:  # next epoch
            order, pos = torch.randperm(n_tok, generator=gen), 0
        errors.append(q.step(vectors[order[pos:pos + B]].reshape(-1, d)))
        pos += B
    return q.books, errors


def calibrate(model_dir: str | Path, cfg: CalibrationConfig, *, text: str | None = None,
              text_source: str | None = None, progress: bool = True,
              command: str | None = None) -> RVQCodebooks:
    """Capture K/V of ``model_dir`` on the calibration text and learn its codebooks."""
    cfg.validate()
    if text is None:
        text, text_source = calibration_text(), "vllm_lowbit_kv.corpus.calibration_text()"
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _calibrate(model_dir, cfg, text, text_source, progress, command)
    finally:
        torch.set_num_threads(threads)


def _calibrate(model_dir, cfg: CalibrationConfig, text: str, text_source: str | None,
               progress: bool, command: str | None) -> RVQCodebooks:
    from tqdm.auto import tqdm

    t0 = time.time()
    model, tok = load_model(model_dir)
    identity = ModelIdentity.from_hf_config(model.config, model_dir)
    settings = cfg.settings(identity.head_dim)
    ids = tok(text).input_ids
    ids = ids[:cfg.tokens] if cfg.tokens else ids
    require(len(ids) >= 2, "calibration text", "at least 2 tokens", len(ids))
    kv = capture_kv(model, ids, cfg.chunk)
    del model
    books = {r: [] for r in ROLES}
    last_epoch: dict[str, list[float]] = {r: [] for r in ROLES}
    bar = tqdm(total=2 * len(kv), desc="calibrate", unit="quantizer", disable=not progress,
               dynamic_ncols=True)
    per_epoch = max(1, -(-len(ids) // cfg.batch_tokens))
    for layer, (k, v) in enumerate(kv):
        for ri, (role, x) in enumerate((("key", k), ("value", v))):
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + 2 * layer + ri)
            vec = to_vectors(x, settings.group_size, settings.grouping(role))
            b, errs = learn(vec, settings.num_codebooks, settings.codebook_size, cfg, gen)
            books[role].append(b)
            last_epoch[role] += errs[-per_epoch:]
            bar.set_postfix_str(f"layer {layer} {role}: rel. error "
                                f"{errs[-1] if errs else float('nan'):.4f}")
            bar.update(1)
    bar.close()
    mean = {r: (round(sum(e) / len(e), 5) if e else None) for r, e in last_epoch.items()}
    provenance = dict(
        command=command or "", scheme=cfg.scheme, model_path=str(model_dir), seed=cfg.seed,
        tokens=len(ids), batch_tokens=cfg.batch_tokens, steps=cfg.steps,
        kmeans_iters=cfg.kmeans_iters, decay=cfg.decay, chunk=cfg.chunk, threads=cfg.threads,
        calibration_text_source=text_source or "(given text)",
        calibration_text_sha256=hashlib.sha256(text.encode()).hexdigest(),
        rel_error_key=mean["key"], rel_error_value=mean["value"],
        elapsed_s=round(time.time() - t0, 1), torch=torch.__version__)
    return RVQCodebooks(torch.stack(books["key"]), torch.stack(books["value"]), identity, settings,
                        {k: str(v) for k, v in provenance.items()})


# ----------------------------------------------------------------------------- files
def default_output(model_dir: str | Path, cfg: CalibrationConfig, text: str) -> Path:
    """``<cache>/codebooks/<model>/<scheme>-k<K>c<C>g<group>-seed<seed>-<hash>.safetensors``,
    the hash over the model geometry, every setting and the text."""
    from transformers import AutoConfig

    from .model import cache_root

    identity = ModelIdentity.from_hf_config(AutoConfig.from_pretrained(str(model_dir)), model_dir)
    s = cfg.settings(identity.head_dim)
    key = json.dumps(dict(model=dataclasses.asdict(identity), calibration=dataclasses.asdict(cfg),
                          settings=dataclasses.asdict(s),
                          text=hashlib.sha256(text.encode()).hexdigest()), sort_keys=True)
    h = hashlib.sha256(key.encode()).hexdigest()[:10]
    name = f"{cfg.scheme}-k{s.num_codebooks}c{s.codebook_size}g{s.group_size}-seed{cfg.seed}-{h}"
    return cache_root() / "codebooks" / (identity.name or "model") / f"{name}.safetensors"


def ensure_codebook(model_dir: str | Path, cfg: CalibrationConfig, *, progress: bool = True) -> Path:
    """The default codebook file of this model and configuration (calibration text),
    calibrated now if it does not exist yet."""

    text = calibration_text()
    out = default_output(model_dir, cfg, text)
    if not out.is_file():
        books = calibrate(model_dir, cfg, text=text, progress=progress,
                          text_source="vllm_lowbit_kv.corpus.calibration_text()",
                          command=cfg.command(model_dir, out, None))
        books.save(out)
    return out


def default_codebook(model_dir: str | Path, scheme: str, *, seed: int = 0,
                     num_codebooks: int | None = None, progress: bool = True) -> Path | None:
    """:func:`ensure_codebook` of the default calibration of ``scheme`` for this model
    (with ``num_codebooks`` codebooks instead of the scheme's, if given); None for a
    scheme without learned codebooks (every one but the ``rvq*`` schemes)."""
    from .schemes import SCHEMES

    if scheme not in SCHEMES or not SCHEMES[scheme].key.accepts("codebook"):
        return None
    return ensure_codebook(model_dir, CalibrationConfig(scheme=scheme, seed=seed, num_codebooks=num_codebooks),
                           progress=progress)


# ----------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    d = CalibrationConfig()
    p = argparse.ArgumentParser(prog="python -m vllm_lowbit_kv.calibrate",
                                description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="HF model folder (default: the embedded SmolLM2)")
    p.add_argument("--kv-cache-dtype", dest="scheme", default=d.scheme,
                   help="the RVQ scheme whose codebooks to learn (rvq, rvq8x256, rvq4x256, rvq2x256)")
    p.add_argument("--num-codebooks", type=int, default=None, help="K (default: the scheme's)")
    p.add_argument("--codebook-size", type=int, default=None, help="C (default: the scheme's)")
    p.add_argument("--group-size", type=int, default=None, help="code dimension (default: the scheme's)")
    p.add_argument("--grouping", choices=["strided", "contiguous"], default=None,
                   help="channel grouping of K and V (default: K strided, V contiguous)")
    p.add_argument("--text-file", default=None,
                   help="calibration text (default: vllm_lowbit_kv.corpus.calibration_text(), held out "
                        "from the yardstick's text)")
    p.add_argument("--tokens", type=int, default=None, help="calibration tokens (default: the whole text)")
    p.add_argument("--batch-tokens", type=int, default=d.batch_tokens, help="tokens per batch")
    p.add_argument("--steps", type=int, default=d.steps, help="EMA update steps (batches)")
    p.add_argument("--kmeans-iters", type=int, default=d.kmeans_iters, help="Lloyd iterations of the init")
    p.add_argument("--decay", type=float, default=d.decay, help="EMA decay")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--chunk", type=int, default=d.chunk, help="prefill chunk of the capture (tokens)")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="torch threads (1: fastest on a shared 2-core machine, see CalibrationConfig)")
    p.add_argument("--out", default=None, help="output file (default: a file in the cache named "
                                                "after the settings; reused if it exists)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return p


def main(argv: Sequence[str] | None = None) -> Path:
    args = build_parser().parse_args(argv)
    cfg = CalibrationConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(CalibrationConfig)})
    try:
        cfg.validate()
        model_dir = args.model
        if model_dir is None:
            from .model import prepare_model
            model_dir = str(prepare_model())
        if args.text_file is None:
            text, source = calibration_text(), "vllm_lowbit_kv.corpus.calibration_text()"
        else:
            text, source = Path(args.text_file).read_text(encoding="utf-8"), str(args.text_file)
        out = Path(args.out) if args.out else default_output(model_dir, cfg, text)
        books = calibrate(model_dir, cfg, text=text, text_source=source, progress=not args.no_progress,
                          command=cfg.command(model_dir, out, args.text_file))
    except ValueError as e:
        raise SystemExit(f"calibrate: {e}") from None
    books.save(out)
    p = books.provenance
    print(f"wrote {out}: {books.model.describe()}, K={books.settings.num_codebooks} "
          f"C={books.settings.codebook_size} group_size={books.settings.group_size}, "
          f"{books.nbytes / 2**20:.2f} MiB of codebooks (outside the KV pages); "
          f"{p['tokens']} tokens, relative error (last epoch) K {p['rel_error_key']} "
          f"V {p['rel_error_value']}, {p['elapsed_s']} s", file=sys.stderr)
    print(f"serve: python -m serving --model {model_dir} --kv-cache-dtype {cfg.scheme} "
          f"--additional-config '{json.dumps({'lowbit_kv': {'codebook': str(out)}})}'", file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
