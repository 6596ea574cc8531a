"""Binding a daemon-private `ipc://` socket safely: the directory, a live owner, the mode.

A Unix socket's protection is its file mode and its directory. So before the control socket
is bound, its directory must be owned by this daemon's user and not writable by group or
others (checked with `lstat`, so a symbolic link is never trusted); an existing file at the
path is replaced only when it is a socket nobody answers on (a stale one of an earlier run) —
a live daemon keeps its socket, and a link or any other file is left alone. The bind itself
runs under a restrictive umask, so the socket is 0600 from its first moment: there is no
window between `bind` and a `chmod`, and no `chmod` to follow a link.

TCP addresses pass through untouched. This module holds no ZeroMQ policy beyond the bind.
"""

from __future__ import annotations

import os
import socket as pysocket
import stat
from pathlib import Path

SOCKET_UMASK = 0o177  # sockets come out 0600: only the daemon's user may connect
PROBE_TIMEOUT = 2.0  # seconds a connect to an existing socket may take before it counts as live


class SocketPathError(RuntimeError):
    """The socket cannot be bound safely; the message says what to fix."""


class UnsafeDirectory(SocketPathError):
    """A directory meant to be private to the daemon is not (owner, mode, or a link)."""


class SocketInUse(SocketPathError):
    """A live process answers on the socket path: another daemon is serving there."""


def check_private_directory(path: Path, what: str = "directory") -> None:
    """Refuse a directory that is a link, not ours, or writable by group or others."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise UnsafeDirectory(f"{what} {path}: {exc.strerror}") from None
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeDirectory(f"{what} {path} is a symbolic link; use the real directory")
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectory(f"{what} {path} is not a directory")
    if info.st_uid != os.geteuid():
        raise UnsafeDirectory(f"{what} {path} is owned by uid {info.st_uid}, not by this "
                              f"daemon's user (uid {os.geteuid()}); refusing to use it")
    if info.st_mode & 0o022:
        raise UnsafeDirectory(f"{what} {path} is writable by group or others (mode "
                              f"{stat.S_IMODE(info.st_mode):04o}); make it 0700 or 0750")


def ipc_path(address: str) -> Path | None:
    """The file of an `ipc://` address, or None for any other transport."""
    return Path(address[len("ipc://"):]) if address.startswith("ipc://") else None


def answers(path: Path) -> bool:
    """Whether a process accepts connections on the Unix socket at `path`."""
    probe = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    probe.settimeout(PROBE_TIMEOUT)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except TimeoutError:
        return True  # a listener with a full backlog is still a listener
    finally:
        probe.close()
    return True


def clear_socket_path(path: Path) -> None:
    """Make `path` free for a bind: remove a stale socket, refuse anything else there."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        raise SocketPathError(f"{path} is a symbolic link; refusing to follow or replace it")
    if not stat.S_ISSOCK(info.st_mode):
        raise SocketPathError(f"{path} exists and is not a socket; refusing to replace it")
    if info.st_uid != os.geteuid():
        raise SocketPathError(f"socket {path} belongs to uid {info.st_uid}; refusing to "
                              "replace it")
    if answers(path):
        raise SocketInUse(f"another daemon answers on {path}; stop it or choose another "
                          "control address")
    os.unlink(path)  # stale: nobody answers; unlink removes the socket file itself


def prepare_private_socket(address: str) -> None:
    """Everything `bind_private` checks before binding, for callers that want to refuse early."""
    path = ipc_path(address)
    if path is not None:
        check_private_directory(path.parent, "socket directory")
        clear_socket_path(path)


def bind_private(sock, address: str) -> str:
    """Bind a ZeroMQ socket to `address`; an ipc socket is checked first and born 0600."""
    prepare_private_socket(address)
    if ipc_path(address) is None:
        return sock.bind(address)
    # libzmq calls bind(2) for ipc:// in the calling thread, so the umask applies to the
    # socket file it creates; bind(2) never follows a link (it fails on any existing path).
    previous = os.umask(SOCKET_UMASK)
    try:
        return sock.bind(address)
    finally:
        os.umask(previous)
