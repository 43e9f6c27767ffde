"""Benchmark smoke tests (marker ``bench``)."""
