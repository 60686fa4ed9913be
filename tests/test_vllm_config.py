"""The lowbit_kv configuration: pydantic validation, the launcher's --lowbit-config,
the start-up checks against a model, and the KV capacity vLLM's allocator gives our
pages. No server: everything here runs in-process in a few seconds."""

from __future__ import annotations

import inspect
import json
from types import SimpleNamespace

import pytest
import torch

from vllm_lowbit_kv.config import LowBitKVConfig, LowBitKVConfigError
from vllm_lowbit_kv.schemes import SCHEMES, get_scheme

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


def test_fields_cover_every_codec_parameter():
    params = set()
    for s in SCHEMES.values():
        for spec in (s.key, s.value):
            params |= {p for p in inspect.signature(spec.cls.__init__).parameters
                       if spec.accepts(p)}
    cache = {"block_tokens", "sink_tokens", "residual_tokens", "leading_tokens", "page_tokens",
             "rotate", "rotate_seed",
             "protect_first", "retrieval_heads", "retrieval_scheme", "retrieval_keys_only",
             "staging_dtype", "skip_layers", "obs_window"}
    kernels = {"attention_impl", "reference_arithmetic"}
    eviction = {"eviction", "retention", "eviction_gamma", "eviction_sinks", "recent_window",
                "eviction_layer_cap"}
    assert set(LowBitKVConfig.model_fields) == params | cache | eviction | kernels


@pytest.mark.parametrize("raw,scheme,match", [
    ({"bits": 3}, "kivi2", r"bits must be one of \(2, 4, 8\), got 3"),
    ({"gamma": 0.5}, "kivi2", r"kivi2 parameter name must be one of \['axis', 'bits', .*got 'gamma'"),
    ({"k": 1.5}, "vidkv", r"k must be a number in \[0, 1\], got 1.5"),
    ({"protect": 1.0}, "vidkv_stp", r"protect must be a number in \[0, 1\)"),
    ({"zz": 1}, "vidkv", r"unknown field 'zz'; known fields: \['alpha', 'attention_impl', 'axis'"),
    ({"one_bit": "x"}, "vidkv", r"field 'one_bit': Input should be 'mean', 'sign' or 'minmax'"),
    ({"staging_dtype": "fp8"}, "vidkv", r"field 'staging_dtype': Input should be 'model' or 'int8'"),
    ({"bits": True}, "kivi2", r"field 'bits': Input should be a valid integer, got True"),
    ({"sink_tokens": -1}, "vidkv", r"field 'sink_tokens': Input should be greater than or equal to 0"),
    ({"residual_tokens": 100}, "vidkv",
     r"residual_tokens must be a multiple of block_tokens \(128\) in \[0, 1024\] \(0: no window\), got 100"),
    ({"residual_tokens": 2048}, "kivi2", r"field 'residual_tokens': Input should be less than or equal to 1024"),
    ({"residual_tokens": -64}, "kivi2", r"field 'residual_tokens': Input should be greater than or equal to 0"),
    ({"block_tokens": 96}, "kivi2", r"residual_tokens must be a multiple of block_tokens \(96\)"),
    ({"leading_tokens": 100}, "vidkv",
     r"leading_tokens must be a multiple of block_tokens \(128\) in \[0, 1024\] \(0: no window\), got 100"),
    ({"leading_tokens": 2048}, "kivi2", r"field 'leading_tokens': Input should be less than or equal to 1024"),
    ({"leading_tokens": -64}, "kivi2", r"field 'leading_tokens': Input should be greater than or equal to 0"),
    ({"rotate": "dct"}, "kivi2", r"field 'rotate': Input should be 'none' or 'hadamard'"),
    ({"page_tokens": 100}, "vidkv", r"page_tokens must be a multiple of block_tokens \(128\) in \[128, 8192\], got 100"),
    ({"page_tokens": 16384}, "vidkv", r"field 'page_tokens': Input should be less than or equal to 8192"),
    ({"rotate_seed": "x"}, "kivi2", r"field 'rotate_seed': Input should be a valid integer"),
    ({"protect_first": "audio"}, "vidkv_stp", r"field 'protect_first': Input should be 'visual' or 'text'"),
    ({"protect_first": "text"}, "kivi2",
     r"protect_first must be 'visual' unless the scheme protects tokens \(protect > 0\), got 'text'"),
    ({"reference_arithmetic": "yes"}, "vidkv",
     r"field 'reference_arithmetic': Input should be a valid boolean, got 'yes'"),
    ({"skip_layers": [-2]}, "vidkv", r"field 'skip_layers': layer indices must be >= 0"),
    ({"block_tokens": 0}, "vidkv", r"field 'block_tokens': Input should be greater than or equal to 1"),
    ({"ema": 0.9}, "dynamic4", r"ema must be 0 for --kv-cache-dtype dynamic4 in the vLLM backend"),
    ([1, 2], "vidkv", r"must be a JSON object"),
])
def test_bad_values_name_the_field_and_allowed_values(raw, scheme, match):
    with pytest.raises(LowBitKVConfigError, match=match):
        LowBitKVConfig.parse(raw).scheme(scheme)


def test_overrides_reach_the_codecs():
    cfg = LowBitKVConfig.parse({"protect": 0.25, "gamma": 0.6, "k": 0.75, "sink_tokens": 4,
                                "block_tokens": 32, "skip_layers": [3, 0, 3], "obs_window": 16})
    s = cfg.scheme("vidkv_stp")
    kc, vc = s.codecs(HEAD_DIM)
    assert (kc.k, vc.gamma, vc.protect, kc.protect) == (0.75, 0.6, 0.25, 0.0)
    assert (s.block_tokens, s.sink_tokens, cfg.skip_layers, cfg.obs_window) == (32, 4, [0, 3], 16)
    assert LowBitKVConfig.parse(None).scheme("vidkv") == get_scheme("vidkv")
    # the visual-only mode on any STP scheme, and back to VidKV's rule on vidkv_visual
    assert LowBitKVConfig.parse({"protect_first": "text"}).scheme("vidkv_stp").protect_first == "text"
    assert LowBitKVConfig.parse({"protect_first": "visual"}).scheme("vidkv_visual").protect_first \
        == "visual"
    # stateful codecs run stateless in vLLM, and the scheme says so
    assert LowBitKVConfig.parse({}).scheme("dynamic2").value.params["ema"] == 0.0


def test_model_checks_give_reasons():
    cfg = LowBitKVConfig.parse({"sink_tokens": 65, "obs_window": 80, "skip_layers": [30]})
    reasons = " | ".join(cfg.check_model(cfg.scheme("vidkv_stp"), head_dim=HEAD_DIM,
                                         num_layers=LAYERS, block_size=96))
    for part in ("--block-size 96 is not a multiple of the scheme's block_tokens (64)",
                 "sink_tokens must be at most block_tokens (64)",
                 "obs_window must be at most block_tokens (64)",
                 "skip_layers must be layer indices in [0, 30), got [30]"):
        assert part in reasons
    every = LowBitKVConfig.parse({"skip_layers": list(range(LAYERS))})
    assert "lists every layer" in " ".join(every.check_model(get_scheme("kivi2"), head_dim=64,
                                                             num_layers=LAYERS))
    assert "head_dim 2048" in " ".join(LowBitKVConfig().check_model(
        get_scheme("vidkv"), head_dim=2048, num_layers=LAYERS))
    assert LowBitKVConfig().check_model(get_scheme("vidkv"), head_dim=64, num_layers=LAYERS,
                                        block_size=128) == []


def test_summary_states_effective_bits():
    cfg = LowBitKVConfig.parse({"sink_tokens": 4, "skip_layers": [0]})
    line = cfg.summary("vidkv", cfg.scheme("vidkv"), head_dim=64, num_kv_heads=3, num_layers=30,
                       block_size=128)
    eff = get_scheme("vidkv").effective_bits(64, model_kv_heads=29 * 3)  # layer 0 in bf16
    assert f"groups {eff:.3f}" in line and "with sink area" in line and "over all 30 layers" in line


# ------------------------------------------------------------------------- launcher

def test_launcher_turns_lowbit_config_into_additional_config(tmp_path):
    from serving.__main__ import build_argv

    f = tmp_path / "lb.json"
    f.write_text(json.dumps({"protect": 0.25, "sink_tokens": 4}))
    argv = build_argv(["--model", "m", "--kv-cache-dtype", "vidkv_stp", "--lowbit-config", str(f),
                       "--additional-config", '{"other": 1, "lowbit_kv": {"sink_tokens": 8}}'])
    i = argv.index("--additional-config")
    assert "--lowbit-config" not in argv and argv.count("--additional-config") == 1
    assert json.loads(argv[i + 1]) == {"other": 1, "lowbit_kv": {"protect": 0.25, "sink_tokens": 8}}
    # {"lowbit_kv": {...}} in the file works too
    f.write_text(json.dumps({"lowbit_kv": {"k": 0.75}}))
    argv = build_argv(["m", f"--lowbit-config={f}"])
    assert argv[:2] == ["--model", "m"]
    assert json.loads(argv[argv.index("--additional-config") + 1]) == {"lowbit_kv": {"k": 0.75}}


def test_launcher_refuses_bad_config_before_vllm_starts(tmp_path):
    from serving.__main__ import build_argv

    f = tmp_path / "lb.json"
    f.write_text(json.dumps({"sinks": 4}))
    with pytest.raises(SystemExit, match="unknown field 'sinks'"):
        build_argv(["--model", "m", "--lowbit-config", str(f)])
    with pytest.raises(SystemExit, match="no such file"):
        build_argv(["--model", "m", "--lowbit-config", str(tmp_path / "missing.json")])


# ------------------------------------------------------------------- against vLLM

vllm = pytest.importorskip("vllm")

from _vllm_config import vllm_config  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _plugin_registered():
    """Our dtypes and hooks in vLLM's tables, as the engine's plugin loading does."""
    from vllm_lowbit_kv.vllm.plugin import register
    register()


def test_vllm_config_validates_and_maps_skip_layers(model_dir):
    cfg = vllm_config(model_dir, "vidkv_stp", {"skip_layers": [0, 29], "sink_tokens": 4})
    assert cfg.cache_config.kv_cache_dtype_skip_layers == ["0", "29"]
    with pytest.raises(ValueError, match=r"vidkv: lowbit_kv config: unknown field 'gama'"):
        vllm_config(model_dir, "vidkv", {"gama": 0.5})
    with pytest.raises(ValueError, match=r"cannot serve .*skip_layers must be layer indices in \[0, 30\)"):
        vllm_config(model_dir, "vidkv", {"skip_layers": [30]})
    # stock dtypes are untouched; a stray lowbit_kv entry is ignored
    assert vllm_config(model_dir, "auto", {"skip_layers": [1]}).cache_config \
        .kv_cache_dtype_skip_layers == []


def test_float32_model_over_a_16bit_cache_is_refused_on_the_cpu(model_dir):
    """vLLM's CPU attention answers garbage for a float32 model over a 16-bit cache (stock
    vLLM too): refused with the way out; what it answers right is served."""
    for cache in ("bfloat16", "float16"):
        with pytest.raises(ValueError, match=rf"--kv-cache-dtype {cache} with a float32 model: vLLM's "
                                             rf"CPU attention answers garbage .* or --dtype {cache}"):
            vllm_config(model_dir, cache, model_dtype="float32")
        vllm_config(model_dir, cache)
    vllm_config(model_dir, "auto", model_dtype="float32")


def test_bf16_model_without_bf16_hardware_is_noted_once(model_dir, monkeypatch):
    """A bfloat16 model on an x86 CPU without AVX-512 BF16 (torch's reference bf16 matrix
    multiplies): one line names --dtype float32, once per server (the engine core inherits
    the marker), whatever the KV dtype; none for a float32 model or with the hardware."""
    import torch
    from vllm.platforms import CpuArchEnum, current_platform

    from vllm_lowbit_kv.vllm import BF16_NOTED_ENV, checks

    if not current_platform.is_cpu() or current_platform.get_cpu_architecture() != CpuArchEnum.X86:
        pytest.skip("the note is for x86 CPUs")
    notes = []
    monkeypatch.setattr(checks.logger, "info", lambda msg, *a: notes.append(msg % a))
    monkeypatch.delenv(BF16_NOTED_ENV, raising=False)

    def noted(hardware: bool, cache: str, model_dtype: str = "auto") -> list[str]:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: hardware)
        notes.clear()
        vllm_config(model_dir, cache, model_dtype=model_dtype)
        return [n for n in notes if "AVX-512 BF16" in n]

    assert noted(True, "bfloat16") == []
    assert noted(False, "auto", model_dtype="float32") == []
    first = noted(False, "bfloat16")
    assert len(first) == 1 and "--dtype float32" in first[0] and "--kv-cache-dtype auto" in first[0]
    assert noted(False, "vidkv") == []  # the same server's second check (the engine core)
    monkeypatch.delenv(BF16_NOTED_ENV)
    assert noted(False, "vidkv") == first  # a new server


def test_forced_attention_impl_is_checked_at_startup(model_dir, monkeypatch):
    """attention_impl (or LOWBIT_KV_ATTENTION_IMPL) naming an implementation that cannot run
    the scheme on this device stops the server with the reason; auto never does."""
    vllm_config(model_dir, "vidkv", {"attention_impl": "cpp"})
    vllm_config(model_dir, "quantile1", {"attention_impl": "auto"})
    with pytest.raises(ValueError, match=r"attention_impl 'cpp' cannot run here: it reads KIVI "
                                         r"per-channel / VidKV / RVQ keys .* not: keys QuantileCodec"):
        vllm_config(model_dir, "quantile1", {"attention_impl": "cpp"})
    with pytest.raises(ValueError, match=r"attention_impl 'cuda' cannot run here: the CUDA kernel "
                                         r"runs on CUDA devices, not cpu"):
        vllm_config(model_dir, "vidkv", {"attention_impl": "cuda"})
    with pytest.raises(ValueError, match=r"field 'attention_impl': Input should be 'auto', "):
        vllm_config(model_dir, "vidkv", {"attention_impl": "gpu"})
    monkeypatch.setenv("LOWBIT_KV_ATTENTION_IMPL", "triton")
    with pytest.raises(ValueError, match=r"attention_impl 'triton' cannot run here"):
        vllm_config(model_dir, "kivi2")
    monkeypatch.setenv("LOWBIT_KV_ATTENTION_IMPL", "fast")
    with pytest.raises(ValueError, match=r"LOWBIT_KV_ATTENTION_IMPL must be one of"):
        vllm_config(model_dir, "kivi2")


def _fake_vllm_config(user_block_size: bool = True, **model_kw):
    model = dict(is_hybrid=False, is_attention_free=False, is_encoder_decoder=False, use_mla=False,
                 is_multimodal_model=False, architecture="LlamaForCausalLM", model="fake", dtype=torch.bfloat16, get_total_num_hidden_layers=lambda: LAYERS,
                 get_head_size=lambda: HEAD_DIM, get_num_kv_heads=lambda pc: KV_HEADS,
                 get_total_num_kv_heads=lambda: KV_HEADS)
    model.update(model_kw)
    return SimpleNamespace(
        model_config=SimpleNamespace(**model), parallel_config=None, speculative_config=None,
        additional_config={"lowbit_kv": {"retrieval_heads": 0}},  # a fake model: nothing to measure
        cache_config=SimpleNamespace(cache_dtype="vidkv", kv_cache_dtype_skip_layers=[],
                                     block_size=128, user_specified_block_size=user_block_size))


@pytest.mark.parametrize("user_block_size,expected", [(True, 128), (False, 2048)])
def test_block_size_is_the_schemes_page_unless_the_user_sets_one(model_dir, user_block_size, expected):
    """vidkv's pages hold 2048 tokens (one sink area per 2048 tokens) unless --block-size
    says otherwise (vLLM's CPU platform would pick 128)."""
    from vllm.platforms.cpu import CpuPlatform

    from vllm_lowbit_kv.vllm.checks import check_vllm_config

    cfg = _fake_vllm_config(user_block_size)
    check_vllm_config(cfg, CpuPlatform)
    assert get_scheme("vidkv").page_size == 2048
    assert cfg.cache_config.block_size == expected


@pytest.mark.parametrize("model_kw,reason", [
    ({"use_mla": True}, "MLA attention"),
    ({"is_hybrid": True}, "hybrid / attention-free"),
    ({"is_encoder_decoder": True}, "encoder-decoder"),
    ({"get_head_size": lambda: 2048}, "head_dim 2048"),
    ({"get_total_num_hidden_layers": lambda: 1}, None),
    ({"is_multimodal_model": True, "architecture": "LlavaForConditionalGeneration"},
     "multimodal architecture LlavaForConditionalGeneration: only "
     "Idefics3ForConditionalGeneration is tested"),
    ({"is_multimodal_model": True, "architecture": "Idefics3ForConditionalGeneration"}, None),
])
def test_unservable_models_are_refused_with_the_reason(model_dir, model_kw, reason):
    from vllm.platforms.cpu import CpuPlatform

    from vllm_lowbit_kv.vllm.checks import check_vllm_config

    cfg = _fake_vllm_config(**model_kw)
    if reason is None:
        check_vllm_config(cfg, CpuPlatform)  # servable (a 1-layer llama-like model, the tested VLM)
        return
    with pytest.raises(ValueError, match=f"vidkv cannot serve fake: .*{reason}.*Refusing to start"):
        check_vllm_config(cfg, CpuPlatform)


def _layer_specs(cfg) -> dict:
    """Every attention layer's KV cache spec as the engine builds it for ``cfg`` (bf16
    layers for ``auto`` and skip_layers; our page specs, with the layer index our
    get_kv_cache_spec patch attaches, for the others)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_lowbit_kv.vllm.backend import LowBitKVBackend
    from vllm_lowbit_kv.vllm.resolve import SPEC_LAYER_ATTR

    cfg.cache_config.kv_cache_layout = "LBHNC"  # what the engine core resolves for us
    skip = set(cfg.cache_config.kv_cache_dtype_skip_layers)
    specs = {}
    for i in range(LAYERS):
        bf16 = cfg.cache_config.cache_dtype == "auto" or str(i) in skip
        s = FullAttentionSpec(block_size=cfg.cache_config.block_size, num_kv_heads=KV_HEADS,
                              head_size=HEAD_DIM, dtype=torch.bfloat16 if bf16 else torch.uint8)
        object.__setattr__(s, SPEC_LAYER_ATTR, i)
        specs[f"model.layers.{i}.self_attn.attn"] = s if bf16 else LowBitKVBackend.customize_spec(s)
    return specs


def test_budget_that_staging_leaves_too_small_is_refused_with_the_sizes(model_dir):
    """The KV budget pays staging for --max-num-seqs sequences first; when the pages left
    cannot hold one --max-model-len request (and the pool's null block), start-up stops
    with both sizes and how many sequences would fit, not with vLLM's "0.0 GiB
    available"."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.core.kv_cache_utils import max_memory_usage_bytes

    from vllm_lowbit_kv.vllm.patches import _budget_less_staging
    from vllm_lowbit_kv.vllm.resolve import staging_bytes

    cfg = vllm_config(model_dir, "vidkv")
    cfg.scheduler_config.max_num_seqs = 32
    with set_current_vllm_config(cfg):
        specs = _layer_specs(cfg)
        staged = staging_bytes(cfg)
        needed = max_memory_usage_bytes(cfg, specs.values()) + sum(s.page_size_bytes
                                                                   for s in specs.values())
        per_seq = staged // 32
        assert staged == 32 * per_seq > needed > 0

        def available(budget):
            worker = SimpleNamespace(vllm_config=cfg, get_kv_cache_spec=lambda: specs)
            return _budget_less_staging(lambda self: budget)(worker)

        assert available(staged + needed) == needed
        # one byte short: one sequence's staging less would fit
        with pytest.raises(ValueError, match=r"for --max-num-seqs 32 sequences takes "
                                             r".* --max-model-len 2048 needs .*at most 31 fit"):
            available(staged + needed - 1)
        with pytest.raises(ValueError, match=r"at most 0 fit"):
            available(needed - 1)


@pytest.mark.parametrize("lowbit", [None, {"skip_layers": [0, 29], "sink_tokens": 4}])
def test_allocator_capacity_scales_with_bits(model_dir, lowbit, rvq_codebook_file):
    """vLLM's own allocator (get_kv_cache_configs) on our specs: 1 GiB holds
    >= 0.9 x (16 / bits) x the bf16 token count, for every scheme (RVQ ones with
    a codebook file made for the model)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    def tokens(dtype, lb):
        cfg = vllm_config(model_dir, dtype, lb)
        with set_current_vllm_config(cfg):
            kc = get_kv_cache_configs(cfg, [_layer_specs(cfg)], [2**30])[0]
        return kc.num_blocks * cfg.cache_config.block_size

    bf16 = tokens("auto", None)
    assert bf16 == 2**30 // (LAYERS * KV_HEADS * HEAD_DIM * 2 * 2) // 128 * 128
    n_skip = len((lowbit or {}).get("skip_layers", []))
    for name in SCHEMES:
        lb = dict(lowbit or {})
        if SCHEMES[name].key.accepts("codebook"):
            lb["codebook"] = str(rvq_codebook_file(name))
        got = tokens(name, lb or None)
        cfg = LowBitKVConfig.parse(lb)
        scheme = cfg.scheme(name)
        # every page byte over all layers (skip_layers in bf16, retrieval heads included)
        bits = cfg.bits_per_element(scheme, head_dim=HEAD_DIM, num_kv_heads=KV_HEADS,
                                    num_layers=LAYERS, block_size=128)["overall"]
        assert got >= 0.9 * (16 / bits) * bf16, (name, got, bf16, bits)
        if lowbit is None:
            assert got >= 0.9 * (16 / scheme.effective_bits(
                HEAD_DIM, model_kv_heads=LAYERS * KV_HEADS)) * bf16, name


@pytest.mark.parametrize("head_dim,error", [(128, None), (96, r"divisor of head_dim=96, got 64")])
def test_overrides_are_checked_against_the_served_models_head_size(model_dir, head_dim, error):
    """A ``group_size`` of 64 KIVI value channels suits head_dim 128 and is refused, naming
    the model's head size, for head_dim 96 (scheme overrides were once checked at 64)."""
    from vllm.platforms.cpu import CpuPlatform

    from vllm_lowbit_kv.vllm.checks import check_vllm_config
    from vllm_lowbit_kv.vllm.resolve import resolve_scheme

    cfg = _fake_vllm_config(get_head_size=lambda: head_dim)
    cfg.cache_config.cache_dtype = "kivi2"
    cfg.additional_config["lowbit_kv"]["group_size"] = 64 if error else 128
    if error:
        with pytest.raises(ValueError, match=error):
            check_vllm_config(cfg, CpuPlatform)
        return
    check_vllm_config(cfg, CpuPlatform)
    _, values = resolve_scheme(cfg).codecs(head_dim)
    assert values.group_size == 128
