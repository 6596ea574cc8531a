"""A request's usage record, built from the same parts wherever its end is last seen.

Its Stream builds it when the request's `Finished` leaves for the client (only the Stream
knows when the first token and the end left the daemon); the Tokenizer, for a request its
Stream gave up without waiting (the client vanished, the stream failed). Either way from the
client's `Usage`, the points of `Timings` and the scheduler core's `RequestCost`. No actor here:
the Usage actor (`actor.py`) takes the records.
"""

from __future__ import annotations

import dataclasses
import datetime

from sluice.actors.front.limits import Limits, clip
from sluice.actors.runtime.reports import UsageRecord, UsageSums
from sluice.actors.scheduler.plan import RequestCost
from sluice.ipc import messages as m


def since(mark: float, received: float) -> float:
    """A point on the monotonic clock as seconds after `received` (0.0: it never happened)."""
    return max(0.0, mark - received) if mark else 0.0


def core_points(cost: RequestCost | None, received: float) -> dict[str, float]:
    """The points the scheduler core saw, as `Timings` fields."""
    if cost is None:
        return {}
    return {"queued": since(cost.queued, received), "scheduled": since(cost.scheduled, received),
            "prefill_done": since(cost.prefill_done, received)}


def complete(timings: m.Timings, *, first_token: float, finished: float,
             completion_tokens: int) -> m.Timings:
    """`timings` with the delivery points (seconds after receipt) and the derived spans."""
    t = dataclasses.replace(timings, first_token=first_token, finished=finished)
    queue = t.scheduled - t.queued if t.scheduled and t.queued else 0.0
    prefill = t.prefill_done - t.scheduled if t.prefill_done and t.scheduled else 0.0
    tpot = 0.0
    if first_token and finished and completion_tokens > 1:
        tpot = (finished - first_token) / (completion_tokens - 1)
    return dataclasses.replace(t, queue=max(0.0, queue), prefill=max(0.0, prefill),
                               ttft=first_token, tpot=max(0.0, tpot), e2e=finished)


def record(*, usage_id: str, client_id: str, tenant: str, reason: m.FinishReason,
           usage: m.Usage, timings: m.Timings, cost: RequestCost | None, start: float,
           end: float, limits: Limits) -> UsageRecord:
    """The usage record of an ended request, its `timings` complete."""
    sums = UsageSums(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens,
                     usage.recomputed_tokens)
    if cost is not None:
        sums = dataclasses.replace(sums, preemptions=cost.preemptions,
                                   kv_block_seconds=cost.kv_block_seconds,
                                   compute_seconds=cost.compute_seconds)
    return UsageRecord(
        usage_id, clip(client_id, limits), cost.tenant if cost is not None else tenant,
        cost.configured if cost is not None else False, start, end, reason.name.lower(), sums,
        timings)


def as_json(rec: UsageRecord) -> dict:
    """A record as its usage-file line: wall-clock times in ISO 8601 UTC."""
    body = dataclasses.asdict(rec)
    del body["configured"]
    body.update(body.pop("sums"))  # the summed quantities stand at the top, each by name
    body["start"], body["end"] = _utc(rec.start), _utc(rec.end)
    return {"event": "usage", **body}


def _utc(seconds: float) -> str:
    moment = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
