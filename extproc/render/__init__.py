"""Renderers: the one fleet.yaml becomes Envoy bootstraps, Kubernetes manifests, compose files."""

from __future__ import annotations

import sys
from pathlib import Path


def write_output(path: str, text: str) -> None:
    """Write a rendered document to ``path``, or to stdout for ``-``."""
    if path == "-":
        sys.stdout.write(text)
    else:
        Path(path).write_text(text, encoding="utf-8")
