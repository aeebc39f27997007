"""Benchmarks: every speed or quality claim in the docs comes from one of these."""
