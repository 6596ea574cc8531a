"""The KV invariant and the scheduler's consistency, checked between two steps.

Every live request sits in exactly the one place its state says (queued, running or paused)
and holds exactly the blocks its computed tokens need; every referenced block is owned by a
live request as often as it is referenced, and no live request owns a free block; the tenant
ledger's counters match the live requests. Each owner checks its own books here
(`KVCacheManager.check_consistency` and `ownership_problems`, `TenantLedger.counter_problems`),
against the places of the request table. Tests call it (through
`Scheduler.check_invariants`) after every scenario; the daemon's `reconcile` and
`status --check` run it too. Nothing here changes anything.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from sluice.actors.scheduler.kv_cache import KVCacheManager
from sluice.actors.scheduler.request import Request, RequestState
from sluice.actors.scheduler.request_table import RequestTable
from sluice.actors.scheduler.tenant_ledger import TenantLedger

_QUEUED = (RequestState.WAITING, RequestState.PREEMPTED)
_HOLDING = (RequestState.PREFILLING, RequestState.DECODING)


def block_owners(requests: Iterable[Request]) -> Counter[int]:
    """How many of `requests` list each block."""
    owners: Counter[int] = Counter()
    for request in requests:
        owners.update(request.held_block_ids)
    return owners


def check_invariants(table: RequestTable, kv_cache: KVCacheManager, ledger: TenantLedger) -> None:
    """Raise AssertionError describing every broken rule."""
    requests, waiting, paused = table.requests, table.waiting, table.paused
    running, prefilling = table.running, table.prefilling
    kv_cache.check_consistency()
    problems: list[str] = []
    actual: dict[str, list[int]] = {}  # tenant -> [live, waiting, running]
    for rid, request in requests.items():
        state, blocks, held = request.state, request.block_ids, request.held_block_ids
        if len(set(held)) != len(held):
            problems.append(f"{rid} lists a block twice: {blocks}")
        unseen = request.num_unseen_blocks
        if unseen and (not kv_cache.window or blocks[:unseen] != [blocks[unseen]] * unseen
                       or unseen > max(0, request.num_computed_tokens - kv_cache.window + 1)
                       // kv_cache.block_size):
            problems.append(f"{rid} gave back {unseen} blocks its window may still see "
                            f"(window {kv_cache.window}, {request.num_computed_tokens} "
                            f"computed tokens) or does not stand in for them: {blocks}")
        expected = kv_cache.blocks_for(request.num_computed_tokens)
        if len(blocks) != expected:
            problems.append(
                f"{rid} ({state.value}) holds {len(blocks)} blocks for "
                f"{request.num_computed_tokens} computed tokens, expected {expected}"
            )
        places = [
            name
            for name, here in (
                ("waiting", request.in_queue),
                ("running", rid in running),
                ("paused", rid in paused),
            )
            if here
        ]
        if len(places) != 1:
            problems.append(f"{rid} ({state.value}) is in {places or 'no queue'}")
        expected_place = (
            "waiting"
            if state in _QUEUED
            else "running"
            if state in _HOLDING
            else "paused"
            if state is RequestState.PAUSED
            else "none"
        )
        if places and places[0] != expected_place:
            problems.append(f"{rid} is {state.value} but sits in {places[0]}")
        if state in _QUEUED and blocks:
            problems.append(f"{rid} waits in the queue while holding {len(blocks)} blocks")
        if (rid in prefilling) != (state is RequestState.PREFILLING):
            problems.append(f"{rid} ({state.value}) prefilling table mismatch")
        counts = actual.setdefault(request.tenant, [0, 0, 0, 0])
        counts[0] += 1
        counts[1] += request.in_queue
        counts[2] += rid in running
        counts[3] += rid in paused
    for table_name, table in (("running", running), ("paused", paused), ("prefilling", prefilling)):
        problems += [
            f"{rid} is in {table_name} but not live" for rid in table if rid not in requests
        ]
    queued = sum(counts[1] for counts in actual.values())
    if queued != len(waiting):
        problems.append(f"queue length {len(waiting)} but {queued} requests queued")
    problems += kv_cache.ownership_problems(block_owners(requests.values()))
    problems += ledger.counter_problems(actual)
    stale = waiting.tenants - {name for name, counts in actual.items() if counts[1]}
    if stale:
        problems.append(f"wait queue keeps heaps of tenants with nothing queued: {stale}")
    if problems:
        raise AssertionError("scheduler inconsistent: " + "; ".join(problems))
