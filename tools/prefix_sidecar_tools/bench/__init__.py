"""Benchmarks: `prefix-sidecar bench <core|fleet|hop|soak|real>`, one module per benchmark.

Benchmarks are commands, not timed tests: absolute times drift on shared machines, so each
one measures what it compares side by side in a single run and reports ratios.
"""
