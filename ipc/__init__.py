"""sluice's client package: the wire protocol, its codec and sockets, and the client library.

`from sluice.ipc import Client, AsyncClient` gives the client library. They are loaded on
first use, so that importing the protocol's plain values (`sluice.ipc.vocabulary`, which the
scheduler core and the worker process use) loads neither trio nor ZeroMQ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sluice.ipc.client import AsyncClient, Client

__all__ = ["AsyncClient", "Client"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from sluice.ipc import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
