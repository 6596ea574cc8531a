"""An operator who drains sees how many clients were turned away meanwhile: requests refused
because the daemon was draining, on the client socket and over HTTP, are counted in
`sluice status` and in `/metrics`, and the count stays after a resume."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import trio

from sluice.daemon.commands.status import run as status_command
from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.control import fetch_status, send_command
from sluice.ipc.vocabulary import SluiceError

from support.daemon import http_get, samples

pytestmark = pytest.mark.timeout(120)


async def http_post(address: str, path: str, body: dict) -> int:
    def post() -> int:
        request = urllib.request.Request(f"http://{address}{path}", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return reply.status
        except urllib.error.HTTPError as exc:
            return exc.code

    return await trio.to_thread.run_sync(post)


async def test_refusals_while_draining_are_counted_in_status_and_metrics(
        null_daemon, capsys) -> None:
    handle = await null_daemon(metrics_port=0, **{"http.listen": "127.0.0.1:0"})
    http, port = handle.daemon.http_address, handle.daemon.metrics_port
    completion = {"model": handle.daemon.http.model_name, "prompt": "hi", "max_tokens": 2}
    with trio.fail_after(60):
        async with AsyncClient(handle.listen) as client:
            await (await client.generate("served", max_tokens=2)).collect()
            assert await http_post(http, "/v1/completions", completion) == 200
            assert (await fetch_status(handle.control)).gateway.drain_refusals == 0

            await send_command(handle.control, m.DrainCommand())
            for _ in range(2):
                with pytest.raises(SluiceError, match="draining"):
                    await client.generate("turned away", max_tokens=2)
            assert await http_post(http, "/v1/completions", completion) == 503
            report = await fetch_status(handle.control)
            assert report.gateway.drain_refusals == 3

            await send_command(handle.control, m.ResumeCommand())
            while (await fetch_status(handle.control)).state != "serving":
                await trio.sleep(0.02)
            await (await client.generate("served again", max_tokens=2)).collect()
    assert (await fetch_status(handle.control)).gateway.drain_refusals == 3
    _, text = await http_get(port, "/metrics")
    assert samples(text)[("sluice_drain_refusals_total", ())] == 3

    class Args:
        connect_control, check, timeout, json = handle.control, False, 5.0, False

    capsys.readouterr()
    assert await trio.to_thread.run_sync(status_command, Args) == 0
    assert "while draining 3" in capsys.readouterr().out
