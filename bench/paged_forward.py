"""A transformers model whose every attention layer runs through ``paged.forward_layer``:
the serving path's pages, staging, sinks, window, rotation and packed attention, on any
device, without vLLM.

This is how the GPU path is checked where vLLM itself cannot run (the GPU machines have
no vLLM): the same step a vLLM attention backend takes (plan once per step with
:class:`~vllm_lowbit_kv.paged.StagingAllocator`, then one ``forward_layer`` per layer),
driven by the model's own layers. One sequence, chunked prefill, then greedy decode.

    python -m bench.paged_forward --device cuda --kv-cache-dtype vidkv \\
        --json bench/results/gpu_forward.json

prints and records, per packed-attention implementation that runs the scheme on the
device: teacher-forced perplexity of the default text through the paged path, the same
through the transformers cache (``hf_cache``, the reference engine, on the CPU) and
through bf16, and the largest logit difference from the paged path on the CPU.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from bench import machine
from vllm_lowbit_kv.ops import select_implementation
from vllm_lowbit_kv.paged import (HeadSplitLayout, Staging, StagingAllocator, forward_layer,
                                  forward_split_layer)
from vllm_lowbit_kv.retrieval_heads import model_retrieval_heads, part_implementations
from vllm_lowbit_kv.schemes import KVScheme, get_scheme

ATTENTION = "lowbit_kv_paged_forward"
#: observation window of STP's relevance (the vLLM backend's default)
OBS_WINDOW = 32


class PagedModel:
    """``model`` (Llama-style, RoPE, full attention) with its KV in packed pages on ``device``."""

    def __init__(self, model, scheme: KVScheme, device: str, max_tokens: int,
                 attention_impl: str | None = None, reference_arithmetic: bool = False):
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        cfg = model.config.get_text_config(decoder=True)
        self.model, self.scheme, self.device = model.to(device), scheme, torch.device(device)
        H, Hq = cfg.num_key_value_heads, cfg.num_attention_heads
        D = getattr(cfg, "head_dim", None) or cfg.hidden_size // Hq
        T, bs = scheme.block_tokens, scheme.page_size
        self.block_size = bs
        self.block_table = torch.arange(-(-max_tokens // bs))
        # layers with retrieval heads hold pages of two formats, as in the vLLM backend
        retrieval = model_retrieval_heads(model.config._name_or_path, scheme.retrieval_heads) \
            if scheme.retrieval_heads else {}
        self.layouts = [scheme.layout(D, H, bs, model.dtype, layer=layer,
                                      retrieval_heads=retrieval.get(layer, ()))
                        for layer in range(cfg.num_hidden_layers)]
        self.obs_window = OBS_WINDOW if scheme.uses_relevance else None
        self.reference_arithmetic = reference_arithmetic
        slots = scheme.staged_groups
        self.pages = [torch.zeros(lay.page_shape(len(self.block_table)), dtype=torch.uint8,
                                  device=device) for lay in self.layouts]
        self.staging = [Staging.allocate(slots, T, H, D, model.dtype,
                                         Hq if self.obs_window else None, device=device,
                                         staging_dtype=scheme.staging_dtype)
                        for _ in self.layouts]
        self.alloc = StagingAllocator(slots, T, scheme.sink_tokens, scheme.residual_tokens // T,
                                      scheme.leading_tokens // T)
        self.attention_impl, self.packed_attention = select_implementation(
            scheme.layout(D, H, bs), device, attention_impl, gqa=Hq // H)
        retrieval_attention = select_implementation(
            scheme.retrieval_layout(D, H, bs), device,
            attention_impl, gqa=Hq // H)[1] if scheme.retrieval_heads else None
        #: per layer, the implementation reading each part of its pages (as the backend)
        self.part_attention = [part_implementations(retrieval.get(layer, ()), H,
                                                    self.packed_attention, retrieval_attention)
                               for layer in range(cfg.num_hidden_layers)]
        self.length = 0
        self._plans = None
        AttentionInterface.register(ATTENTION, self._attention)
        AttentionMaskInterface.register(ATTENTION, sdpa_mask)
        model.set_attn_implementation(ATTENTION)

    def _attention(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        """One layer of one step: [1, heads, S, D] -> ([1, S, Hq, D], None)."""
        i = module.layer_idx
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
        out = torch.empty_like(q)
        if isinstance(self.layouts[i], HeadSplitLayout):
            forward_split_layer(*self._plans, self.layouts[i], q, k, v, self.pages[i],
                                self.staging[i], scaling, out, self.obs_window,
                                self.part_attention[i], self.reference_arithmetic)
        else:
            forward_layer(*self._plans, self.layouts[i], q, k, v, self.pages[i], self.staging[i],
                          scaling, out, self.obs_window, self.part_attention[i][0],
                          self.reference_arithmetic)
        return out[None], None

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Append ``ids`` [S] to the sequence; their logits [S, vocab] float32."""
        S, bs = ids.shape[0], self.block_size
        pos = torch.arange(self.length, self.length + S)
        self.length += S
        slots = self.block_table[pos // bs] * bs + pos % bs
        self._plans = self.alloc.plan_step(slots, [self.length], [0, S], self.block_table[None],
                                           self.layouts[0].groups_per_block, owners=["seq"])
        logits = self.model(ids[None].to(self.device), position_ids=pos[None].to(self.device),
                            use_cache=False).logits
        return logits[0].float()


def teacher_forced_nll(forward, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Negative log-likelihood of ids[1:] [len - 1], prefilling ``chunk`` tokens at a time."""
    out = []
    for s in range(0, ids.shape[0] - 1, chunk):
        logits = forward(ids[s:s + chunk]).cpu()
        tgt = ids[s + 1:s + 1 + logits.shape[0]]
        out.append(-torch.log_softmax(logits[:tgt.shape[0]], -1).gather(-1, tgt[:, None])[:, 0])
    return torch.cat(out)


def reference_nll(model, scheme: KVScheme | None, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """The same through transformers on the CPU: bf16 (``scheme`` None) or hf_cache."""
    from transformers import DynamicCache

    from vllm_lowbit_kv.hf_cache import LowBitKVCache

    model = model.to("cpu")
    model.set_attn_implementation("sdpa")
    cache = DynamicCache() if scheme is None else LowBitKVCache(scheme, model=model)

    @torch.inference_mode()
    def forward(x):
        return model(x[None], past_key_values=cache, use_cache=True).logits[0].float()
    return teacher_forced_nll(forward, ids, chunk)


def run(model_dir: str, scheme_name: str, device: str, tokens: int, chunk: int,
        impls: list[str], dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """One row per implementation in ``impls`` (model weights and activations in ``dtype``:
    float32 makes the engines' arithmetic equal, so only the KV path can differ; there the
    paged path also encodes and attends to its exact part in the transformers cache's own
    arithmetic, ``reference_arithmetic``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_lowbit_kv.corpus import default_text

    load = lambda: AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()  # noqa: E731
    ids = torch.tensor(AutoTokenizer.from_pretrained(model_dir)(default_text()).input_ids[:tokens])
    scheme = get_scheme(scheme_name)
    bf16 = reference_nll(load(), None, ids, chunk)
    hf = reference_nll(load(), scheme, ids, chunk)
    parity = dtype == torch.float32
    cpu = PagedModel(load(), scheme, "cpu", tokens, reference_arithmetic=parity)
    cpu_logits = [cpu.forward(ids[s:s + chunk]) for s in range(0, tokens, chunk)]
    rows = []
    for impl in impls:
        try:
            paged = PagedModel(load(), scheme, device, tokens, impl, parity)
        except ValueError as e:  # this implementation cannot read the scheme there: say why
            rows.append(dict(scheme=scheme_name, device=device, attention_impl=impl, skipped=str(e)))
            continue
        diff = max(float((paged.forward(ids[s:s + chunk]).cpu() - ref).abs().max())
                   for s, ref in zip(range(0, tokens, chunk), cpu_logits))
        paged = PagedModel(load(), scheme, device, tokens, impl, parity)
        nll = teacher_forced_nll(paged.forward, ids, chunk)
        rows.append(dict(scheme=scheme_name, device=device, dtype=str(dtype).removeprefix("torch."),
                         attention_impl=paged.attention_impl,
                         ppl=float(nll.mean().exp()), ppl_hf_cache=float(hf.mean().exp()),
                         ppl_bf16=float(bf16.mean().exp()), max_logit_diff_vs_cpu=diff))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kv-cache-dtype", default="vidkv")
    p.add_argument("--attention-impl", default="auto",
                   help="comma-separated packed-attention implementations to run (auto: the "
                        "first that runs the scheme on the device)")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--model", default=None, help="HF model folder (default: prepare_model())")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from vllm_lowbit_kv.model import prepare_model
    model_dir = args.model or str(prepare_model())
    t0 = time.time()
    rows = run(model_dir, args.kv_cache_dtype, args.device, args.tokens, args.chunk,
               args.attention_impl.split(","), getattr(torch, args.dtype))
    for r in rows:
        print(json.dumps(r))
    if args.json:
        dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else machine.cpu_name()
        Path(args.json).write_text(json.dumps(dict(
            command="python -m bench.paged_forward " + shlex.join(sys.argv[1:] if argv is None else argv),
            model=Path(model_dir).name, device_name=dev, rows=rows,
            elapsed_s=round(time.time() - t0, 1)), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
