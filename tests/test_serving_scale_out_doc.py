"""docs/scale_out.md's capacity table is what ``python -m bench.scale_out`` computes, and
its arithmetic holds (per-rank bytes, the bf16 ratio = 16 / bits)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import scale_out

DOC = Path(__file__).resolve().parents[1] / "docs" / "scale_out.md"


def test_doc_table_is_the_calculation():
    assert scale_out.markdown(scale_out.table()) in DOC.read_text()


def test_calculation():
    rows = {(r.gpus, r.context, r.dtype): r for r in scale_out.table()}
    bf = rows[8, 8192, "bfloat16"]
    assert bf.bytes_per_token == 80 * 1 * 128 * 2 * 2  # 80 layers, one KV head per tp=8 rank
    assert rows[64, 8192, "bfloat16"].bytes_per_token == 10 * 1 * 128 * 2 * 2
    for (gpus, ctx, dtype), r in rows.items():
        ref = rows[gpus, ctx, "bfloat16"]
        assert r.tokens / ref.tokens == pytest.approx(16 / r.bits, rel=2e-3)
        assert r.kv_budget_gb + r.weights_gb + scale_out.RESERVE_GB == pytest.approx(
            scale_out.GPU_GB * scale_out.UTILIZATION, abs=0.02)
    assert rows[8, 8192, "vidkv"].bits < 2.5 and rows[8, 32768, "vidkv"].bits < rows[8, 8192, "vidkv"].bits
    with pytest.raises(ValueError, match="does not split"):
        scale_out.row(16, 16, 1, "bfloat16", 8192)  # 8 KV heads cannot split 16 ways
