import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Without a CUDA device the Triton kernels (vllm_lowbit_kv.ops.triton) run in Triton's interpreter.
# Triton decides when a kernel is defined (and, when triton is imported, for its own
# library functions) whether it is interpreted, and torch imports triton lazily while
# the test modules are collected: so TRITON_INTERPRET is set here, first, and dropped
# once collection is done, so that processes the tests start (servers) do not inherit it
# (tests/test_triton_ops.py sets it again around its own tests).
_SET_TRITON_INTERPRET = not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ
if _SET_TRITON_INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"

settings.register_profile("ci", max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
torch.set_num_threads(2)


def pytest_collection_finish(session):
    if _SET_TRITON_INTERPRET:
        os.environ.pop("TRITON_INTERPRET", None)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by mark
def pytest_collection_modifyitems(config, items):
    # a test of the session's shared server may start it (30 s and more): slow, marked or not,
    # so that -m "not slow" never starts a server
    for item in items:
        if "server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dir():
    """The embedded model's folder (prepared on first use)."""
    from vllm_lowbit_kv.model import prepare_model
    return str(prepare_model())


@pytest.fixture(scope="session")
def rvq_codebook_file(tmp_path_factory):
    """``(scheme name) -> path`` of an RVQ codebook file for the embedded SmolLM2
    (30 layers, 3 KV heads, head_dim 64) with seeded random codes: for tests of
    layouts and start-up checks, where what the codes are does not matter."""
    from vllm_lowbit_kv.codecs.base import ModelIdentity
    from vllm_lowbit_kv.codecs.rvq import RVQCodebooks, RVQSettings
    from vllm_lowbit_kv.schemes import get_scheme

    made = {}

    def make(name, model=ModelIdentity("SmolLM2-135M-Instruct", 30, 3, 64)):
        if (name, model) not in made:
            kc, vc = get_scheme(name).codecs(model.head_dim)
            s = RVQSettings(kc.num_codebooks, kc.codebook_size, kc.group_size, kc.grouping, vc.grouping)
            g = torch.Generator().manual_seed(0)
            shape = (model.num_layers, s.num_codebooks, s.codebook_size, s.group_size)
            books = RVQCodebooks(torch.randn(shape, generator=g) * 0.3, torch.randn(shape, generator=g) * 0.3,
                                 model, s, {"note": "random codes (tests)"})
            made[name, model] = books.save(tmp_path_factory.mktemp("rvq") / f"{name}.safetensors")
        return made[name, model]

    return make


# The session's one shared vidkv server (tests/_servers.py), for every e2e test module.
from _servers import server  # noqa: E402,F401
