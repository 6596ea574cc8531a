"""A constrained request is admitted once the worker has built its grammar, so no step waits for
a build: the core asks for each new grammar once, in the next plan it makes (with no sequence
if nothing else runs), and admits the request after a result names the grammar built.
Meanwhile other tenants' requests run, and the same tenant's later ones keep their place
behind it; a request that shares a grammar being built waits for that one build; a new worker
is asked for every grammar in use again; a grammar no live request uses is forgotten. Driven
here with the worker's real `Constraints`, which builds on a thread of its own."""

from __future__ import annotations

import json

import pytest
from support.scheduler import make_scheduler, req, sample_all

from sluice.actors.executor.grammar import Constraints
from sluice.actors.scheduler.plan import StepResult

SCHEMA = {"grammar_kind": "json_schema", "grammar": json.dumps(
    {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})}
OTHER = {"grammar_kind": "regex", "grammar": "[a-z]+"}


def ids(plan) -> set[str]:
    return {s.request_id for s in plan.seqs}


def test_a_constrained_request_waits_for_its_grammar_not_the_others() -> None:
    sched = make_scheduler(block_size=16, kv_blocks=64)
    sched.add_request(req("json", tenant="alice", arrival=0.0, **SCHEMA))
    sched.add_request(req("behind", tenant="alice", arrival=1.0, first=2000))
    sched.add_request(req("same", tenant="carol", arrival=2.0, first=4000, **SCHEMA))
    sched.add_request(req("free", tenant="bob", arrival=3.0, first=3000))
    plan = sched.schedule()
    assert ids(plan) == {"free"}  # alice's next waits behind her grammar; bob's goes
    assert [g[1:] for g in plan.grammars] == [["json_schema", SCHEMA["grammar"]]]  # once
    (grammar,) = [g[0] for g in plan.grammars]
    sched.update(plan, sample_all(plan))
    plan = sched.schedule()
    assert "json" not in ids(plan) and "behind" not in ids(plan) and not plan.grammars
    assert sched.grammars.waiting
    sched.update(plan, StepResult(plan.step_id, {s.request_id: 7 for s in plan.seqs if s.sample},
                                  grammars_built=[grammar]))
    assert not sched.grammars.waiting
    plan = sched.schedule()
    assert {"json", "behind", "same"} <= ids(plan)
    sched.update(plan, sample_all(plan))
    sched.check_invariants()


def test_a_new_worker_is_asked_again_and_unused_grammars_are_forgotten() -> None:
    sched = make_scheduler(block_size=16, kv_blocks=64)
    sched.add_request(req("a", max_tokens=50, **SCHEMA))
    sched.add_request(req("gone", first=2000, **OTHER))
    plan = sched.schedule()
    assert not plan.seqs and len(plan.grammars) == 2
    by_kind = {kind: grammar for grammar, kind, _ in plan.grammars}
    sched.abort("gone")  # cancelled while its grammar was built: no longer waited for
    sched.update(plan, StepResult(plan.step_id, grammars_built=[by_kind["json_schema"]]))
    assert not sched.grammars.waiting
    plan = sched.schedule()
    assert ids(plan) == {"a"}
    sched.update(plan, sample_all(plan))
    sched.requeue_all()  # the worker is lost
    sched.grammars.reset()
    sched.add_request(req("new", first=3000, **SCHEMA))
    plan = sched.schedule()
    # the new worker is asked for the grammar in use (not the forgotten one); the request
    # that had started recomputes at once, the new one waits for the build
    assert [g[1] for g in plan.grammars] == ["json_schema"] and ids(plan) == {"a"}
    sched.update(plan, StepResult(plan.step_id, {"a": 7}, grammars_built=[plan.grammars[0][0]]))
    assert "new" in ids(sched.schedule())


@pytest.fixture(scope="module")
def constraints() -> Constraints:
    from sluice.actors.executor.model_files import resolve_model_path

    return Constraints.for_model(resolve_model_path(None))


def test_the_worker_builds_what_it_is_asked_beside_its_steps(constraints) -> None:
    props = {f"p{i}": {"type": "integer", "minimum": i} for i in range(200)}
    big = json.dumps({"type": "object", "properties": props, "required": list(props)})
    constraints.build([[5, "json_schema", big], [6, "regex", "[a-z]+"]])
    built = []
    while len(built) < 2:  # reported once each, when done
        built += constraints.take_built(wait=5.0)
    assert sorted(built) == [5, 6]
    constraints.build([[9, "regex", "[a-z]+"]])  # known already: built at once
    assert constraints.take_built() == [9] and constraints.take_built() == []


def test_a_build_that_raises_fails_only_the_step_of_a_request_that_uses_it(
        constraints, monkeypatch) -> None:
    # a fake failure: the real builder, made to raise for one marked grammar
    real = constraints._template

    def template(kind: str, text: str):
        if text == "[0-9]+ broken":
            raise RuntimeError("the build of this grammar failed")
        return real(kind, text)

    monkeypatch.setattr(constraints, "_template", template)
    constraints.build([[11, "regex", "[0-9]+ broken"], [12, "regex", "[a-c]+"]])
    built = []
    while len(built) < 2:  # both reported, and nothing raised for the other request's sake
        built += constraints.take_built(wait=5.0)
    assert sorted(built) == [11, 12]
    constraints._fresh("regex", "[a-c]+")  # the sound one is there to use
    with pytest.raises(RuntimeError, match="build of this grammar failed"):
        constraints._fresh("regex", "[0-9]+ broken")  # in a step of its own request
    with pytest.raises(RuntimeError):  # and again for the next request that uses it
        constraints._fresh("regex", "[0-9]+ broken")
