"""The daemon's memory housekeeping: the C heap's free pages handed back to the system, so
that its resident memory follows what it holds now rather than the most it ever held; and
Python's collector set for a daemon whose objects are freed by reference counting.

The daemon's allocations come and go with its connections: each Stream has ZeroMQ sockets
and queues, each burst of requests its frames and buffers. glibc keeps the pages such a burst
freed for reuse, so after a flood of connections the daemon looks as large as at the flood's
peak for good, which reads like a leak to whoever watches it. `malloc_trim(0)` gives those
pages back. It runs once a minute on a thread of its own (ctypes lets go of the GIL): walking
a fragmented heap can take tens of milliseconds. Sooner when a churn left much free: every few
seconds, when the resident size grew by `FREE_TRIM_BYTES` since the last trim and `mallinfo2`
counts at least that much free, the pages go back then (a churn of strangers' connections
leaves tens of megabytes free within seconds, bounded by what the front may hold at once, but
no less resident for it). The trigger is the growth, not the free bytes alone: pages handed
back still count as free, so a burst that takes them again and frees them again leaves the
free count where it was, resident all the same (under a steady churn of connections the
daemon looked 300 MB larger than it was until the minute's pass). On a C library without
these calls (musl, macOS) this does nothing.

The collector: everything loaded before serving (modules, the tokenizer, the model's facts)
lives as long as the daemon, so it is frozen out of the collector's scans. A busy daemon's
messages are short-lived and free no cycles: at Python's default trigger (700 allocations net
of frees) the young generation was collected ~140 times a second under the null bench, ~5% of
the event loop's CPU, finding nothing. Net allocations stay under 20,000 there, so young
collections become rare. Cycles do form off the hot path (a crashed actor's traceback, a
closed connection's tasks), and with young passes rare the older generations would almost
never be collected: a soak's daemon grew ~5 MB a minute so. A full collection therefore runs
once a minute, just before the heap's free pages are handed back.
"""

from __future__ import annotations

import ctypes
import gc
import os
from collections.abc import Callable

import trio

TRIM_INTERVAL_SECONDS = 60.0
FREE_CHECK_SECONDS = 2.0  # how often the heap's free bytes are counted
FREE_TRIM_BYTES = 16 << 20  # free heap bytes past which the pages are handed back at once
YOUNG_COLLECTION_THRESHOLD = 20_000  # net allocations that start a young-generation pass


def settle_collector() -> None:
    """Once loaded, before serving: freeze what exists, collect the young generation rarely."""
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, 20, 100)


def _find_malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _find_malloc_trim()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _find_mallinfo2() -> Callable[[], _MallInfo2] | None:
    try:
        info = ctypes.CDLL(None).mallinfo2  # glibc 2.33 and later
    except (AttributeError, OSError):
        return None
    info.argtypes, info.restype = [], _MallInfo2
    return info


_MALLINFO2 = _find_mallinfo2()


def free_heap_bytes() -> int | None:
    """Bytes the C heap holds free (not handed back), or None where it cannot say."""
    if _MALLINFO2 is None:
        return None
    return _MALLINFO2().fordblks


def give_back_free_memory() -> bool:
    """Return the heap's free pages to the system now; False where the C library cannot."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


def resident_bytes() -> int | None:
    """This process's resident memory, or None where `/proc` cannot say."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return None


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


async def give_back_periodically(interval: float = TRIM_INTERVAL_SECONDS,
                                 check: float = FREE_CHECK_SECONDS) -> None:
    """Until cancelled: every `interval` seconds collect every generation, then trim; every
    `check` seconds meanwhile, trim if, since the last trim, the free heap grew by
    `FREE_TRIM_BYTES`, or the resident size did with at least that much of the heap free.
    Free bytes a trim cannot hand back (between live ones) and live growth do not make it
    trim again: each trim sets both marks."""
    last, marks = trio.current_time(), (0, 0)
    while True:
        await trio.sleep(min(interval, check))
        if trio.current_time() - last >= interval:
            last = trio.current_time()
            gc.collect()
        elif not await _past_marks(*marks):
            continue
        if _MALLOC_TRIM is not None:
            marks = await trio.to_thread.run_sync(_trim_and_mark)


async def _past_marks(resident_mark: int, free_mark: int) -> bool:
    resident = resident_bytes()
    # counted on a thread: `mallinfo2` walks every arena's free lists
    free = await trio.to_thread.run_sync(free_heap_bytes) or 0
    if free > free_mark + FREE_TRIM_BYTES:
        return True
    grew = resident is not None and resident > resident_mark + FREE_TRIM_BYTES
    return grew and free > FREE_TRIM_BYTES


def _trim_and_mark() -> tuple[int, int]:
    """Trim; the resident size and the free bytes after it."""
    give_back_free_memory()
    return resident_bytes() or 0, free_heap_bytes() or 0
