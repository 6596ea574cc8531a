"""A constrained request's plans carry its output ids to the worker's grammar matcher: one id
per decode step (the matcher has the others), so a long output costs its length, not its
length squared, and all of them where the matcher must be rebuilt (a recompute after a
preemption or a lost worker, a request not planned for longer than `MATCHER_STEPS`). The
worker's `Constraints`, driven by the core's plans with the embedded model's tokenizer, gives
every step the mask of a matcher rebuilt from the whole output, across a preemption, a long
pause and a worker replaced mid-output."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from support.scheduler import make_scheduler, req

from sluice.actors.executor.grammar import Constraints
from sluice.actors.scheduler.plan import MATCHER_STEPS, StepResult

GRAMMAR = {"grammar_kind": "regex", "grammar": r"(ab|cd|[0-9]{1,3}|\n| )*"}


@pytest.fixture(scope="module")
def tokenizer_json():
    from sluice.actors.executor.model_files import resolve_model_path
    from sluice.actors.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_path(None))
    return tokenizer.backend.to_str(), tokenizer.vocab_size, tokenizer.eos_token_ids


def built_at_once(sched) -> None:
    """A worker that builds every grammar asked for at once (the tests without one)."""
    sched.grammars.built(grammar for grammar, _, _ in sched.grammars.take_asks())


def carried(plan, rid: str) -> list[int] | None:
    (seq,) = [s for s in plan.seqs if s.request_id == rid]
    return seq.output_token_ids


def test_a_long_constrained_output_carries_one_id_per_decode() -> None:
    sched = make_scheduler(block_size=16, kv_blocks=256)
    sched.add_request(req("json", prompt_len=8, max_tokens=600, **GRAMMAR))
    sched.add_request(req("free", prompt_len=8, max_tokens=600, first=2000))
    built_at_once(sched)
    sizes = []
    for n in range(400):
        plan = sched.schedule()
        sizes.append(len(carried(plan, "json")))
        assert carried(plan, "free") is None  # no grammar, no penalties: no ids
        sched.update(plan, StepResult(plan.step_id, {s.request_id: 100 + n % 7
                                                     for s in plan.seqs if s.sample}))
        sched.check_invariants()
    assert sizes[0] == 0 and set(sizes[1:]) == {1}

    request = sched.get_request("json")
    sched.preempt(request)  # recomputed: its matcher is rebuilt from everything
    for token in (5, 6):
        while True:
            plan = sched.schedule()
            ids = carried(plan, "json")
            sched.update(plan, StepResult(plan.step_id, {s.request_id: token
                                                         for s in plan.seqs if s.sample}))
            if ids is not None:  # the chunk that samples
                break
        if token == 5:
            assert len(ids) == 400 and ids == request.output_token_ids[:400]
        else:
            assert ids == [5]


def test_the_worker_masks_are_those_of_a_rebuilt_matcher(tokenizer_json) -> None:
    """The core's plans drive the worker's matchers through a preemption, a pause past
    `MATCHER_STEPS` (the worker dropped the idle matcher meanwhile) and a worker lost (a new
    `Constraints` takes the recompute's full output); each mask is the one a matcher fed the
    whole output from scratch gives, and the output follows the grammar."""
    text, vocab, eos = tokenizer_json
    worker = Constraints(text, vocab, eos)
    reference = Constraints(text, vocab, eos)
    sched = make_scheduler(block_size=16, kv_blocks=256)
    sched.add_request(req("a", prompt_len=8, max_tokens=300, **GRAMMAR))
    sched.add_request(req("b", prompt_len=8, max_tokens=300, first=2000, **GRAMMAR))
    sched.add_request(req("other", prompt_len=8, max_tokens=10_000, first=3000))
    rng = random.Random(3)
    sent = {"a": [], "b": []}

    def step() -> None:
        plan = sched.schedule()
        worker.build(plan.grammars)  # asked for once, built beside the steps
        seqs = [s for s in plan.seqs if s.sample]
        rows, masks = worker.masks(seqs) or ([], None)
        sampled = {s.request_id: 1 for s in seqs}  # "other": anything
        for i, row in enumerate(rows):
            seq = seqs[row]
            assert len(seq.output_token_ids) <= 1 or seq.num_generated == len(
                seq.output_token_ids)
            # the reference sees the whole output, as if its matcher were new every step
            whole = sched.get_request(seq.request_id).output_token_ids
            assert whole == sent[seq.request_id]
            fresh = dataclasses.replace(seq, output_token_ids=list(whole))
            reference._states.clear()
            _, expected = reference.masks([fresh])
            assert np.array_equal(masks[i], expected[0]), (seq.request_id, seq.num_generated)
            allowed = np.flatnonzero(np.unpackbits(
                masks[i].view(np.uint8), bitorder="little"))
            choices = [t for t in allowed if t not in eos] or list(allowed)
            sampled[seq.request_id] = int(rng.choice(choices))
        worker.advance(seqs, [sampled[s.request_id] for s in seqs])
        built = worker.take_built(0.0 if plan.seqs else 1.0)
        for out in sched.update(plan, StepResult(plan.step_id, sampled, grammars_built=built)):
            if out.request_id in sent:
                sent[out.request_id] += out.new_token_ids
        sched.check_invariants()

    for _ in range(40):
        step()
    sched.preempt(sched.get_request("a"))
    for _ in range(10):
        step()
    sched.pause("b")
    for _ in range(2 * MATCHER_STEPS + 20):  # "other" alone: the worker drops b's matcher
        step()
    assert "b" not in worker._states
    sched.resume("b")
    for _ in range(10):
        step()
    sched.requeue_all()  # the worker is lost: a new one knows no request, nor grammar
    sched.grammars.reset()
    worker = Constraints(text, vocab, eos)
    for _ in range(40):
        step()
    assert len(sent["a"]) >= 80 and len(sent["b"]) >= 40


def test_a_worker_without_the_matcher_and_only_the_last_id_says_so(tokenizer_json) -> None:
    text, vocab, eos = tokenizer_json
    sched = make_scheduler(block_size=16, kv_blocks=64)
    sched.add_request(req("a", prompt_len=8, max_tokens=50, **GRAMMAR))
    built_at_once(sched)
    for _ in range(3):
        plan = sched.schedule()
        sched.update(plan, StepResult(plan.step_id, {"a": 28}))
    plan = sched.schedule()
    assert len(carried(plan, "a")) == 1
    with pytest.raises(ValueError, match="from token 2.*gone"):
        Constraints(text, vocab, eos).masks(plan.seqs)
