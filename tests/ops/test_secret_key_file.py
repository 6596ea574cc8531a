"""The CURVE server key can come from a file or a systemd credential (`[auth]
server_secret_key_file`), read at start: a daemon started that way serves clients holding a
listed key, and a missing, unreadable, exposed or malformed key file refuses the start with a
message that names the file and never the key."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import trio
import zmq

from sluice.daemon.config import ConfigFileError, load_config
from sluice.ipc.client import AsyncClient

pytestmark = pytest.mark.timeout(240)  # a hang fails this test instead of the suite


def key_file(folder, name: str, key: str, mode: int = 0o400):
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / name
    path.write_text(key + "\n")
    os.chmod(path, mode)
    return path


def config_naming(tmp_path, name: str, extra: str = ""):
    path = tmp_path / "sluiced.toml"
    path.write_text(f'[auth]\nserver_secret_key_file = "{name}"\n{extra}')
    return path


def test_a_relative_name_is_read_from_the_credentials_directory(tmp_path, monkeypatch) -> None:
    _, secret = zmq.curve_keypair()
    key_file(tmp_path / "creds", "sluice_server_secret_key", secret.decode())
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path / "creds"))
    config = load_config(config_naming(tmp_path, "sluice_server_secret_key"))
    assert config.auth.server_secret_key == secret.decode()


def test_an_absolute_path_is_read_as_is(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    _, secret = zmq.curve_keypair()
    path = key_file(tmp_path / "keys", "server.key", secret.decode(), mode=0o640)
    assert load_config(config_naming(tmp_path, path)).auth.server_secret_key == secret.decode()


@pytest.mark.parametrize("case", ["no_credentials_dir", "missing", "world_readable",
                                  "not_a_key", "both"])
def test_a_bad_key_file_is_refused_naming_the_file_not_the_key(tmp_path, monkeypatch,
                                                               case) -> None:
    _, secret = zmq.curve_keypair()
    creds = tmp_path / "creds"
    key_file(creds, "good", secret.decode())
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    name, extra, expected = "good", "", ""
    if case == "no_credentials_dir":
        monkeypatch.delenv("CREDENTIALS_DIRECTORY")
        expected = "CREDENTIALS_DIRECTORY is not set"
    elif case == "missing":
        name, expected = "absent", "absent"
    elif case == "world_readable":
        key_file(creds, "exposed", secret.decode(), mode=0o644)
        name, expected = "exposed", "readable by others"
    elif case == "not_a_key":
        key_file(creds, "short", "x" * 12)
        name, expected = "short", "does not hold a Z85 CURVE secret key"
    else:
        extra, expected = f'server_secret_key = "{secret.decode()}"\n', "not both"
    with pytest.raises(ConfigFileError, match=expected) as caught:
        load_config(config_naming(tmp_path, name, extra))
    assert secret.decode() not in str(caught.value)
    if case == "no_credentials_dir":  # and `sluiced` says so and exits as a config error
        done = subprocess.run(
            [sys.executable, "-m", "sluice.daemon.main", "serve", "--executor", "null",
             "--config", str(tmp_path / "sluiced.toml"), "--listen", "tcp://127.0.0.1:0",
             "--control", f"ipc://{tmp_path}/control.sock"],
            capture_output=True, text=True, timeout=120,
            env={k: v for k, v in os.environ.items() if k != "CREDENTIALS_DIRECTORY"})
        assert done.returncode == 78 and expected in done.stderr, done.stderr


async def test_a_daemon_keyed_by_credential_serves_a_listed_client(sluiced, tmp_path,
                                                                   drained_and_consistent) -> None:
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    creds = tmp_path / "creds"
    key_file(creds, "sluice_server_secret_key", server_secret.decode())
    config = config_naming(tmp_path, "sluice_server_secret_key",
                           f'[auth.tenants]\nchat = ["{client_public.decode()}"]\n')
    _, fields = sluiced(["--executor", "null", "--config", str(config),
                         "--listen", "tcp://127.0.0.1:0",
                         "--control", f"ipc://{tmp_path}/control.sock"],
                        env={"CREDENTIALS_DIRECTORY": str(creds)})
    with trio.fail_after(60):
        async with AsyncClient(fields["listen"], curve_server_key=server_public,
                               curve_keypair=(client_public, client_secret)) as client:
            generation = await client.generate("hello", max_tokens=4, temperature=0)
            async for _ in generation:
                pass
    assert generation.result.finish_reason == "length"
    await drained_and_consistent(fields["control"])
