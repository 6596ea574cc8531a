"""The daemon's sockets stay private: an unsafe runtime directory is refused, a symbolic link
at the control path is not followed, a live daemon's control socket is never taken over, a
stale one is replaced, and the control socket is 0600 whatever the umask."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys

import pytest
import trio

from sluice.actors.runtime.local_socket import UnsafeDirectory
from sluice.daemon.config import runtime_dir
from sluice.ipc.control import fetch_status

pytestmark = pytest.mark.timeout(240)  # a hang fails this test instead of the suite

NOBODY = 65534


def refused_start(control: str, *extra: str) -> subprocess.CompletedProcess:
    """Run `sluiced serve` on the null executor, expecting it to refuse before serving."""
    return subprocess.run(
        [sys.executable, "-m", "sluice.daemon.main", "serve", "--executor", "null",
         "--listen", "tcp://127.0.0.1:0", "--control", control, *extra],
        capture_output=True, text=True, timeout=120)


def test_runtime_dir_of_this_user_with_a_private_mode_is_used(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    path = runtime_dir()
    assert path == tmp_path / "sluice"
    assert stat.S_IMODE(os.lstat(path).st_mode) & 0o077 == 0
    os.chmod(path, 0o750)  # systemd's RuntimeDirectoryMode=0750 in the shipped unit
    assert runtime_dir() == path


@pytest.mark.parametrize("mode", [0o770, 0o757, 0o1777], ids=["0770", "0757", "1777"])
def test_a_group_or_world_writable_runtime_dir_is_refused(tmp_path, monkeypatch, mode) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "sluice").mkdir()
    os.chmod(tmp_path / "sluice", mode)
    with pytest.raises(UnsafeDirectory, match="writable by group or others"):
        runtime_dir()


def test_a_foreign_owned_runtime_dir_is_refused(tmp_path, monkeypatch) -> None:
    if os.geteuid() != 0:
        pytest.skip("making a directory owned by another user needs root")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "sluice").mkdir(mode=0o700)
    os.chown(tmp_path / "sluice", NOBODY, NOBODY)
    with pytest.raises(UnsafeDirectory, match=f"owned by uid {NOBODY}"):
        runtime_dir()


def test_a_runtime_dir_that_is_a_symlink_is_refused(tmp_path, monkeypatch) -> None:
    real = tmp_path / "elsewhere"
    real.mkdir(mode=0o700)
    (tmp_path / "run").mkdir(mode=0o700)
    (tmp_path / "run" / "sluice").symlink_to(real)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    with pytest.raises(UnsafeDirectory, match="symbolic link"):
        runtime_dir()


def test_sluiced_refuses_an_unsafe_socket_directory_with_a_clear_message(tmp_path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    done = refused_start(f"ipc://{shared}/control.sock")
    assert done.returncode == 78, done.stderr
    assert f"socket directory {shared} is writable by group or others" in done.stderr
    assert not (shared / "control.sock").exists()


def test_sluiced_does_not_follow_a_symlink_at_the_control_path(tmp_path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    os.chmod(victim, 0o644)
    link = tmp_path / "control.sock"
    link.symlink_to(victim)
    done = refused_start(f"ipc://{link}")
    assert done.returncode == 78, done.stderr
    assert "symbolic link" in done.stderr
    assert link.is_symlink() and victim.read_text() == "keep me"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644


async def test_a_second_daemon_on_a_live_control_path_is_refused(sluiced, tmp_path,
                                                                  drained_and_consistent) -> None:
    control = f"ipc://{tmp_path}/control.sock"
    first, fields = sluiced(["--executor", "null", "--listen", "tcp://127.0.0.1:0",
                             "--control", control])
    done = await trio.to_thread.run_sync(refused_start, control)
    assert done.returncode == 78, done.stderr
    assert "another daemon answers on" in done.stderr
    assert first.poll() is None
    report = await fetch_status(fields["control"])  # the first daemon keeps serving
    assert report.state == "serving"
    await drained_and_consistent(fields["control"])


async def test_a_stale_control_socket_is_replaced(sluiced, tmp_path,
                                                  drained_and_consistent) -> None:
    path = tmp_path / "control.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))  # bound, never listening, closed without unlink: a crashed daemon's
    stale.close()
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    _, fields = sluiced(["--executor", "null", "--listen", "tcp://127.0.0.1:0",
                         "--control", f"ipc://{path}"])
    report = await fetch_status(fields["control"])
    assert report.state == "serving"
    await drained_and_consistent(fields["control"])


async def test_the_control_socket_is_0600_even_under_a_permissive_umask(null_daemon,
                                                                        tmp_path) -> None:
    previous = os.umask(0)
    try:
        daemon = await null_daemon()
    finally:
        os.umask(previous)
    path = daemon.control[len("ipc://"):]
    info = os.lstat(path)
    assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_uid == os.geteuid()
