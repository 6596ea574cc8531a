"""The daemon hands freed heap pages back: after a burst is freed, its resident memory drops
to what it still holds (glibc; elsewhere the call says it cannot)."""

from __future__ import annotations

import ctypes
import platform

import pytest

from sluice.daemon.heap import give_back_free_memory


def resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_pages_a_freed_burst_left_go_back():
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    # 100 MB in 4 kB pieces (under the mmap threshold: heap memory), every 16th kept, so
    # the freed ones are holes between live ones that the heap's top cannot shrink past
    pieces = [libc.malloc(4000) for _ in range(25_000)]
    try:
        for piece in pieces:
            ctypes.memset(piece, 1, 4000)
        for i, piece in enumerate(pieces):
            if i % 16:
                libc.free(piece)
        before = resident_mib()
        assert give_back_free_memory()
        assert resident_mib() < before - 60  # of the ~94 MB freed
    finally:
        for piece in pieces[::16]:
            libc.free(piece)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallinfo2 is glibc's")
async def test_a_burst_freed_between_the_minute_passes_goes_back_within_a_check():
    import trio

    from sluice.daemon.heap import FREE_TRIM_BYTES, free_heap_bytes, give_back_periodically

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    pieces = [libc.malloc(4000) for _ in range(25_000)]  # as above: holes between live ones
    try:
        for piece in pieces:
            ctypes.memset(piece, 1, 4000)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(give_back_periodically, 3600.0, 0.05)
            await trio.sleep(0.2)  # a first check: what lies free now is its baseline
            for i, piece in enumerate(pieces):
                if i % 16:
                    libc.free(piece)
            assert free_heap_bytes() > FREE_TRIM_BYTES
            before = resident_mib()
            with trio.move_on_after(10):
                while resident_mib() > before - 60:  # of the ~94 MB freed
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        assert resident_mib() < before - 60, "freed pages stayed resident"
    finally:
        for piece in pieces[::16]:
            libc.free(piece)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallinfo2 is glibc's")
async def test_a_burst_that_reused_pages_handed_back_goes_back_again():
    """A trim leaves the pages it handed back counted as free: a second burst that takes
    them again and frees them again leaves the heap's free bytes where they were, and its
    pages must go back all the same (they stayed resident until the once-a-minute pass, so
    a daemon under a steady churn of connections looked hundreds of MB larger than it was)."""
    import trio

    from sluice.daemon.heap import give_back_periodically

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    kept = [libc.malloc(4000) for _ in range(25_000)]  # holes between live ones, as above
    for piece in kept:
        ctypes.memset(piece, 1, 4000)
    for i, piece in enumerate(kept):
        if i % 16:
            libc.free(piece)
    kept = kept[::16]
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(give_back_periodically, 3600.0, 0.05)
            for burst in range(2):
                before = resident_mib()
                with trio.move_on_after(10):  # the freed pages go back
                    while resident_mib() > before - 60:
                        await trio.sleep(0.05)
                assert resident_mib() < before - 60, f"burst {burst}: freed pages stayed"
                pieces = [libc.malloc(4000) for _ in range(23_000)]  # the holes, taken again
                for piece in pieces:
                    ctypes.memset(piece, 1, 4000)
                await trio.sleep(0.2)
                for piece in pieces:
                    libc.free(piece)
            nursery.cancel_scope.cancel()
    finally:
        for piece in kept:
            libc.free(piece)


def test_the_settled_collector_still_frees_a_cycle_once_allocations_pile_up():
    import gc
    import weakref

    from sluice.daemon.heap import YOUNG_COLLECTION_THRESHOLD, settle_collector

    class Node:
        pass

    before = gc.get_threshold()
    try:
        settle_collector()
        assert gc.get_freeze_count() > 0  # what was loaded is out of the collector's scans
        node = Node()
        node.self = node  # a cycle: reference counting alone never frees it
        gone = weakref.ref(node)
        del node
        kept = [[] for _ in range(YOUNG_COLLECTION_THRESHOLD // 2)]
        assert gone() is not None  # short of the threshold, no pass has run
        kept += [[] for _ in range(YOUNG_COLLECTION_THRESHOLD)]
        assert gone() is None  # past it, a young pass freed the cycle
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


async def test_the_periodic_pass_frees_a_cycle_that_reached_the_oldest_generation():
    import gc
    import weakref

    import trio

    from sluice.daemon.heap import give_back_periodically

    class Node:
        pass

    node = Node()
    node.self = node
    gone = weakref.ref(node)
    gc.collect(1)  # a survivor of the young and middle passes: now in the oldest generation
    assert gc.is_tracked(node) and gone() is not None
    del node  # garbage now, but only a full pass looks at the oldest generation
    gc.collect(1)
    assert gone() is not None
    with trio.move_on_after(0.2):
        await give_back_periodically(interval=0.05)
    assert gone() is None
