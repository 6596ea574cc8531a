"""A new user's first mistakes with `sluiced serve`: each is one line on stderr naming the
value and the fix, and exit 78 (EX_CONFIG, which the systemd unit does not restart), before
the model loads or any actor starts (nothing is logged, nothing is bound)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(120)

EXIT_CONFIG = 78


def sluiced(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sluice.daemon.main", "serve",
         "--control", f"ipc://{tmp_path}/control.sock", *args],
        capture_output=True, text=True, timeout=90,
        env={**os.environ, "SLUICE_LOG_LEVEL": "info"})  # a started actor would log


def assert_refused(done: subprocess.CompletedProcess, *named: str) -> str:
    """Exit 78, no ready line, and stderr exactly one line that names each of `named`."""
    assert done.returncode == EXIT_CONFIG, (done.returncode, done.stderr[-3000:])
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr[-3000:]
    line = lines[0]
    assert line.startswith("sluiced: ") and "Traceback" not in line, line
    for text in named:
        assert text in line, line
    return line


@pytest.fixture
def busy_port():
    """A port some other program listens on."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


def test_a_model_path_that_does_not_exist(tmp_path) -> None:
    missing = tmp_path / "smollm.gguf"
    line = assert_refused(sluiced(tmp_path, "--model", str(missing)), str(missing))
    assert "does not exist" in line and ".gguf file or a Hugging Face folder" in line


def test_a_file_that_is_not_gguf(tmp_path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_text("<html>a download page, saved by mistake</html>")
    line = assert_refused(sluiced(tmp_path, "--model", str(fake)), str(fake))
    assert "not a GGUF file" in line


def test_a_folder_without_config_json(tmp_path) -> None:
    line = assert_refused(sluiced(tmp_path, "--model", str(tmp_path)), str(tmp_path))
    assert "no config.json" in line


@pytest.mark.parametrize("flag", ["--listen", "--http", "--metrics-port"])
def test_a_port_in_use(tmp_path, busy_port, flag) -> None:
    value = {"--listen": f"tcp://127.0.0.1:{busy_port}", "--http": f"127.0.0.1:{busy_port}",
             "--metrics-port": str(busy_port)}[flag]
    line = assert_refused(sluiced(tmp_path, "--executor", "null", flag, value),
                          f"127.0.0.1:{busy_port}", "in use")
    assert "pick another port" in line


@pytest.mark.parametrize(("flag", "value", "why"), [
    ("--listen", "localhost", "not an address"),
    ("--listen", "tcp://localhost", "has no port"),
    ("--listen", "tcp://127.0.0.1:99999", "not a port from 0 to 65535"),
    ("--http", "localhost", "has no port"),
    ("--http", "http://localhost:8000", "is a URL"),
    ("--http", "127.0.0.1:99999", "not a port from 0 to 65535"),
    ("--metrics-port", "99999", "must be a port from 0 to 65535"),
])
def test_an_address_that_does_not_parse(tmp_path, flag, value, why) -> None:
    assert_refused(sluiced(tmp_path, "--executor", "null", flag, value), value, why)


def test_two_listeners_on_one_port(tmp_path) -> None:
    assert_refused(sluiced(tmp_path, "--executor", "null", "--listen", "tcp://127.0.0.1:7399",
                           "--http", "127.0.0.1:7399"), "port 7399", "daemon.listen")


@pytest.mark.parametrize(("table", "named"), [
    ('[stream]\nheartbeat_timeout = "ten"\n', "stream.heartbeat_timeout: must be a number"),
    ('[worker]\nnum_blocks = "2048"\n', "worker.num_blocks: must be an integer"),
    ("[daemon]\nlisten = 7340\n", "daemon.listen: must be a string"),
    ("[daemon]\ndrain_deadline = -5.0\n", "daemon.drain_deadline"),
    ("[scheduler]\npolicy = 5\n", "scheduler.policy"),
])
def test_a_config_value_of_the_wrong_type(tmp_path, table, named) -> None:
    config = tmp_path / "sluiced.toml"
    config.write_text(table)
    assert_refused(sluiced(tmp_path, "--executor", "null", "--config", str(config)), named)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA device")
def test_cuda_on_a_host_without_one(tmp_path) -> None:
    line = assert_refused(sluiced(tmp_path, "--device", "cuda"), "worker.device", "'cuda'")
    assert 'device = "cpu"' in line


def test_a_cuda_device_past_the_last(tmp_path) -> None:
    index = torch.cuda.device_count() if torch.version.cuda else 0
    assert_refused(sluiced(tmp_path, "--device", f"cuda:{index}"), f"cuda:{index}")


def test_a_device_name_that_is_no_device(tmp_path) -> None:
    assert_refused(sluiced(tmp_path, "--device", "gpu"), "worker.device", "cpu, cuda or cuda:N")


def test_a_tensor_parallel_size_the_model_cannot_split_and_a_busy_join_port(
        tmp_path, busy_port) -> None:
    """The embedded model (9 heads, 3 KV heads) on 4 ranks, and ranks on other hosts whose
    join address another program holds: refused by name before any rank starts."""
    line = assert_refused(sluiced(tmp_path, "--tensor-parallel", "4"),
                          "worker.tensor_parallel = 4 cannot split")
    assert "must be one of 1, 2, 3, 9" in line
    key = tmp_path / "worker.key"
    key.write_text("x" * 40)
    key.chmod(0o600)
    config = tmp_path / "sluiced.toml"
    config.write_text(f"""[worker]
tensor_parallel = 2
join_hosts = ["10.0.0.2"]
join_listen = "tcp://127.0.0.1:{busy_port}"
join_secret_key_file = "{key}"
join_public_keys = ["{'y' * 40}"]
""")
    assert_refused(sluiced(tmp_path, "--config", str(config)), "worker.join_listen",
                   f"127.0.0.1:{busy_port}", "in use")
