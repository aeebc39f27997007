"""The fleet secret that keys session labels (``x-fleet-session``, log ``session`` fields).

Where it comes from, first match wins:

1. ``session.label_secret_file``: a file (e.g. a mounted Kubernetes Secret); surrounding
   whitespace is stripped;
2. the environment variable named by ``session.label_secret_env`` (default
   ``FLEET_SESSION_SECRET``);
3. neither: a random 32-byte secret drawn once per process.

Why a random per-process secret is the default rather than anything derived from the config: a
label must not be reversible by someone who guesses the raw id (an email) and can read the
config, and the config is not a secret. The price is that labels are then only comparable within
one process lifetime: two replicas (or one replica before and after a restart) log different
labels for the same session, and an upstream that reads ``x-fleet-session`` sees a different
value per replica. Placement is unaffected (it uses the unkeyed digest), so a fleet of replicas
without a configured secret still routes every session identically. Set the secret to make
labels agree across replicas and restarts. The Redis affinity keys are keyed with it too, so
replicas share seen marks and overrides only when they share the secret.
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from extproc.config.schema import SessionConfig

log = logging.getLogger("extproc.config")

# Drawn on first use, then kept for the life of the process so that a config reload does not
# change every label.
_process_secret: bytes | None = None


@dataclass(frozen=True, slots=True)
class LabelSecret:
    value: bytes
    source: str  # "file", "env" or "process"


class LabelSecretError(ValueError):
    pass


def _per_process() -> bytes:
    global _process_secret
    if _process_secret is None:
        _process_secret = secrets.token_bytes(32)
    return _process_secret


def resolve_label_secret(cfg: SessionConfig) -> LabelSecret:
    if cfg.label_secret_file:
        try:
            value = Path(cfg.label_secret_file).read_bytes().strip()
        except OSError as exc:
            raise LabelSecretError(
                f"session.label_secret_file: cannot read {cfg.label_secret_file}: {exc}"
            ) from exc
        if not value:
            raise LabelSecretError(f"session.label_secret_file: {cfg.label_secret_file} is empty")
        return LabelSecret(value, "file")
    if cfg.label_secret_env:
        env = os.environ.get(cfg.label_secret_env, "")
        if env:
            return LabelSecret(env.encode("utf-8", "surrogateescape"), "env")
    return LabelSecret(_per_process(), "process")


def warn_if_per_process(
    secret: LabelSecret, env_name: str | None, shared_store: bool = False
) -> None:
    if secret.source != "process":
        return
    log.warning(
        "session labels are keyed with a random per-process secret: replicas and restarts "
        "log different labels for one session (placement is unaffected); set %s or "
        "session.label_secret_file to make them agree",
        env_name or "session.label_secret_env",
    )
    if shared_store:
        # The Redis affinity keys are the same keyed hash (extproc.core.keys.SessionKey):
        # with a secret of its own, each replica reads and writes only its own entries.
        log.warning(
            "redis.url is set but the session secret is per process: replicas do not share "
            "seen marks or affinity overrides (nor keep them across a restart); set %s or "
            "session.label_secret_file on every replica",
            env_name or "session.label_secret_env",
        )
