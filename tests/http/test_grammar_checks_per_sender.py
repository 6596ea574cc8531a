"""A slow grammar costs only its sender. Through the HTTP front of a daemon on the null
executor (a grammar's check needs no model), with two senders: while `a` floods schemas that
take longer to check than `limits.max_grammar_compile_ms`, each of them is refused (a 400
naming that limit, or a 429 naming `limits.max_grammar_checks_waiting` once `a` has that many
checks waiting behind its running one), and `b`'s json_schema requests are checked in a
process of their own, once for a burst of them, and served. The senders are two tenants with
keys, or, with no keys (as shipped), two clients told apart by their addresses. KV-checked at
the end."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx2
import openai
import pytest
import trio

from sluice.ipc.client import AsyncClient
from sluice.ipc.vocabulary import InvalidRequestError

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


@pytest.mark.parametrize("senders", ["tenants", "addresses"])
async def test_a_sender_flooding_slow_schemas_delays_no_other(null_daemon, senders) -> None:
    settings = {"http.listen": "127.0.0.1:0", "limits.max_grammar_compile_ms": LIMIT_MS,
                "limits.max_grammar_checks_waiting": 2}
    if senders == "tenants":
        settings["http.tenants"] = {"a": ["key-a"], "b": ["key-b"]}
        keys, a_party = ("key-a", "key-b"), "tenant 'a'"
        a_http = None
    else:  # no keys: every request is tenant `default`; `a` connects from another address
        keys, a_party = ("none", "none"), "client 127.0.0.2"
        a_http = httpx2.Client(transport=httpx2.HTTPTransport(local_address="127.0.0.2"))
    handle = await null_daemon(**settings)
    base = f"http://{handle.daemon.http_address}/v1"
    checks = handle.daemon._grammars
    b = openai.OpenAI(base_url=base, api_key=keys[1], max_retries=0, timeout=60)
    model = (await trio.to_thread.run_sync(b.models.list)).data[0].id

    a = openai.OpenAI(base_url=base, api_key=keys[0], max_retries=0, timeout=60,
                      http_client=a_http)

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
        while a_party not in checks._running:  # a's first slow check is running
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


async def test_strangers_on_the_plain_socket_do_not_queue_behind_each_other(null_daemon) -> None:
    """Over ZeroMQ without CURVE every client may name tenant `default`: each connection is a
    sender of its own. Three connections' slow schemas hold the one checking process and wait
    their turns; a fourth connection's schema waits at most one check of each, and is never
    refused as busy behind them (as one `default` sender it was: behind two waiting checks,
    past `max_grammar_checks_waiting = 1`)."""
    handle = await null_daemon(**{"limits.max_grammar_compile_ms": LIMIT_MS,
                                  "limits.max_grammar_checks_waiting": 1,
                                  "limits.grammar_check_processes": 1})
    checks = handle.daemon._grammars
    outcomes: list[str] = []

    async def stranger(i: int) -> None:
        async with AsyncClient(handle.listen) as client:
            with pytest.raises(InvalidRequestError) as refused:
                await client.generate("hi", max_tokens=2, json_schema=slow_schema(100 + i))
            outcomes.append(str(refused.value))

    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(stranger, i)
            while (checks.timed_out + len(checks._running)
                   + sum(map(len, checks._waiting.values()))) < 3:
                await trio.sleep(0.005)  # all three checked, or waiting their turns
            async with AsyncClient(handle.listen) as client:
                served = await (await client.generate("hi", max_tokens=2,
                                                      json_schema=PERSON)).collect()
    assert served.finish_reason in ("stop", "length")
    assert len(outcomes) == 3
    assert all(f"limits.max_grammar_compile_ms = {LIMIT_MS}" in o for o in outcomes), outcomes
    assert not checks._running and not checks._waiting
    await handle.check()
