"""The GPU serving path without a GPU: on vLLM's CUDA platform our dtypes select our
backend, and a configuration the GPU kernels cannot read is refused at start-up.

vllm.platforms.cuda does not import on the CPU build (its custom ops are CUDA-only), so
these tests give the hooks that ``register()`` installs on the current platform class
(one function, parametrized by the class) a platform class with vLLM's CUDA enum. What
the GPU kernels can read comes from their own ``supports`` (ops/); only what needs a GPU
to answer (a device is present, the CUDA extension builds) is faked.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

vllm = pytest.importorskip("vllm")

from vllm_lowbit_kv.ops import cuda as cuda_ops  # noqa: E402
from vllm_lowbit_kv.ops import select_implementation  # noqa: E402
from vllm_lowbit_kv.schemes import get_scheme  # noqa: E402
from vllm_lowbit_kv.vllm import BACKEND_PATH  # noqa: E402
from vllm_lowbit_kv.vllm.patches import install_platform_hooks  # noqa: E402
from vllm_lowbit_kv.vllm.plugin import register  # noqa: E402
from vllm_lowbit_kv.vllm.resolve import page_layout  # noqa: E402

# SmolLM2-135M: 30 layers, 9 query heads, 3 KV heads, head_dim 64
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64
STOCK = "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA platform class with our hooks; the GPU kernels' runtime is there."""
    from vllm.platforms.interface import Platform, PlatformEnum

    register()

    class CudaLikePlatform(Platform):
        _enum = PlatformEnum.CUDA
        device_name = device_type = "cuda"
        checked: list[str] = []

        @classmethod
        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            return STOCK

        @classmethod
        def check_and_update_config(cls, vllm_config):
            cls.checked.append(vllm_config.cache_config.cache_dtype)

    install_platform_hooks(CudaLikePlatform)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_ops, "load_extension", lambda *args, **kwargs: None)
    return CudaLikePlatform


def _config(dtype, lowbit=None, heads=HEADS, platform_device="cuda"):
    """What the start-up check reads of a VllmConfig for SmolLM2 on ``platform_device``."""
    model = SimpleNamespace(
        is_hybrid=False, is_attention_free=False, is_encoder_decoder=False, use_mla=False,
        is_multimodal_model=False, architecture="LlamaForCausalLM",
        model="smollm2", dtype=torch.bfloat16, get_total_num_hidden_layers=lambda: LAYERS,
        get_head_size=lambda: HEAD_DIM, get_num_kv_heads=lambda pc: KV_HEADS,
        get_total_num_kv_heads=lambda: KV_HEADS, get_num_attention_heads=lambda pc: heads)
    return SimpleNamespace(
        model_config=model, parallel_config=None, speculative_config=None,
        # retrieval heads are refused off the CPU (tested apart): the GPU kernels alone here
        additional_config={"lowbit_kv": {"retrieval_heads": 0, **(lowbit or {})}},
        device_config=SimpleNamespace(device_type=platform_device),
        cache_config=SimpleNamespace(cache_dtype=dtype, kv_cache_dtype_skip_layers=[],
                                     block_size=None, user_specified_block_size=False))


@pytest.mark.parametrize("impl", ["cuda", "triton", "auto"])
def test_cuda_platform_serves_vidkv_with_the_gpu_kernels(gpu, impl):
    from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
    from vllm.v1.attention.selector import AttentionSelectorConfig

    cfg = _config("vidkv", {"attention_impl": impl})
    gpu.check_and_update_config(cfg)  # vLLM's own check ran first, then ours passed
    assert gpu.checked[-1] == "vidkv" and cfg.cache_config.block_size == get_scheme("vidkv").page_size
    sel = dict(head_size=HEAD_DIM, dtype=torch.bfloat16, block_size=None)
    engine = VllmConfig(cache_config=CacheConfig(cache_dtype="vidkv", block_size=1024),
                        additional_config={"lowbit_kv": {"attention_impl": impl}})
    with set_current_vllm_config(engine):
        assert gpu.get_attn_backend_cls(None, AttentionSelectorConfig(kv_cache_dtype="vidkv", **sel)) \
            == BACKEND_PATH
        assert gpu.get_attn_backend_cls(None, AttentionSelectorConfig(kv_cache_dtype="auto", **sel)) \
            == STOCK
        with pytest.raises(ValueError, match="vidkv cannot serve this model: MLA not supported"):
            gpu.get_attn_backend_cls(None, AttentionSelectorConfig(kv_cache_dtype="vidkv",
                                                                   use_mla=True, **sel))
    # what each layer then runs: cuda first, then triton (auto takes the first)
    layout = page_layout(get_scheme("vidkv"), HEAD_DIM, KV_HEADS, get_scheme("vidkv").block_tokens,
                          torch.bfloat16)
    name, _ = select_implementation(layout, "cuda", impl, gqa=HEADS // KV_HEADS)
    assert name == ("cuda" if impl == "auto" else impl)


@pytest.mark.parametrize("dtype,lowbit,heads,reason", [
    ("quantile1", {"attention_impl": "cuda"}, HEADS,
     r"attention_impl 'cuda' cannot run here: it reads KIVI per-channel / VidKV keys .*"
     r"not: keys QuantileCodec"),
    ("quantile1", {"attention_impl": "triton"}, HEADS, r"attention_impl 'triton' cannot run here"),
    ("vidkv", {"attention_impl": "cuda"}, 32 * KV_HEADS,
     r"attention_impl 'cuda' cannot run here: 32 query heads per KV head \(the kernel takes at "
     r"most 16\)"),
    ("vidkv", {"attention_impl": "cpp"}, HEADS,
     r"attention_impl 'cpp' cannot run here: the C\+\+ kernel runs on the CPU, not cuda"),
    ("vidkv", {"skip_layers": [0]}, HEADS, r"skip_layers \[0\] off the CPU"),
    ("vidkv", {"retrieval_heads": 6}, HEADS, r"retrieval_heads 6 off the CPU: .*set "
     r"retrieval_heads 0"),
])
def test_cuda_platform_refuses_what_the_gpu_kernels_cannot_read(gpu, dtype, lowbit, heads, reason):
    with pytest.raises(ValueError, match=f"--kv-cache-dtype {dtype} cannot serve smollm2: "
                                         f".*{reason}.*Refusing to start"):
        gpu.check_and_update_config(_config(dtype, lowbit, heads))


def test_auto_falls_back_in_order_on_a_gpu(gpu, monkeypatch):
    """auto on a GPU: cuda, then triton, then the PyTorch reference, which reads every
    scheme (a scheme no GPU kernel reads is served correctly, only slower)."""
    gpu.check_and_update_config(_config("quantile1"))
    quantile = page_layout(get_scheme("quantile1"), HEAD_DIM, KV_HEADS, 64, torch.bfloat16)
    assert select_implementation(quantile, "cuda", "auto", gqa=3)[0] == "torch"
    vidkv = page_layout(get_scheme("vidkv"), HEAD_DIM, KV_HEADS, get_scheme("vidkv").block_tokens,
                          torch.bfloat16)

    def no_nvcc(*args, **kwargs):
        raise RuntimeError("nvcc not found")

    monkeypatch.setattr(cuda_ops, "load_extension", no_nvcc)
    assert select_implementation(vidkv, "cuda", "auto", gqa=3)[0] == "triton"


def test_other_platforms_refuse_lowbit_dtypes(gpu):
    """No backend of ours off the CPU and CUDA platforms (ROCm, XPU, TPU, ...): refuse at
    start-up, never fall through to a stock backend."""
    from vllm.platforms.interface import PlatformEnum

    class RocmLikePlatform(gpu):
        _enum = PlatformEnum.ROCM

    with pytest.raises(ValueError, match="vidkv cannot serve on vLLM's RocmLikePlatform: the "
                                         "lowbit-kv backend runs on vLLM's CPU and CUDA platforms"):
        RocmLikePlatform.check_and_update_config(_config("vidkv"))
    RocmLikePlatform.check_and_update_config(_config("fp8"))
    assert gpu.checked[-2:] == ["vidkv", "fp8"]
