import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Without a CUDA device the Triton kernels (triton_ops) run in Triton's interpreter.
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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
