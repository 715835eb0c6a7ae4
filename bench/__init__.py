"""Benchmarks and checks; run each as `python -m bench.NAME` from the checkout."""
