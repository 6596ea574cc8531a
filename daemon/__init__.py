"""sluice.daemon: the daemon process, its configuration and the `sluice` commands."""

from __future__ import annotations

from importlib import metadata


def version() -> str:
    """The installed sluice's version; "" where it runs from a tree never installed."""
    try:
        return metadata.version("sluiced")
    except metadata.PackageNotFoundError:
        return ""
