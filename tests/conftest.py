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


def _worker_cpus() -> list[int]:
    """This test process's share of the CPUs: all of them, or under pytest-xdist
    (scripts/test.sh) worker i's contiguous share."""
    cpus = sorted(os.sched_getaffinity(0))
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1))
    if worker is None or count < 2 or len(cpus) < count:
        return cpus
    i, per = int(worker.removeprefix("gw")), len(cpus) // count
    return cpus[i * per:(i + 1) * per]


WORKER_CPUS = _worker_cpus()
torch.set_num_threads(min(2, len(WORKER_CPUS)))
if len(WORKER_CPUS) < len(os.sched_getaffinity(0)):
    # the servers this worker starts compute on its own CPUs, not on the other worker's:
    # vLLM's automatic binding would put every server's worker on the same first core
    # (multi-rank servers drop this: the launcher binds each rank, tests/_servers.py)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, WORKER_CPUS)))
# Most test servers run vLLM's model worker inside its engine-core process (vLLM's own
# switch; multi-rank servers keep one process per rank): one Python start-up of torch and
# vLLM fewer per server (~18 s of ~60 here) and no shared-memory queue busy-polling between
# the two. The session's shared server and the servers of `vllm serve` and scripts/main.sh
# keep vLLM's default layout, the one users run (tests/_servers.py: DEFAULT_LAYOUT_ENV).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


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
    _order_for_workers(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1]


def _order_for_workers(items) -> None:
    """Check :data:`_servers.SHARED_SERVER_MODULES` (the units of
    :func:`pytest_xdist_make_scheduler`) against the tests that use the shared server, and
    put the units with servers first, the shared server's leading, so that the fast
    modules fill in beside them."""
    from _servers import SHARED_SERVER_MODULES

    users = {_module(i.nodeid) for i in items if "server" in getattr(i, "fixturenames", ())}
    if users - set(SHARED_SERVER_MODULES):
        raise pytest.UsageError(f"{sorted(users - set(SHARED_SERVER_MODULES))} use the shared server: "
                                "add them to SHARED_SERVER_MODULES in tests/_servers.py")
    slow = {_module(i.nodeid) for i in items if "slow" in i.keywords}
    items.sort(key=lambda i: (_module(i.nodeid) not in SHARED_SERVER_MODULES, _module(i.nodeid) not in slow))


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist (scripts/test.sh) hands out whole modules, so that a module's servers
    start once, and the modules that use the session's shared server as one unit, so
    that it starts once. (Its own ``--dist loadgroup`` marks groups in ``item._nodeid``,
    which pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    from _servers import SHARED_SERVER_MODULES

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = _module(nodeid)
            return "shared server" if module in SHARED_SERVER_MODULES else module

    return ModuleScheduling(config, log)


@pytest.fixture(scope="session")
def model_dir():
    """The embedded model's folder (prepared on first use)."""
    from vllm_lowbit_kv.model import prepare_model
    return str(prepare_model())


@pytest.fixture(scope="session")
def rvq_codebook_file(tmp_path_factory):
    """``(scheme name, **codec fields) -> path`` of an RVQ codebook file for the embedded
    SmolLM2 (30 layers, 3 KV heads, head_dim 64) with seeded random codes, made for the
    scheme's codecs with those fields (``group_size=8``, ...): for tests of layouts,
    kernels and start-up checks, where what the codes are does not matter."""
    from vllm_lowbit_kv.codecs.base import ModelIdentity
    from vllm_lowbit_kv.codecs.rvq import RVQCodebooks, RVQSettings
    from vllm_lowbit_kv.schemes import get_scheme

    made = {}

    def make(name, model=ModelIdentity("SmolLM2-135M-Instruct", 30, 3, 64), **fields):
        key = (name, model, tuple(sorted(fields.items())))
        if key not in made:
            kc, vc = get_scheme(name).with_params(model.head_dim, **fields).codecs(model.head_dim)
            s = RVQSettings(kc.num_codebooks, kc.codebook_size, kc.group_size, kc.grouping, vc.grouping)
            g = torch.Generator().manual_seed(0)
            shape = (model.num_layers, s.num_codebooks, s.codebook_size, s.group_size)
            books = RVQCodebooks(torch.randn(shape, generator=g) * 0.3, torch.randn(shape, generator=g) * 0.3,
                                 model, s, {"note": "random codes (tests)"})
            made[key] = books.save(tmp_path_factory.mktemp("rvq") / f"{name}.safetensors")
        return made[key]

    return make


# The session's one shared vidkv server (tests/_servers.py), for every e2e test module.
from _servers import server  # noqa: E402,F401
