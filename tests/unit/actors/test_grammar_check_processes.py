"""The processes that check grammars (`intake.GrammarChecks`): a process that ended while
idle is replaced, and the grammar checked next is not blamed for it; a check whose request
goes away ends its process and gives its place back, so the next check is answered."""

from __future__ import annotations

import json

import trio

from sluice.actors.front.intake import GrammarChecks
from sluice.actors.front.limits import Limits

SLOW = json.dumps({"type": "object", "properties": {
    f"k{j}": {"type": "integer", "minimum": -123456789123456789 + 7919 * j,
              "maximum": 987654321987654321 - 104729 * j} for j in range(400)}})


async def test_a_dead_idle_process_is_replaced_and_a_cancelled_check_gives_its_place_back():
    checks = GrammarChecks(Limits(grammar_check_processes=1))
    try:
        with trio.fail_after(60):
            assert await checks.problem("regex", "(ab)+", "t") == ""
            (idle,) = checks._idle
            idle.process.kill()
            await idle.process.wait()
            assert await checks.problem("regex", "[0-9]+", "t") == ""  # a new process
            assert idle not in checks._idle and len(checks._idle) == 1
            assert "regex" in await checks.problem("regex", "(unclosed", "t")

            with trio.move_on_after(0.05):  # the request goes away mid-check
                await checks.problem("json_schema", SLOW, "t")
            assert not checks._running and checks._processes == 0
            assert await checks.problem("json_schema", '{"type": "string"}', "u") == ""
            assert checks._processes == 1 and not checks._waiting and not checks._pending
    finally:
        checks.close()


async def test_the_tenants_waiting_take_the_process_in_turn():
    """One process: tenant a's second check, queued before c's, runs after it, as a's first
    check had its turn."""
    checks = GrammarChecks(Limits(grammar_check_processes=1))
    order: list[str] = []

    async def check(tenant: str, pattern: str) -> None:
        assert await checks.problem("regex", pattern, tenant) == ""
        order.append(tenant)

    try:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(check, "a", "(a1)+")
                while "a" not in checks._running:
                    await trio.sleep(0)
                nursery.start_soon(check, "a", "(a2)+")
                while len(checks._waiting.get("a", ())) < 1:
                    await trio.sleep(0)
                nursery.start_soon(check, "c", "(c1)+")
                while "c" not in checks._waiting:
                    await trio.sleep(0)
        assert order == ["a", "c", "a"]
    finally:
        checks.close()
