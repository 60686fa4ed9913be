"""A float32 model serves with the packed cache (the backend lists float32 among its dtypes).

The sink area and the staging hold model-dtype values, so a page's size depends on
the model dtype; vLLM asks the backend for the page size (``customize_spec``) outside
its config context, where the backend used to assume bfloat16 and then met float32
pages of another size at the first request (the engine died). The test serves a
chunked prompt, whose later chunks read the pages and the sinks, in float32.
"""

import pytest

pytest.importorskip("vllm")

from bench.scale_out import drift_text, teacher_forced  # noqa: E402
from bench.server import Server  # noqa: E402

pytestmark = pytest.mark.slow


def test_float32_model_serves_vidkv():
    args = ["--kv-cache-dtype", "vidkv", "--dtype", "float32", "--max-model-len", "1024",
            "--max-num-batched-tokens", "256"]
    with Server(args).start() as s:
        assert "Paris" in s.completion(prompt="The capital of France is", max_tokens=8,
                                       temperature=0)["text"]
        # a long text in 256-token chunks: the later chunks read float32 sinks and pages
        mean_logprob = float(teacher_forced(s, drift_text()).mean())
    assert mean_logprob > -4.0, mean_logprob  # measured -3.25 (bf16 model: -3.25)
