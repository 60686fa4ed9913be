"""Benchmarks: quality (``python -m bench.quality``), throughput, kernels; results/ holds outputs."""
