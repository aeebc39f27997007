"""Reliability tooling: fuzzing, chaos and soak runs. Never imported by the serving path."""
