"""A ZeroMQ client's grammar is checked at the edge as an HTTP one is: one the engine cannot
follow (a JSON schema, a regex or a Lark grammar that does not build) or one over
`limits.max_grammar_bytes` is refused with `Rejected(invalid)` naming `sampling.grammar`
and saying why, before the scheduler ever admits it; a good one is served. A daemon on the
null executor (the check needs no model), KV-checked at the end."""

from __future__ import annotations

import pytest
import trio

from sluice.actors.front.limits import Limits
from sluice.ipc.client import AsyncClient
from sluice.ipc.vocabulary import InvalidRequestError

pytestmark = pytest.mark.timeout(120)


async def test_a_grammar_the_engine_cannot_follow_is_refused_before_admission(
        null_daemon) -> None:
    daemon = await null_daemon()
    huge = {"type": "object", "properties": {
        f"field_{i}": {"type": "string"} for i in range(Limits().max_grammar_bytes // 20)}}
    bad = [({"json_schema": {"type": "nonsense"}}, "nonsense"),
           ({"regex": "(unclosed"}, "regex"),
           ({"grammar": "start: ("}, "expected token"),
           ({"json_schema": huge}, "limits.max_grammar_bytes")]
    with trio.fail_after(60):
        async with AsyncClient(daemon.listen) as client:
            for _ in range(2):  # the second time, the verdict remembered
                for constraint, said in bad:
                    with pytest.raises(InvalidRequestError) as refused:
                        await client.generate("hi", max_tokens=4, **constraint)
                    assert refused.value.field == "sampling.grammar", constraint
                    assert said in str(refused.value).lower(), (said, str(refused.value))
            before = await daemon.status()
            assert before.counters.accepted == 0  # none of them reached the scheduler
            good = await (await client.generate("hi", max_tokens=4,
                                                regex="(ab|cd)+")).collect()
            # the connection goes on after its refusals, and its good requests are served
            plain = await (await client.generate("hi", max_tokens=3)).collect()
    assert good.finish_reason in ("stop", "length") and plain.finish_reason == "length"
    after = await daemon.check()
    assert after.counters.accepted == 2
