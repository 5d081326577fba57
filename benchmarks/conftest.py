"""Benchmarks are run explicitly: ``python -m pytest benchmarks --benchmark-only`` (see docs/benchmarks.md)."""
