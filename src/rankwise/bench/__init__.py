"""Benchmark support shared by ``benchmarks/`` scripts and ``rankwise bench``."""
