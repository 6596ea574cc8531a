"""Logs are JSON lines off a TTY, name requests by id with lengths, and never carry prompt or
output text: a load whose prompts carry a unique marker leaves no line containing it."""

from __future__ import annotations

import json
import signal

import pytest
import structlog
import trio

from sluice.daemon.logs import configure_logging
from sluice.ipc.client import AsyncClient

pytestmark = pytest.mark.timeout(240)  # a hang fails this test instead of the suite

MARKER = "qzv-PRIVATE-7731"


async def test_a_marked_load_leaves_no_trace_of_its_text_in_the_logs(
        sluiced, tmp_path, drained_and_consistent) -> None:
    log = tmp_path / "sluiced.log"
    config = tmp_path / "sluiced.toml"
    config.write_text("[limits]\nopen_tenants = true\n")  # the client names its own tenant
    process, fields = sluiced(["--executor", "null", "--listen", "tcp://127.0.0.1:0",
                               "--control", f"ipc://{tmp_path}/control.sock",
                               "--config", str(config), "--log-level", "debug"], log=log)
    with trio.fail_after(60):
        async with AsyncClient(fields["listen"], tenant=f"t-{MARKER[:3]}") as client:
            for i in range(4):
                await (await client.generate(f"{MARKER} prompt {i}", max_tokens=8)).collect()
            await (await client.generate(messages=[{"role": "user", "content": MARKER}],
                                         max_tokens=4)).collect()
            await (await client.generate("plain", max_tokens=30, stop=[MARKER, "lazy"])).collect()
            cancelled = await client.generate(MARKER * 3, max_tokens=3000)
            await cancelled.cancel()
    await drained_and_consistent(fields["control"])
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)
    lines = log.read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    ended = [r for r in records if r["event"] == "request ended"]
    assert len(ended) == 7
    assert all(r["prompt_tokens"] > 0 and r["tenant"] == "t-qzv" for r in ended)
    assert sorted(r["client_request_id"] for r in ended) == [str(i) for i in range(1, 8)]
    assert len({r["request_id"] for r in ended}) == 7  # the daemon's own ids are unique
    assert not [line for line in lines if MARKER in line]


def test_fields_named_for_text_are_redacted(capsys) -> None:
    saved = structlog.get_config()
    try:
        configure_logging("info", json=True)
        structlog.get_logger("t").info("careless", prompt=MARKER, output=MARKER, tokens=3)
    finally:
        structlog.configure(**saved)
    line = capsys.readouterr().err.strip()
    assert MARKER not in line and json.loads(line)["tokens"] == 3


@pytest.mark.parametrize("chosen, is_json", [("console", False), ("json", True), ("", True)])
def test_the_log_format_can_be_chosen_whatever_stderr_is(capsys, monkeypatch, chosen,
                                                          is_json) -> None:
    """Under pytest stderr is no TTY, so JSON is the default; `SLUICE_LOG_FORMAT` overrides."""
    monkeypatch.setenv("SLUICE_LOG_FORMAT", chosen)
    saved = structlog.get_config()
    try:
        configure_logging("info")
        structlog.get_logger("t").info("hello", tokens=3)
    finally:
        structlog.configure(**saved)
    line = capsys.readouterr().err.strip()
    assert "hello" in line
    try:
        parsed = json.loads(line)
    except ValueError:
        parsed = None
    assert (parsed is not None and parsed["tokens"] == 3) is is_json
