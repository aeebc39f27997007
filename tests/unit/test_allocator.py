"""serve/allocator.py: the glibc settings take, and a large buffer then reuses the heap.

Each case runs in a fresh interpreter: malloc's settings are process-wide, and the first
large allocation is what they change.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from extproc.serve import allocator

# Allocates a 20 MiB buffer, frees it, and prints (whether tune() took, bytes of the buffer
# in mmapped chunks while held, bytes releasable at the top of the heap after it is freed).
PROBE = """
import ctypes, sys
from extproc.serve import allocator

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2
took = allocator.tune(sys.argv[1])
before = mallinfo2().hblkhd
buf = b"x" * (20 << 20)
mapped = mallinfo2().hblkhd - before
del buf
print(int(took), mapped, mallinfo2().keepcost)
"""


def _probe(choice: str) -> tuple[int, int, int]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, choice],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        # glibc's defaults underneath, whatever the environment sets.
        env={
            k: v
            for k, v in os.environ.items()
            if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"
        },
    )
    took, mapped, keep = (int(x) for x in done.stdout.split())
    return took, mapped, keep


glibc_only = pytest.mark.skipif(
    not os.confstr("CS_GNU_LIBC_VERSION"), reason="mallopt/mallinfo2 are glibc's"
)


@glibc_only
def test_tuned_serves_a_large_buffer_from_the_heap_and_keeps_it() -> None:
    took, mapped, keep = _probe(allocator.TUNED)
    assert took == 1
    assert mapped < 1 << 20  # not a fresh mmap
    assert keep >= 20 << 20  # freed, but kept for the next request


@glibc_only
def test_glibc_defaults_map_a_large_buffer_afresh() -> None:
    # The control: without the settings the same buffer is a fresh mmap, given back when
    # freed (the page faults `bench overhead` counts at 4 MiB and 16 MiB).
    took, mapped, keep = _probe(allocator.GLIBC)
    assert took == 0
    assert mapped >= 20 << 20
    assert keep < 20 << 20


def test_choice_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(allocator.ENV, raising=False)
    assert allocator.choice_from_env() == allocator.TUNED
    monkeypatch.setenv(allocator.ENV, "glibc")
    assert allocator.choice_from_env() == allocator.GLIBC
    monkeypatch.setenv(allocator.ENV, "something-else")
    assert allocator.choice_from_env() == allocator.TUNED
