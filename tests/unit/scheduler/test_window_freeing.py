"""The scheduler core with a model whose every layer attends within a window: blocks behind
the window go back to the pool as requests run, never one a planned query may still see,
through shared prefixes, chunked prefills, preemption under a small pool and recompute."""

from __future__ import annotations

import math
import random

from sluice.actors.scheduler import Scheduler, SchedulerConfig

from support.scheduler import FakeClock, req, sample_all

WINDOW, BLOCK, POOL = 10, 4, 20
MOST_HELD = math.ceil(WINDOW / BLOCK) + 1


def run(kv_window: int, seed: int) -> Scheduler:
    """Twelve requests of three shared prefixes arriving over time, run to the end in a pool
    of 20 blocks. After every plan, the blocks of each query's window are the request's own;
    after every step the invariants hold and a decoding request holds at most the blocks its
    window spans (plus the one being filled)."""
    config = SchedulerConfig(policy="fcfs", block_size=BLOCK, kv_blocks=POOL,
                             max_prefill_chunk=9, kv_high_watermark=1.0, kv_low_watermark=1.0)
    sched = Scheduler(config, max_model_len=256, kv_window=kv_window, clock=FakeClock())
    kv = sched.kv_cache
    rng = random.Random(seed)
    arrivals = [req(f"r{i}", prompt_len=rng.randrange(3, 30), max_tokens=rng.randrange(1, 40),
                    first=1000 * rng.randrange(3)) for i in range(12)]
    for _ in range(3000):
        if arrivals and rng.random() < 0.3:
            sched.add_request(arrivals.pop())
        if not arrivals and not sched.has_unfinished():
            break
        plan = sched.schedule()
        for seq in plan.seqs:
            request = sched.requests[seq.request_id]
            first_seen = max(0, seq.start_pos - WINDOW + 1) // BLOCK if kv_window else 0
            assert first_seen >= request.num_unseen_blocks, (seq, request.num_unseen_blocks)
            for block in seq.block_table[first_seen:]:
                assert block in request.held_block_ids and kv.ref_count(block) > 0
        sched.update(plan, sample_all(plan, token=rng.randrange(50)))
        sched.check_invariants()
        for request in sched.requests.values():
            if kv_window and request.output_token_ids and request.block_ids:
                assert len(request.held_block_ids) <= MOST_HELD, request
    else:
        raise AssertionError("the requests did not finish")
    assert kv.num_used_blocks == 0
    sched.check_invariants()
    return sched


def test_blocks_behind_the_window_go_back_and_none_a_query_sees() -> None:
    freeing = [run(WINDOW, seed) for seed in range(4)]
    assert all(s.kv_cache.window == WINDOW for s in freeing)
    keeping = [run(0, seed) for seed in range(4)]
    # the same requests in the same pool: holding fewer blocks, they are preempted less
    assert sum(s.num_preemptions for s in freeing) < sum(s.num_preemptions for s in keeping)
    assert sum(s.kv_cache.cache_hits for s in freeing) > 0  # the prefixes were shared
