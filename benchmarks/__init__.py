"""Benchmarks: run with ``python -m benchmarks.<name>``; they are not tests."""
