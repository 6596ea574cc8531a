"""An actor's address says where it runs, and its code does not change with it: the Tokenizer
actor, run in a process of its own on an `ipc://` inbox, takes a request and a step's outputs
from this process over sockets and answers with the messages it sends inside the daemon."""

from __future__ import annotations

import subprocess
import sys
import time

import trio

from sluice.actors.runtime import messages as am
from sluice.actors.runtime.base import Inbox, Outbox
from sluice.actors.scheduler.plan import StepOutputs
from sluice.ipc import messages as m

# the actor as the daemon makes it, but for its addresses
ACTOR_PROCESS = """
import sys, trio
from sluice.actors.runtime.base import Inbox, Outbox
from sluice.actors.text import load_tokenizer
from sluice.actors.text.actor import Tokenizer
model, inbox, scheduler = sys.argv[1:4]
actor = Tokenizer(load_tokenizer(model), scheduler=Outbox(scheduler),
                  inbox=Inbox("tokenizer", address=inbox))
trio.run(actor.run)
"""


async def _next(inbox: Inbox, kind: type):
    """The next message of `kind` (the actor also reports its inbox's depth, `Backlog`)."""
    with trio.fail_after(60):
        while not isinstance(msg := await inbox.get(), kind):
            pass
    return msg


async def test_the_tokenizer_actor_serves_from_its_own_process(
        tmp_path, smollm_path, smollm_tokenizer) -> None:
    addresses = {name: f"ipc://{tmp_path}/{name}" for name in ("tokenizer", "scheduler", "stream")}
    scheduler = Inbox("scheduler", address=addresses["scheduler"])
    stream = Inbox("stream", address=addresses["stream"])
    tokenizer = Outbox(addresses["tokenizer"])
    process = subprocess.Popen([sys.executable, "-c", ACTOR_PROCESS, str(smollm_path),
                                addresses["tokenizer"], addresses["scheduler"]])
    try:
        prompt = "The capital of France is"
        generate = m.Generate("r1", prompt=prompt, sampling=m.SamplingParams(max_tokens=4))
        tokenizer.put(am.Encode(generate, "c0/r1", b"c0", addresses["stream"],
                                time.monotonic(), "u-1"))
        admit = await _next(scheduler, am.Admit)
        assert admit.request_id == "c0/r1"
        assert list(admit.prompt_ids) == smollm_tokenizer.encode(prompt)
        assert admit.sampling == generate.sampling

        token = smollm_tokenizer.encode(" Paris")[-1]
        tokenizer.put(am.StepOutputs(StepOutputs(["c0/r1"], [token]),
                                     (("c0/r1", len(admit.prompt_ids)),)))
        deliver = await _next(stream, am.Deliver)
        assert deliver.before == (m.Accepted("r1", len(admit.prompt_ids)),)
        assert list(deliver.chunks()) == [m.Chunk("r1", " Paris", (token,))]
    finally:
        process.kill()
        process.wait()
        for box in (scheduler, stream, tokenizer):
            box.close()
