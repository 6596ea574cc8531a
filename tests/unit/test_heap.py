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
