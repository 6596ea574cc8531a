"""The worker's known-answer health check, with a real worker process: READY=1 comes once the
first worker passed it, and a restarted worker that gives another answer is refused — the
daemon does not serve on it, `/health` says 503, and no request or block is lost."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import trio
from support.daemon import NotifyListener

from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.control import fetch_status, send_command

pytestmark = pytest.mark.timeout(300)  # a hang fails this test instead of the suite

CONFIG = """
[worker]
num_blocks = 64
threads = 1
max_failed_starts = 2
backoff_initial = 0.05
debug_wrong_health_on_restart = true   # a test fault: restarted workers answer wrongly
"""


def health(port: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


async def test_a_worker_with_another_health_answer_is_refused(sluiced, drained_and_consistent,
                                                              tmp_path) -> None:
    config = tmp_path / "sluiced.toml"
    config.write_text(CONFIG)
    log = tmp_path / "sluiced.log"
    listener = NotifyListener(tmp_path / "notify.sock")
    process, fields = sluiced(
        ["--config", str(config), "--listen", "tcp://127.0.0.1:0", "--metrics-port", "0",
         "--control", f"ipc://{tmp_path}/control.sock"],
        env={"NOTIFY_SOCKET": listener.path}, log=log, timeout=240)
    control, port = fields["control"], fields["metrics"]
    await listener.wait_for("READY=1")
    ready = await fetch_status(control)
    assert ready.worker.state == "ready" and ready.worker.pid > 0  # checked before READY=1
    assert await trio.to_thread.run_sync(health, port) == 200
    with trio.fail_after(120):
        async with AsyncClient(fields["listen"]) as client:
            served = await (await client.generate("The capital of France is", max_tokens=4,
                                                  temperature=0, ignore_eos=True)).collect()
    assert served.finish_reason == "length" and len(served.token_ids) == 4

    assert (await send_command(control, m.RecoverCommand())).ok  # a new worker, which lies
    with trio.fail_after(180):
        while "health check answered" not in log.read_text():
            await trio.sleep(0.2)
    status = await fetch_status(control)
    assert status.worker.state != "ready"
    assert await trio.to_thread.run_sync(health, port) == 503
    assert listener.drain().count("READY=1") == 1  # never announced ready on a refused worker
    await drained_and_consistent(control)
    process.kill()  # it would only keep refusing workers
    await trio.to_thread.run_sync(process.wait)


async def test_no_ready_while_the_worker_fails_its_health_check(tmp_path) -> None:
    """The health forward computes the health prompt, and the worker is told to fail every
    step that computes one of its tokens: the daemon must never say READY."""
    from sluice.actors.executor.worker import HEALTH_PROMPT

    config = tmp_path / "sluiced.toml"
    config.write_text(CONFIG.replace("debug_wrong_health_on_restart = true",
                                     f"debug_fail_token = {HEALTH_PROMPT[1]}"))
    log = tmp_path / "sluiced.log"
    listener = NotifyListener(tmp_path / "notify.sock")
    stdout = tmp_path / "stdout"
    with open(log, "w") as stderr, open(stdout, "w") as out:
        process = subprocess.Popen(  # files, not pipes: a worker child may outlive the kill
            [sys.executable, "-m", "sluice.daemon.main", "serve", "--config", str(config),
             "--listen", "tcp://127.0.0.1:0", "--control", f"ipc://{tmp_path}/control.sock"],
            stdout=out, stderr=stderr, text=True,
            env={**os.environ, "NOTIFY_SOCKET": listener.path})
    try:
        with trio.fail_after(240):
            while log.read_text().count("health check failed") < 2 and process.poll() is None:
                await trio.sleep(0.2)
        assert log.read_text().count("health check failed") >= 2
        assert "READY=1" not in listener.drain()
    finally:
        process.kill()
        process.wait(timeout=30)
    assert "sluiced ready" not in stdout.read_text()
