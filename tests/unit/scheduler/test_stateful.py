"""Property test: random arrivals, steps, cancels, finishes, pauses and worker losses.

After every action the KV bookkeeping holds, no request sits in two queues, and over the whole
run each request ends exactly once; a request that ended never produces output again.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from support.scheduler import FakeClock

from sluice.actors.scheduler import Request, Scheduler, SchedulerConfig
from sluice.actors.scheduler.plan import StepResult
from sluice.ipc.vocabulary import RejectedError, SamplingParams

EOS = 2
PREFIXES = [list(range(100, 112)), list(range(200, 205))]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from(["fcfs", "priority", "srpt", "fair"]),
        order=st.sampled_from(["decode_first", "prefill_first"]),
        admission=st.sampled_from(["optimistic", "reserve"]),
        caching=st.booleans(),
        first_from_prefill=st.booleans(),
        kv_blocks=st.integers(8, 20),
        budget=st.integers(2, 24),
        high=st.sampled_from([0.7, 1.0]),
    )
    def setup(self, policy, order, admission, caching, first_from_prefill, kv_blocks, budget, high):
        self.clock = FakeClock()
        config = SchedulerConfig(
            policy=policy,
            order=order,
            admission=admission,
            enable_prefix_caching=caching,
            first_token_from_prefill=first_from_prefill,
            kv_blocks=kv_blocks,
            block_size=4,
            token_budget=budget,
            max_prefill_chunk=5,
            max_prefilling=2,
            max_running=6,
            max_wait=3.0,
            decode_share=0.25,
            kv_high_watermark=high,
            kv_low_watermark=high * 0.8,
        )
        self.sched = Scheduler(
            config, eos_token_ids=frozenset({EOS}), max_model_len=48, clock=self.clock
        )
        self.serial = 0
        self.live: set[str] = set()
        self.ended: dict[str, int] = {}

    def _record(self, outputs):
        for out in outputs:
            assert out.request_id not in self.ended, (
                f"{out.request_id} produced output after ending"
            )
            if out.finished:
                self.ended[out.request_id] = self.ended.get(out.request_id, 0) + 1
                self.live.discard(out.request_id)

    @rule(
        prompt_len=st.integers(1, 24),
        max_tokens=st.integers(1, 20),
        tenant=st.sampled_from(["a", "b", "c"]),
        priority=st.integers(0, 2),
        prefix=st.sampled_from([None, 0, 1]),
    )
    def add(self, prompt_len, max_tokens, tenant, priority, prefix):
        self.serial += 1
        rid = f"r{self.serial}"
        prompt = [1000 * self.serial + i for i in range(prompt_len)]
        if prefix is not None:
            shared = PREFIXES[prefix]
            prompt = shared + prompt[: max(1, prompt_len - len(shared))]
        request = Request(
            rid,
            prompt,
            SamplingParams(max_tokens=max_tokens, temperature=0.0),
            tenant=tenant,
            priority=priority,
        )
        try:
            self.sched.add_request(request)
        except RejectedError:
            return
        self.live.add(rid)

    @rule(
        tokens=st.lists(st.sampled_from([EOS, 5, 6, 7, 8, 9]), min_size=8, max_size=8),
        elapsed=st.floats(0.0, 2.0),
        repeat=st.integers(1, 4),
    )
    def step(self, tokens, elapsed, repeat):
        for _ in range(repeat):
            plan = self.sched.schedule()
            for seq in plan.seqs:
                request = self.sched.get_request(seq.request_id)
                known = request.prompt_token_ids + request.output_token_ids
                assert seq.token_ids == known[seq.start_pos : seq.start_pos + len(seq.token_ids)]
                assert len(seq.block_table) * 4 >= seq.start_pos + len(seq.token_ids)
            self.clock.now += elapsed
            sampled = {
                s.request_id: tokens[i % len(tokens)]
                for i, s in enumerate(plan.seqs)
                if s.sample
            }
            self._record(self.sched.update(plan, StepResult(plan.step_id, sampled)))
            self.sched.check_invariants()

    @precondition(lambda self: self.live)
    @rule(data=st.data(), how=st.sampled_from(["abort", "finish"]))
    def end_one(self, data, how):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        used = self.sched.kv_cache.num_used_blocks
        shared = self._blocks_shared_with_others(rid)
        held = len(self.sched.get_request(rid).block_ids)
        out = getattr(self.sched, how)(rid)
        assert out is not None and out.finished
        assert self.sched.kv_cache.num_used_blocks == used - (held - shared)
        self._record([out])

    def _blocks_shared_with_others(self, rid):
        blocks = set(self.sched.get_request(rid).block_ids)
        return sum(1 for b in blocks if self.sched.kv_cache.ref_count(b) > 1)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def pause_or_resume(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        if rid in self.sched.paused:
            self.sched.resume(rid)
        else:
            self.sched.pause(rid)

    @rule()
    def worker_lost(self):
        self.sched.requeue_all()
        assert self.sched.kv_cache.num_used_blocks == 0

    @invariant()
    def consistent(self):
        if hasattr(self, "sched"):
            self.sched.check_invariants()
            assert set(self.sched.requests) == self.live

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for rid in list(self.sched.paused):
            self.sched.resume(rid)
        for _ in range(2000):
            if not self.sched.has_unfinished():
                break
            plan = self.sched.schedule()
            self.clock.now += 0.5
            sampled = {s.request_id: 6 for s in plan.seqs if s.sample}
            self._record(self.sched.update(plan, StepResult(plan.step_id, sampled)))
            self.sched.check_invariants()
        assert not self.sched.has_unfinished(), "requests never finished"
        assert all(count == 1 for count in self.ended.values())
        assert len(self.ended) == self.serial - self.sched.num_rejected
        assert self.sched.kv_cache.num_used_blocks == 0


SchedulerMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestScheduler = SchedulerMachine.TestCase
