"""An actor that keeps crashing exhausts its restart budget and takes the daemon down."""

from __future__ import annotations

import pytest
import trio
from support.daemon import assert_drained_and_consistent

from sluice.actors.scheduler import Scheduler
from sluice.actors.runtime.supervisor import Escalation
from sluice.daemon.config import load_config
from sluice.daemon.server import Daemon
from sluice.ipc.client import AsyncClient


def always_failing_schedule(self, *args, **kwargs):
    # the actor's own work, not one request's (a request's own failure ends it alone and
    # never restarts its actor): planning a step fails for every incarnation
    raise RuntimeError("injected persistent fault")


async def test_restart_budget_exhausted_escalates_out_of_the_daemon(tmp_path,
                                                                    monkeypatch) -> None:
    config = load_config(None, {"listen": "tcp://127.0.0.1:0", "executor": "null",
                                "control": f"ipc://{tmp_path}/control.sock"})
    daemon = Daemon(config)
    budget = daemon.supervisor.policy.max_restarts
    reasons = []
    with pytest.RaisesGroup(Escalation, flatten_subgroups=True):
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                await nursery.start(daemon.run)
                monkeypatch.setattr(Scheduler, "schedule", always_failing_schedule)
                async with AsyncClient(daemon.listen_address) as client:
                    for _ in range(budget):
                        generation = await client.generate("boom", max_tokens=2)
                        reasons.append((await generation.collect()).finish_reason)
                    # every crash so far released what its request held; the next one ends
                    # the daemon, so its KV is checked now
                    await assert_drained_and_consistent(daemon.control_address)
                    generation = await client.generate("boom", max_tokens=2)
                    reasons.append((await generation.collect()).finish_reason)
                await trio.sleep_forever()  # the escalation ends this
    # each crash within the budget ended its request with an error; the crash past the
    # budget stops the daemon before anything more is sent
    assert reasons == ["error"] * budget
