"""Renderers: the one fleet.yaml becomes Envoy bootstraps, Kubernetes manifests, compose files."""
