"""Numbers an operator command must not carry (a negative, NaN or infinite drain deadline, an
infinite or vanishing tenant weight, an integer past 2**53): the `sluice` commands refuse them
in one line before sending, and the Control actor, a shared actor, answers them on the wire
with `Rejected` naming the field, without crashing and without doing any of the command: the
daemon keeps serving."""

from __future__ import annotations

import subprocess
import sys

import pytest
import trio

from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.control import send_command
from sluice.ipc.vocabulary import InvalidRequestError

pytestmark = pytest.mark.timeout(120)

BAD_COMMANDS = [
    ("deadline", m.DrainCommand(-1.0)),
    ("deadline", m.DrainCommand(float("nan"))),
    ("deadline", m.DrainCommand(float("inf"))),
    ("weight", m.TenantSet("batch", weight=float("nan"))),
    ("weight", m.TenantSet("batch", weight=float("inf"))),
    ("weight", m.TenantSet("batch", weight=1e-320)),
    ("max_running", m.TenantSet("batch", max_running=2**63)),
    ("input_tokens_per_minute", m.TenantSet("batch", input_tokens_per_minute=2**62)),
    ("max_queue_wait", m.TenantSet("batch", max_queue_wait=float("nan"))),
]


async def sluice(*args: str) -> subprocess.CompletedProcess:
    return await trio.to_thread.run_sync(lambda: subprocess.run(
        [sys.executable, "-m", "sluice.daemon.cli", *args], capture_output=True, text=True,
        timeout=60))


async def assert_serving(handle) -> None:
    """Not draining, and a request is answered."""
    assert (await handle.status()).state == "serving"
    async with AsyncClient(handle.listen) as client:
        generation = await client.generate("x", max_tokens=3, temperature=0)
        async for _ in generation:
            pass
    assert generation.result.finish_reason == "length"


async def test_the_control_actor_rejects_bad_numbers_and_keeps_serving(null_daemon) -> None:
    handle = await null_daemon()
    with trio.fail_after(60):
        for field, command in BAD_COMMANDS:
            with pytest.raises(InvalidRequestError) as refused:
                await send_command(handle.control, command, timeout=10)
            assert refused.value.field == field, (command, refused.value)
            assert field in refused.value.message
        assert handle.daemon.supervisor.restarts.get("control", 0) == 0  # it never crashed
        await assert_serving(handle)
        # a good deadline still drains
        answer = await send_command(handle.control, m.DrainCommand(5.0))
        assert answer.ok and (await handle.status()).state == "draining"
        await send_command(handle.control, m.ResumeCommand())
        await assert_serving(handle)


@pytest.mark.parametrize(("args", "flag"), [
    (("drain", "--deadline", "-1"), "--deadline"),
    (("drain", "--deadline", "nan"), "--deadline"),
    (("drain", "--deadline", "inf"), "--deadline"),
    (("tenants", "set", "batch", "--weight", "inf"), "--weight"),
    (("tenants", "set", "batch", "--max-running", str(2**63)), "--max-running"),
    (("tenants", "set", "batch", "--request-timeout", "nan"), "--request-timeout"),
])
async def test_the_cli_refuses_bad_numbers_in_one_line(null_daemon, args, flag) -> None:
    handle = await null_daemon()
    with trio.fail_after(60):
        done = await sluice(*args, "--connect-control", handle.control)
        assert done.returncode == 2, done
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and flag in lines[0] and args[-1] in lines[0], done.stderr
        await assert_serving(handle)
