"""Benchmarks: each module runs with torchrun (or alone) and writes JSON under bench/out/."""
