"""A worker that cannot start: at boot `sluiced` exits with its own code; at run time the
daemon stays up in a `failed` worker state (clear errors, `/health` 503, `status` says so)
until `sluice recover` brings a worker back once the cause is gone. Real worker processes;
the cause is a test fault that makes a worker exit before its hello while a file exists."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import trio

from sluice.daemon.main import EXIT_WORKER
from sluice.ipc.client import AsyncClient
from sluice.ipc.control import fetch_status
from sluice.ipc.vocabulary import OverloadedError

pytestmark = pytest.mark.timeout(400)  # a hang fails this test instead of the suite


def _config(tmp_path, fault_file, retry_interval: float = 600.0) -> str:
    config = tmp_path / "sluiced.toml"
    config.write_text(f"""
[worker]
num_blocks = 128
threads = 1
max_failed_starts = 2
backoff_initial = 0.05
failed_retry_interval = {retry_interval}
debug_fail_start_if = "{fault_file}"
""")
    return str(config)


def test_a_worker_that_never_starts_at_boot_exits_with_the_worker_code(tmp_path) -> None:
    fault = tmp_path / "no-worker"
    fault.write_text("")
    run = subprocess.run(
        [sys.executable, "-m", "sluice.daemon.main", "serve", "--config",
         _config(tmp_path, fault), "--listen", "tcp://127.0.0.1:0",
         "--control", f"ipc://{tmp_path}/control.sock"],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "SLUICE_LOG_LEVEL": "warning"})
    assert run.returncode == EXIT_WORKER == 75
    assert "sluiced ready" not in run.stdout  # it never said it serves
    assert "worker could not be started" in run.stderr
    # nothing was served, so no KV was taken: there is no daemon left to ask


async def _http(port: int, path: str, payload: dict | None = None) -> tuple[int, str]:
    """GET `path`, or POST `payload` as JSON: (status, body)."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                     headers={"content-type": "application/json"})

    def get() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    return await trio.to_thread.run_sync(get)


async def _model(port: int) -> str:
    """The model the HTTP front serves."""
    return json.loads((await _http(port, "/v1/models"))[1])["data"][0]["id"]


async def _sluice(*args: str) -> subprocess.CompletedProcess:
    return await trio.to_thread.run_sync(lambda: subprocess.run(
        [sys.executable, "-m", "sluice.daemon.cli", *args], capture_output=True, text=True,
        timeout=60))


async def _worker_state(control: str, want: str) -> None:
    while (await fetch_status(control)).worker.state != want:
        await trio.sleep(0.1)


async def test_a_worker_that_stops_starting_puts_the_daemon_in_a_failed_state(
    tmp_path, drained_and_consistent, sluiced,
) -> None:
    start_sluiced = sluiced
    fault = tmp_path / "no-worker"
    process, fields = start_sluiced(
        ["--config", _config(tmp_path, fault), "--listen", "tcp://127.0.0.1:0",
         "--control", f"ipc://{tmp_path}/control.sock", "--metrics-port", "0",
         "--http", "127.0.0.1:0"],
        log=tmp_path / "sluiced.log", log_level="warning", timeout=240)
    listen, control, port = fields["listen"], fields["control"], int(fields["metrics"])
    http_port = int(fields["http"].rsplit(":", 1)[1])
    try:
        with trio.fail_after(300):
            async with AsyncClient(listen) as client:
                fault.write_text("")  # from now on no worker can start
                queued = await client.generate("Once upon a time", max_tokens=100,
                                               temperature=0, ignore_eos=True)
                os.kill((await fetch_status(control)).worker.pid, signal.SIGKILL)
                result = await queued.collect()
                assert result.finish_reason == "error"
                assert "worker failed" in result.error

                await _worker_state(control, "failed")
                status = await _sluice("status", "--json", "--connect-control", control)
                worker = json.loads(status.stdout)["worker"]
                assert worker["state"] == "failed"
                assert "exited with 3" in worker["failure"]
                with pytest.raises(OverloadedError, match="worker failed"):
                    await client.generate("Hello", max_tokens=4)
                code, body = await _http(port, "/health")
                assert code == 503 and "failed" in body
                code, body = await _http(http_port, "/health")  # the HTTP front's
                assert code == 503 and "failed" in body
                code, body = await _http(http_port, "/v1/completions", {
                    "model": await _model(http_port), "prompt": "Hello", "max_tokens": 4})
                error = json.loads(body)["error"]
                assert (code, error["type"], error["code"]) == (503, "server_error",
                                                                "worker_failed")

                fault.unlink()  # the cause is gone; the retry is 600 s away: recover now
                recover = await _sluice("recover", "--connect-control", control)
                assert recover.returncode == 0, recover.stderr
                await _worker_state(control, "ready")
                assert (await _http(port, "/health"))[0] == 200
                healthy = await (await client.generate("The capital of France is",
                                                       max_tokens=4, temperature=0,
                                                       ignore_eos=True)).collect()
                assert healthy.finish_reason == "length" and len(healthy.token_ids) == 4
        await drained_and_consistent(control)
    finally:
        process.kill()
        process.wait()


def _starts_lost(log) -> int:
    """Worker starts the daemon's log says were lost to the test fault."""
    return sum(1 for line in log.read_text().splitlines()
               if '"worker lost"' in line and "exited with 3" in line)


async def test_a_failed_worker_is_retried_every_failed_retry_interval(
    tmp_path, drained_and_consistent, sluiced,
) -> None:
    fault = tmp_path / "no-worker"
    process, fields = sluiced(
        ["--config", _config(tmp_path, fault, retry_interval=1.0),
         "--listen", "tcp://127.0.0.1:0", "--control", f"ipc://{tmp_path}/control.sock"],
        log=tmp_path / "sluiced.log", log_level="warning", timeout=240)
    control = fields["control"]
    with trio.fail_after(120):
        fault.write_text("")
        os.kill((await fetch_status(control)).worker.pid, signal.SIGKILL)
        await _worker_state(control, "failed")
        restarts = (await fetch_status(control)).worker.restarts
        # retried while the cause lasts: each retry fails again and logs why
        failed = _starts_lost(tmp_path / "sluiced.log")
        while _starts_lost(tmp_path / "sluiced.log") < failed + 2:
            await trio.sleep(0.1)
        assert (await fetch_status(control)).worker.state == "failed"
        # status counts the retries as restarts too (it reports what the scheduler last heard)
        while (await fetch_status(control)).worker.restarts < restarts + 2:
            await trio.sleep(0.1)
        fault.unlink()  # the cause is gone: the next retry brings a worker back, unasked
        await _worker_state(control, "ready")
        async with AsyncClient(fields["listen"]) as client:
            result = await (await client.generate("Hello", max_tokens=3,
                                                  ignore_eos=True)).collect()
        assert result.finish_reason == "length"
    await drained_and_consistent(control)
