"""A slow grammar costs only its sender. Through the HTTP front of a daemon on the null
executor (a grammar's check needs no model), with two tenants: while tenant `a` floods
schemas that take longer to check than `limits.max_grammar_compile_ms`, each of them is
refused (a 400 naming that limit, or a 429 naming `limits.max_grammar_checks_waiting` once
`a` has that many checks waiting behind its running one), and tenant `b`'s json_schema
requests are checked in a process of their own, once for a burst of them, and served.
KV-checked at the end."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import trio

pytestmark = pytest.mark.timeout(120)

LIMIT_MS = 100
PERSON = {"type": "object", "properties": {"name": {"type": "string"}},
          "required": ["name"], "additionalProperties": False}


def slow_schema(i: int) -> dict:
    """A schema whose check takes several times `LIMIT_MS` (each integer range becomes a
    lexer of its own), different for each `i` so that none is a remembered verdict."""
    return {"type": "object", "properties": {
        f"k{j}": {"type": "integer", "minimum": -123456789123456789 + 7919 * j + i,
                  "maximum": 987654321987654321 - 104729 * j} for j in range(400)}}


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


async def test_a_tenant_flooding_slow_schemas_delays_no_other_tenant(null_daemon) -> None:
    handle = await null_daemon(**{
        "http.listen": "127.0.0.1:0", "http.tenants": {"a": ["key-a"], "b": ["key-b"]},
        "limits.max_grammar_compile_ms": LIMIT_MS, "limits.max_grammar_checks_waiting": 2})
    base = f"http://{handle.daemon.http_address}/v1"
    checks = handle.daemon._grammars
    b = openai.OpenAI(base_url=base, api_key="key-b", max_retries=0, timeout=60)
    model = (await trio.to_thread.run_sync(b.models.list)).data[0].id

    a = openai.OpenAI(base_url=base, api_key="key-a", max_retries=0, timeout=60)

    def a_sends(i: int) -> openai.APIStatusError:
        with pytest.raises(openai.APIStatusError) as refused:
            a.chat.completions.create(model=model, max_tokens=4,
                                      messages=[{"role": "user", "content": "hi"}],
                                      response_format=schema_format(slow_schema(i)))
        return refused.value

    def b_sends():
        return b.chat.completions.create(model=model, max_tokens=4,
                                         messages=[{"role": "user", "content": "hi"}],
                                         response_format=schema_format(PERSON))

    with trio.fail_after(90), ThreadPoolExecutor(15) as pool:
        first = pool.submit(a_sends, 0)
        while "a" not in checks._running:  # a's first slow check is running
            await trio.sleep(0.005)
        flood = [pool.submit(a_sends, i) for i in range(1, 9)]
        # a burst of b's requests with one new schema: one check, which the others wait for
        # without a place among b's checks waiting
        burst = [pool.submit(b_sends) for _ in range(6)]
        # (the daemon runs on this event loop: the answers are waited for off it)
        served = [await trio.to_thread.run_sync(f.result) for f in burst]
        answers = [await trio.to_thread.run_sync(f.result) for f in [first, *flood]]

    assert all(c.choices[0].finish_reason in ("stop", "length") for c in served)
    statuses = [answer.status_code for answer in answers]
    for answer in answers:
        if answer.status_code == 400:  # checked, and out of time: its process killed
            assert f"limits.max_grammar_compile_ms = {LIMIT_MS}" in answer.message, answer
            assert answer.body["param"].startswith("response_format"), answer.body
        else:  # a's checks waiting behind its running one were already at the limit
            assert answer.status_code == 429, answer
            assert "limits.max_grammar_checks_waiting = 2" in answer.message, answer
            assert answer.response.headers["retry-after"]
    assert statuses[0] == 400 and 429 in statuses, statuses
    # the timed-out checks' processes were killed and replaced, and none is left running
    assert checks.timed_out == statuses.count(400)
    assert not checks._running and not checks._waiting
    assert len(checks._idle) == checks._processes <= 2
    for process in (checker.process for checker in checks._idle):
        assert process.returncode is None
    await handle.check()
