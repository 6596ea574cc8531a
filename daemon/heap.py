"""The daemon's memory housekeeping: the C heap's free pages handed back to the system, so
that its resident memory follows what it holds now rather than the most it ever held; and
Python's collector set for a daemon whose objects are freed by reference counting.

The daemon's allocations come and go with its connections: each Stream has ZeroMQ sockets
and queues, each burst of requests its frames and buffers. glibc keeps the pages such a burst
freed for reuse, so after a flood of connections the daemon looks as large as at the flood's
peak for good, which reads like a leak to whoever watches it. `malloc_trim(0)` gives those
pages back. It runs once a minute on a thread of its own (ctypes lets go of the GIL): walking
a fragmented heap can take tens of milliseconds. Sooner when a churn left much free: every few
seconds `mallinfo2` counts the heap's free bytes, and past `FREE_TRIM_BYTES` the pages go back
then (a churn of strangers' connections leaves tens of megabytes free within seconds, bounded
by what the front may hold at once, but no less resident for it). On a C library without
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


async def give_back_periodically(interval: float = TRIM_INTERVAL_SECONDS,
                                 check: float = FREE_CHECK_SECONDS) -> None:
    """Until cancelled: every `interval` seconds collect every generation, then trim; every
    `check` seconds meanwhile, trim if the free heap grew by `FREE_TRIM_BYTES` since the last
    trim (free bytes a trim cannot hand back, between live ones, do not make it trim again)."""
    last, left_free = trio.current_time(), 0
    while True:
        await trio.sleep(min(interval, check))
        if trio.current_time() - last >= interval:
            last = trio.current_time()
            gc.collect()
        elif (await trio.to_thread.run_sync(free_heap_bytes) or 0) <= left_free + FREE_TRIM_BYTES:
            continue
        if _MALLOC_TRIM is not None:
            left_free = await trio.to_thread.run_sync(_trim_and_count)


def _trim_and_count() -> int:
    give_back_free_memory()
    return free_heap_bytes() or 0
