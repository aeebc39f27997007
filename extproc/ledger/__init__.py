"""Budget ledgers: where admission reservations are held (in memory, or in Redis)."""

from extproc.ledger.base import LedgerUnavailable
from extproc.ledger.gate import AdmissionGate, build_gate
from extproc.ledger.memory import MemoryLedger
from extproc.ledger.redis import RedisLedger

__all__ = [
    "AdmissionGate",
    "LedgerUnavailable",
    "MemoryLedger",
    "RedisLedger",
    "build_gate",
]
