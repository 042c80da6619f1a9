"""Benchmarks of custom_fit against plain Keras (scripts, not tests)."""
