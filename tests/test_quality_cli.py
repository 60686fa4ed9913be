"""bench.quality end to end on a tiny random Llama with a byte-level tokenizer."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from bench import quality


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    model_dir = root / "tiny-llama"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=257, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=3, head_dim=64,
                      max_position_embeddings=1024, eos_token_id=256, bos_token_id=256)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(model_dir)
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = 256
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>").save_pretrained(model_dir)
    rng = random.Random(0)
    words = "the a council said on monday that police fire storm river new city people".split()
    text = " ".join(" ".join(rng.choice(words) for _ in range(12)).capitalize() + "." for _ in range(150))
    (root / "text.txt").write_text(text)
    return model_dir, root / "text.txt", root


@pytest.mark.slow  # the yardstick end to end, three schemes: minutes on 2 cores
def test_cli_writes_table_json_and_png(tiny, capsys):
    model_dir, text, root = tiny
    argv = ["--model", str(model_dir), "--text-file", str(text), "--kv-cache-dtype", "kivi2,kivi4",
            "--json", str(root / "q.json"), "--png", str(root / "q.png"), "--max-tokens", "300",
            "--chunk", "64", "--passkey-lengths", "256,512", "--passkey-trials", "1",
            "--agreement-prompts", "4", "--agreement-prompt-tokens", "100", "--agreement-tokens", "6",
            "--sink-tokens", "4", "--chat-prompts", "2", "--no-progress"]
    quality.main(argv)
    out = capsys.readouterr().out
    assert "kivi2" in out and "PPL" in out
    res = json.loads((root / "q.json").read_text())
    for key in ("command", "model", "text", "settings", "rows"):
        assert key in res
    assert res["command"].startswith("python -m bench.quality ") and "--kv-cache-dtype kivi2,kivi4" in res["command"]
    assert res["settings"]["chunk"] == 64 and res["settings"]["sink_tokens"] == 4
    assert [r["scheme"] for r in res["rows"]] == ["bfloat16", "kivi2", "kivi4"]
    for r in res["rows"]:
        for key in ("scheme", "effective_bits", "ppl", "ppl_ratio_vs_bf16", "passkey_acc",
                    "passkey_by_length", "agreement", "chat_facts_kept"):
            assert key in r, key
        assert set(r["passkey_by_length"]) == {"256", "512"}
        assert len(r["passkey_details"]) == 2 * len(quality.DEPTHS)
        assert all(d["prompt_tokens"] <= d["length"] - quality.PASSKEY_GEN_TOKENS for d in r["passkey_details"])
        for d in r["passkey_details"]:  # the number read from the answer decides the hit
            assert d["correct"] == (d["number"] == str(d["passkey"]))
            assert d["number"] is None or d["number"] in d["answer"]
        assert r["passkey_no_number"] == sum(d["number"] is None for d in r["passkey_details"])
        assert 0 <= r["agreement"] <= 6 and r["ppl"] > 1
    ref, k2, k4 = res["rows"]
    assert ref["effective_bits"] == 16 and ref["ppl_ratio_vs_bf16"] == 1 and ref["agreement"] == 6
    assert k2["effective_bits"] < k4["effective_bits"] < 16
    assert k2["kv_bytes_per_token"] < k4["kv_bytes_per_token"] < ref["kv_bytes_per_token"]
    assert (root / "q.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # the yardstick end to end, every scheme x policy x retention
def test_cli_eviction_rows(tiny):
    """Every scheme x (policy, retention); retention 1 keeps every pair: the plain numbers
    (without a residual window: compaction rewrites the groups and drops the window in
    both engines, so with one, retention 1 reads the window's groups through the codec)."""
    model_dir, text, root = tiny
    argv = ["--model", str(model_dir), "--text-file", str(text), "--kv-cache-dtype", "kivi4",
            "--scheme-params", '{"kivi4": {"residual_tokens": 0}}',
            "--json", str(root / "e.json"), "--png", str(root / "e.png"), "--max-tokens", "300",
            "--chunk", "64", "--passkey-lengths", "256", "--agreement-prompts", "1",
            "--agreement-prompt-tokens", "100", "--agreement-tokens", "4", "--sink-tokens", "4",
            "--chat-prompts", "1", "--kv-eviction", "flashcache,recency", "--kv-retention", "0.3,1",
            "--no-progress"]
    res = quality.main(argv)
    assert res["settings"]["eviction"]["ppl_prompt_tokens"] == 128
    assert res["settings"]["eviction"]["ppl_scored_tokens"] == 299 - 128
    rows = res["rows"]
    assert [(r["scheme"], r["eviction"], r["retention"]) for r in rows] == [
        (s, p, r) for s in ("bfloat16", "kivi4")
        for p, r in [(None, None), ("flashcache", 0.3), ("flashcache", 1.0), ("recency", 0.3), ("recency", 1.0)]]
    for plain in (rows[0], rows[5]):
        assert plain["eviction_plan"] is None and plain["label"] == plain["scheme"]
        for full in [r for r in rows if r["scheme"] == plain["scheme"] and r["retention"] == 1.0]:
            assert full["ppl"] == pytest.approx(plain["ppl"], rel=1e-5)
            assert [d["answer"] for d in full["passkey_details"]] == [d["answer"] for d in plain["passkey_details"]]
    for r in rows:
        if r["retention"] == 0.3:
            plan = r["eviction_plan"]
            assert plan["tokens"] == 128 and plan["kept"] == round(0.3 * 128 * 2)
            assert r["kv_memory"]["stored_tokens"] < r["kv_memory"]["tokens"] * 2
    assert (root / "e.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match=r"retention must be a number in \(0, 1\]"):
        quality.main(argv[:-5] + ["--kv-eviction", "flashcache", "--kv-retention", "1.5"])
    with pytest.raises(SystemExit, match="eviction policy must be one of"):
        quality.main(argv[:-5] + ["--kv-eviction", "h2o", "--kv-retention", "0.5"])


class _OneServerPerPolicy(quality.HFEngine):
    """An engine that, like the vLLM one, runs one eviction setting per instance."""

    variants_share_prefill = False
    made: list = []

    def __init__(self, model_dir, kv_cache_dtype, *, eviction=None, **kw):
        super().__init__(model_dir, kv_cache_dtype, **kw)
        self.eviction = eviction
        self.made.append((kv_cache_dtype, eviction and (eviction.name, eviction.retention)))

    def logprobs_variants(self, ids, chunk, prompt_tokens, policies):
        assert list(policies) == [self.eviction]
        return super().logprobs_variants(ids, chunk, prompt_tokens, policies)

    def greedy_variants(self, ids, n, chunk, policies, references=None):
        assert list(policies) == [self.eviction]
        return super().greedy_variants(ids, n, chunk, policies, references)


@pytest.mark.slow  # the yardstick end to end, twice
def test_cli_eviction_one_engine_per_policy(tiny, monkeypatch):
    """Engines that cannot share a prefill across policies get one instance per policy;
    the rows are the shared-prefill engine's."""
    model_dir, text, root = tiny
    argv = ["--model", str(model_dir), "--text-file", str(text), "--kv-cache-dtype", "kivi4",
            "--max-tokens", "200", "--chunk", "64", "--passkey-lengths", "256",
            "--agreement-prompts", "1", "--agreement-prompt-tokens", "100", "--agreement-tokens", "4",
            "--chat-prompts", "1", "--kv-eviction", "recency", "--kv-retention", "0.5", "--no-progress"]
    shared = quality.main(argv)
    monkeypatch.setitem(quality.ENGINES, "split", _OneServerPerPolicy)
    split = quality.main(argv + ["--engine", "split"])
    assert _OneServerPerPolicy.made == [("bfloat16", None), ("bfloat16", ("recency", 0.5)),
                                        ("kivi4", None), ("kivi4", ("recency", 0.5))]
    for a, b in zip(shared["rows"], split["rows"], strict=True):
        assert (a["label"], a["ppl"], a["agreement"]) == (b["label"], b["ppl"], b["agreement"])
        assert [d["answer"] for d in a["passkey_details"]] == [d["answer"] for d in b["passkey_details"]]


def test_cli_refuses_bad_arguments(tiny):
    model_dir, text, _ = tiny
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        quality.main(["--model", str(model_dir), "--text-file", str(text), "--kv-cache-dtype", "nope"])
    with pytest.raises(SystemExit, match="positions"):
        quality.main(["--model", str(model_dir), "--text-file", str(text), "--kv-cache-dtype", "kivi2",
                      "--passkey-lengths", "4096", "--no-progress"])


def test_module_help_runs():
    r = subprocess.run([sys.executable, "-m", "bench.quality", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0
    for flag in ("--kv-cache-dtype", "--text-file", "--json", "--png", "--max-tokens", "--chunk",
                 "--passkey-lengths", "--engine", "--model", "--block-tokens", "--sink-tokens",
                 "--passkey-trials"):
        assert flag in r.stdout


@pytest.mark.slow  # the yardstick end to end
def test_scheme_params_reach_the_codecs_and_codebooks_are_recorded(tiny, tmp_path):
    """--scheme-params: an RVQ codebook file (random codes, made for the tiny model) and a
    codec override reach the scheme; the row records the file."""
    import hashlib

    from vllm_lowbit_kv.codecs.base import ModelIdentity
    from vllm_lowbit_kv.codecs.rvq import RVQCodebooks, RVQSettings

    model_dir, text, root = tiny
    g = torch.Generator().manual_seed(0)
    books = RVQCodebooks(torch.randn(2, 2, 16, 32, generator=g), torch.randn(2, 2, 16, 32, generator=g),
                         ModelIdentity("tiny-llama", 2, 3, 64), RVQSettings(2, 16, 32, "strided", "contiguous"))
    path = books.save(tmp_path / "tiny.safetensors")
    params = json.dumps({"rvq2x256": {"codebook": str(path), "codebook_size": 16}})
    base = ["--model", str(model_dir), "--text-file", str(text), "--max-tokens", "200", "--chunk", "64",
            "--passkey-lengths", "none", "--agreement-prompts", "0", "--chat-prompts", "0", "--no-progress"]
    res = quality.main([*base, "--kv-cache-dtype", "rvq2x256", "--scheme-params", params])
    row = res["rows"][1]
    assert row["effective_bits"] == (2 * 2 * 4 + 16) / 64  # 2 codebooks of 16 codes, 2 groups, fp16 std
    assert row["codebook"]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert row["codebook"]["codebook_bytes"] == books.nbytes
    assert res["settings"]["scheme_params"] == json.loads(params)
    with pytest.raises(SystemExit, match="names schemes not measured here"):
        quality.main([*base, "--kv-cache-dtype", "kivi2", "--scheme-params", params])
    with pytest.raises(SystemExit, match="--scheme-params must be a JSON object"):
        quality.main([*base, "--kv-cache-dtype", "kivi2", "--scheme-params", "[1]"])


def test_variant_modifiers_set_retrieval_heads_and_key_share():
    v = quality.parse_variant("vidkv@k0.375+H9+Hk")
    assert (v.label, v.scheme) == ("vidkv@k0.375+H9+Hk", "vidkv")
    assert v.mods == {"k": 0.375, "retrieval_heads": 9, "retrieval_keys_only": True}
    with pytest.raises(ValueError, match="modifier 'k-1'"):
        quality.parse_variant("vidkv@k-1")
    assert quality.parse_variant("rvq8x256@K6+S4").mods == {"num_codebooks": 6, "sink_tokens": 4}
    assert quality.parse_variant("vidkv@L0+R128").mods == {"leading_tokens": 0,
                                                           "residual_tokens": 128}
    assert quality.parse_variant("vidkv@g0.5+nofft").mods == {"gamma": 0.5, "fft": False}
    assert quality.parse_variant("vidkv@H3+Hkivi8").mods == {"retrieval_heads": 3, "retrieval_scheme": "kivi8"}


def test_codebook_count_modifier_calibrates_codebooks_of_that_count(tiny, tmp_path, monkeypatch):
    """K<N>: the row's default codebooks are calibrated with N codebooks (the scheme's
    file has another count, which the codecs would refuse)."""
    from vllm_lowbit_kv.calibrate import default_codebook
    from vllm_lowbit_kv.codecs.rvq import RVQCodebooks

    monkeypatch.setenv("VLLM_LOWBIT_KV_CACHE", str(tmp_path))
    model_dir, _, _ = tiny
    args = quality.resolve(quality.build_parser().parse_args(["--model", str(model_dir), "--no-progress"]))
    params, records = quality.scheme_params([quality.parse_variant("rvq8x256@K2")], args)
    books = RVQCodebooks.load(params["rvq8x256@K2"]["codebook"])
    assert books.settings.num_codebooks == 2 and params["rvq8x256@K2"]["num_codebooks"] == 2
    assert records["rvq8x256@K2"]["file"] == Path(default_codebook(model_dir, "rvq8x256", num_codebooks=2)).name
    assert "-k2c256" in records["rvq8x256@K2"]["file"]


def test_variants_are_checked_against_the_model_before_any_row(tiny):
    """The tiny model has 2 x 3 KV heads: 7 retrieval heads are refused before bf16 runs;
    a key share out of range and a codec parameter the scheme lacks are refused too."""
    model_dir, text, _ = tiny
    base = ["--model", str(model_dir), "--text-file", str(text), "--no-progress"]
    with pytest.raises(SystemExit, match=r"vidkv@H7 on tiny-llama: .*retrieval_heads 7"):
        quality.main([*base, "--variants", "vidkv@H7"])
    with pytest.raises(ValueError, match=r"k must be a number in \[0, 1\], got 1.5"):
        quality.main([*base, "--variants", "vidkv@k1.5"])
    with pytest.raises(ValueError, match="kivi2 parameter name"):
        quality.main([*base, "--variants", "kivi2@k0.5"])
    with pytest.raises(ValueError, match="vidkv parameter name"):
        quality.main([*base, "--variants", "vidkv@K6"])


def test_json_names_no_path_of_the_machine(tmp_path, monkeypatch):
    """A codebook of the cache is written as $VLLM_LOWBIT_KV_CACHE/..., not as this
    machine's path (results name no local path)."""
    monkeypatch.setenv("VLLM_LOWBIT_KV_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "q.json"
    quality._write_json({"codebook": str(tmp_path / "cache" / "codebooks" / "m" / "x.safetensors")}, out)
    assert json.loads(out.read_text()) == {"codebook": "$VLLM_LOWBIT_KV_CACHE/codebooks/m/x.safetensors"}


def test_chat_answers_are_checked_against_the_answer_key():
    from bench.factual_prompts import CHAT_KEYS, CHAT_QUESTIONS, answer_is_correct

    assert len(CHAT_KEYS) == len(CHAT_QUESTIONS) and all(CHAT_KEYS)
    leap = CHAT_QUESTIONS.index("How many days are there in a leap year?")
    assert answer_is_correct(leap, "There are 366 days in a leap year.")
    assert not answer_is_correct(leap, "There are 365 days in a leap year.")
    sqrt = CHAT_QUESTIONS.index("What is the square root of 81?")
    assert not answer_is_correct(sqrt, "The square root of 81 is 19.")  # whole numbers only
    gold = CHAT_QUESTIONS.index("What is the chemical symbol for gold?")
    assert answer_is_correct(gold, "au.") and not answer_is_correct(gold, "Aurum")
    # bf16 right on both, the scheme loses one fact and gets a question bf16 missed
    bf16 = ["Jupiter.", "Paris.", "Ag."]
    assert quality.chat_facts(["Saturn.", "Paris.", "Au."], bf16) == dict(
        chat_correct=2, chat_bf16_correct=2, chat_facts_kept=1)
    assert quality.chat_facts([], []) == dict(chat_correct=None, chat_bf16_correct=None,
                                              chat_facts_kept=None)
