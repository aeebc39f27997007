"""Structured JSON logs. Never prompt text, never raw session ids: only hashed labels."""

from __future__ import annotations

import logging
import sys
import time

import orjson

_RESERVED = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _RESERVED and not key.startswith("_"):
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(doc, default=str).decode()


# Libraries that log every call at debug level: grpc.aio two lines per RPC ("Loaded running
# loop", "RPC cancelled" for every stream Envoy resets), redis one per connection. The
# processor's debug level is for its own decisions; with theirs on, a loaded processor spent
# most of its logging time on their lines and fell behind Envoy's message timeout sooner.
QUIET_LIBRARIES = ("grpc", "redis", "asyncio", "aiohttp", "hpack", "h2", "urllib3")


def setup_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(max(logging.INFO, root.level))
    logging.Formatter.converter = time.gmtime
