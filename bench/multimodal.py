"""Image requests per KV scheme on the test VLM: greedy answers against bf16's, bits, and
the visual tokens STP protected, through the real server.

    python -m bench.multimodal            # bfloat16, vidkv, vidkv_stp, vidkv_visual, kivi2
    python -m bench.multimodal --kv-cache-dtype bfloat16,vidkv_stp --tokens 32 \\
        --json bench/results/multimodal.json --png bench/results/multimodal.png

The model is the test VLM (``python -m vllm_lowbit_kv.model --vlm``): SmolLM2-135M
behind an untrained, seeded vision tower. **What it says about an image is
meaningless**; what this measures is how far each KV format moves the served model's
greedy text from bf16's on prompts full of image tokens (64 per image), not visual
quality. Each scheme gets its own server (``bench.server.measurement_server``: chunked
prefill of 256 tokens, so images are split across chunks; prefix caching off), then
the same chat requests: one image, two images, eight images as video frames, an
image before a long text, each answered greedily for ``--tokens`` tokens
(``ignore_eos``). Per scheme: tokens before the first divergence from bf16's answer
(agreement, mean and per prompt), answers equal to bf16's, the page bits the server
reports, and the visual tokens it encoded and protected (``/v1/kv_cache/stats``).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import shlex
import sys
import time
from pathlib import Path

from bench import RESULTS, machine
from bench.plotting import pyplot, save
from bench.server import STATS_ROUTE, get_json, measurement_server, post

#: the requests: (name, image seeds, text); distinct images, so no two share a block
CASES = (
    ("one image", (1,), "Describe the picture."),
    ("two images", (2, 3), "What differs between the two pictures?"),
    ("eight frames", tuple(range(10, 18)), "What happens in this video?"),
    ("image and long text", (4,), None),  # None: the long text of :func:`long_text`
)


def image_part(seed: int) -> dict:
    """An OpenAI ``image_url`` chat part: a distinct 512x512 PNG per seed, as a data URL."""
    from PIL import Image

    img = Image.new("RGB", (512, 512))
    img.putdata([((x * 7 + seed * 37) % 256, (y * 3 + seed * 11) % 256, (x ^ y ^ seed) % 256)
                 for y in range(512) for x in range(512)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def long_text(chars: int = 1500) -> str:
    from vllm_lowbit_kv.corpus import default_text

    return default_text()[:chars] + "\n\nWhat does the picture add to this text?"


def chat_body(model: str, seeds, text: str, tokens: int) -> dict:
    """A /v1/chat/completions body: one user turn of the images of ``seeds`` then
    ``text``, answered greedily with exactly ``tokens`` tokens (``ignore_eos``: an
    untrained vision tower may make the model stop at once)."""
    return {"model": model, "temperature": 0, "max_tokens": tokens, "ignore_eos": True,
            "messages": [{"role": "user",
                          "content": [image_part(s) for s in seeds] + [{"type": "text", "text": text}]}]}


def answer(port: int, model: str, seeds, text: str, tokens: int) -> dict:
    """Greedy answer of exactly ``tokens`` tokens: its ids and the prompt's length."""
    out = post(port, "/v1/chat/completions",
               {**chat_body(model, seeds, text, tokens), "return_token_ids": True})
    return dict(token_ids=out["choices"][0]["token_ids"], prompt_tokens=out["usage"]["prompt_tokens"],
                text=out["choices"][0]["message"]["content"])


def agreement(a: list[int], b: list[int]) -> int:
    """Tokens before the first divergence."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run_scheme(vlm: Path, name: str, tokens: int) -> dict:
    server = measurement_server(vlm, name, chunk=256, max_model_len=2048).launch()
    try:
        server.wait_ready()
        model = server.model_name
        answers = [answer(server.port, model, seeds, text or long_text(), tokens)
                   for _, seeds, text in CASES]
        stats = get_json(server.port, STATS_ROUTE)
        bits = stats["effective_bits"]
        return dict(kv_cache_dtype=name, page_bits=bits["pages"], overall_bits=bits["overall"],
                    visual=stats.get("visual"), attention_impls=server.attention_impls(),
                    answers=answers)
    finally:
        server.stop()


def plot(rows: list[dict], tokens: int, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    names = [r["kv_cache_dtype"] for r in rows]
    ax.bar(names, [r["agreement_mean"] for r in rows], color="tab:blue")
    for i, r in enumerate(rows):
        label = "16 bits" if r["page_bits"] is None else f"{r['page_bits']:.2f} bits"
        ax.text(i, r["agreement_mean"] + 0.3, label, ha="center", fontsize=8)
    ax.set_ylim(0, tokens + 3)
    ax.set_ylabel(f"greedy tokens equal to bf16's (of {tokens})")
    ax.set_title("Image requests on the test VLM (untrained vision tower: the path, not visual quality)",
                 fontsize=9)
    save(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-cache-dtype", default="bfloat16,vidkv,vidkv_stp,vidkv_visual,kivi2",
                   help="comma-separated; the first is the reference (bfloat16)")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per answer")
    p.add_argument("--json", default=str(RESULTS / "multimodal.json"))
    p.add_argument("--png", default=str(RESULTS / "multimodal.png"))
    args = p.parse_args(argv)
    names = args.kv_cache_dtype.split(",")
    if names[0] != "bfloat16":
        p.error("--kv-cache-dtype: the first entry must be bfloat16 (the reference)")
    from vllm_lowbit_kv.model import prepare_vlm

    vlm = prepare_vlm()
    t0 = time.time()
    rows = [run_scheme(vlm, name, args.tokens) for name in names]
    ref = rows[0]["answers"]
    for row in rows:
        row["agreement"] = [agreement(a["token_ids"], b["token_ids"]) for a, b in zip(row["answers"], ref)]
        row["agreement_mean"] = sum(row["agreement"]) / len(row["agreement"])
        row["answers_equal_to_bf16"] = sum(a == args.tokens for a in row["agreement"])
        if row["kv_cache_dtype"] == "bfloat16":
            row["page_bits"] = row["overall_bits"] = None  # vLLM's own cache: 16 bits
        print(f"{row['kv_cache_dtype']:>10}: agreement {row['agreement']} "
              f"(equal {row['answers_equal_to_bf16']}/{len(CASES)}), pages {row['page_bits']} bits, "
              f"visual {row['visual']}", file=sys.stderr)
    result = dict(
        command="python -m bench.multimodal " + shlex.join(sys.argv[1:] if argv is None else argv),
        machine=machine.describe(), model=vlm.name,
        caveat="the test VLM's vision tower is untrained (seeded random): answers about images "
               "are meaningless; agreement measures how far the KV format moves greedy text on "
               "prompts full of image tokens, not visual quality",
        cases=[dict(name=n, images=len(s), prompt_tokens=rows[0]["answers"][i]["prompt_tokens"])
               for i, (n, s, _) in enumerate(CASES)],
        tokens=args.tokens, rows=rows, elapsed_s=round(time.time() - t0, 1))
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, args.tokens, Path(args.png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
