"""fleet-extproc: an Envoy external processor for LLM inference fleets."""

__version__ = "0.1.0"
