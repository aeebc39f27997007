"""glibc malloc settings for a process that handles multi-megabyte request bodies.

A request body crosses the processor as several buffers of its own size: gRPC's receive
buffers, the message grpc.aio hands to protobuf, the ``bytes`` protobuf makes of the body
field, and on the body path the decoded document's strings. With glibc's defaults a buffer of
more than 128 KiB is a fresh ``mmap`` (the threshold then rises with the sizes freed, up to
32 MiB) and memory freed at the top of the heap beyond twice that threshold is given back to
the kernel. Either way, every request of a few MiB touches memory the kernel must fault in
again, 4 KiB at a time: ~2,000 minor faults for a 4 MiB request through the bare processor,
~10,000 for 16 MiB (``extproc bench overhead`` counts them). On the Firecracker VM the
benchmarks run on, those faults cost more than the bare processor's own work, and their cost
varied 3x between back-to-back runs (BENCHMARKS.md).

So the processor keeps freed memory for the next request: buffers up to glibc's largest mmap
threshold come from the heap, and the heap is trimmed only when more than
:data:`TRIM_THRESHOLD` is free at its top. The price is resident memory that stays at its
high-water mark of recent bodies instead of falling back after each one (measured in
BENCHMARKS.md: RSS after bursts of 16 MiB bodies levels off). ``FLEET_MALLOC=glibc`` (or
``extproc serve --malloc glibc``) leaves glibc's defaults; ``GLIBC_TUNABLES`` / ``MALLOC_*_``
set by the operator still apply when this is off. A libc without ``mallopt`` (musl) is left
as it is.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("extproc.serve")

ENV = "FLEET_MALLOC"
TUNED = "tuned"
GLIBC = "glibc"
CHOICES = (TUNED, GLIBC)

# mallopt parameter numbers (glibc malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

# glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit), so this is the
# most it allows: every buffer of a body up to the default processor.max_body_bytes (32 MiB)
# comes from the heap. Setting it also turns off glibc's dynamic threshold.
MMAP_THRESHOLD = 32 << 20
# Free memory kept at the top of the heap before it is given back to the kernel: the buffers
# of a few 16 MiB requests. (A larger M_TOP_PAD as well made no difference that runs on the
# loaded benchmark machine could tell apart.)
TRIM_THRESHOLD = 128 << 20

SETTINGS = (
    (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
    (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
)


def choice_from_env() -> str:
    """The allocator setting unless the command line says otherwise: ``FLEET_MALLOC``."""
    value = os.environ.get(ENV, TUNED).strip().lower() or TUNED
    return value if value in CHOICES else TUNED


def tune(choice: str = TUNED) -> bool:
    """Apply :data:`SETTINGS` with ``mallopt`` (choice ``tuned``); whether they all took.
    Call it at process start, before the first large request."""
    if choice != TUNED:
        return False
    try:
        # The process's own symbols: the C library it was linked with.
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        log.info("no mallopt in this libc: its allocator is left as it is")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = all(mallopt(param, value) == 1 for param, value in SETTINGS)
    if not ok:
        log.warning("mallopt refused a setting: glibc's defaults may still apply")
    return ok
