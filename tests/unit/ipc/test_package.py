"""The client package's front door: the client library is one import away, and the values the
scheduler core shares with the wire load no I/O library."""

from __future__ import annotations

import subprocess
import sys


def test_the_clients_come_from_the_package() -> None:
    from sluice.ipc import AsyncClient, Client
    from sluice.ipc import client

    assert Client is client.Client and AsyncClient is client.AsyncClient


def test_the_shared_vocabulary_loads_neither_trio_nor_zeromq() -> None:
    code = ("import sys, sluice.ipc.vocabulary, sluice.actors.scheduler.plan; "
            "print(sorted({'trio', 'zmq'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
