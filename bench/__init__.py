"""Benchmarks: quality (``python -m bench.quality``), throughput, kernels; results/ holds outputs."""

from pathlib import Path

#: where the committed results live (the benchmarks' default output folder)
RESULTS = Path(__file__).resolve().parent / "results"
