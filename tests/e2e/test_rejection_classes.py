"""Each rejection code reaches the application as its own exception class (docs/wire-protocol.md:
"Each rejection code has its own exception class"), raised by the client library against a real
daemon for every code a daemon sends to a connected client."""

from __future__ import annotations

import pytest
import trio

from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.control import send_command
from sluice.ipc.errors import error_for
from sluice.ipc.vocabulary import (
    REJECTED_ERRORS, DrainingError, InvalidRequestError, OverloadedError, QuotaError, RejectedError,
    TooLongError,
)

pytestmark = pytest.mark.timeout(120)  # a hang fails this test instead of the suite


def test_every_code_has_a_class_of_its_own() -> None:
    assert set(REJECTED_ERRORS) == set(m.RejectCode)
    assert len(set(REJECTED_ERRORS.values())) == len(m.RejectCode)
    for code, cls in REJECTED_ERRORS.items():
        error = error_for(m.Rejected("r", code, "why", "field"))
        assert type(error) is cls and isinstance(error, RejectedError) and error.code is code


async def test_the_client_raises_the_class_of_each_code_the_daemon_sends(null_daemon) -> None:
    daemon = await null_daemon(**{"null.max_model_len": 64},
                               scheduler={"tenants": {"capped": {"max_new_tokens": 2}}})
    with trio.fail_after(60):
        async with AsyncClient(daemon.listen) as client:
            with pytest.raises(InvalidRequestError) as invalid:
                await client.generate("hi", top_p=7.0)
            assert invalid.type is InvalidRequestError
            with pytest.raises(TooLongError):
                await client.generate(prompt_ids=[5] * 100)
        async with AsyncClient(daemon.listen, tenant="capped") as capped:
            with pytest.raises(QuotaError) as quota:
                await capped.generate("hi", max_tokens=10)
            assert quota.value.field == "sampling.max_tokens"  # the wire's name for it
            # the same client within its tenant's limit is served
            assert (await (await capped.generate("hi", max_tokens=2)).collect()).finish_reason \
                == "length"
        assert (await send_command(daemon.control, m.DrainCommand())).ok
        async with AsyncClient(daemon.listen) as client:
            with pytest.raises(DrainingError):
                await client.generate("hi", max_tokens=2)
        assert (await send_command(daemon.control, m.ResumeCommand())).ok


async def test_a_full_queue_raises_overloaded(null_daemon) -> None:
    daemon = await null_daemon(scheduler={"max_queued": 1,
                                          "tenants": {"one": {"max_running": 1}}})
    with trio.fail_after(30):
        async with AsyncClient(daemon.listen, tenant="one", credit_window=1) as client:
            running = await client.generate("hi", max_tokens=1000)  # held: no credits
            waiting = await client.generate("hi", max_tokens=2)  # tenant at max_running
            with pytest.raises(OverloadedError):
                await client.generate("hi", max_tokens=2)
            await running.cancel()
            assert (await waiting.collect()).finish_reason == "length"
