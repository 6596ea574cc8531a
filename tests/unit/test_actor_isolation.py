"""Actors share nothing: production code never reads another actor's state or calls into it.

The daemon, the metrics and the console learn an actor's state from the messages it sends
(`sluice.actors.runtime.reports`, `Ask`/`Reply`), and tell it what to do by message. This test reads
the source of `daemon/`, `actors/` and `tui/` with `ast` and fails on the shapes such
shortcuts took:

- `<x>.core` where `x` is not `self`: the scheduler core belongs to the Scheduler actor
  (plain functions that take the core as a parameter, `core.requests`, are its own code);
- a call of `vanish` or `kill_worker` on anything but `self`;
- `<inbox>.depth` (on anything named like an inbox) unless it is `self.inbox`: an actor may
  read its own inbox's depth, nobody another's (flow control uses the numbers actors report,
  `Backlog`, whose own `depth` field is a number in a message and passes);
- any `.observers`: callbacks into another actor's loop;
- `<...>.<actor>.<state>` and `<actor>.<state>`, where `<actor>` is a name the daemon and the
  actors give actor references (`executor`, `scheduler`, `gateway`, `tokenizer`, `control`,
  `stream`) and `<state>` one of the attributes actors keep their state in (`facts`,
  `failure`, `running`, `streams`, `latency`, `requests`, `counters`, ...).

Its limits: it goes by names, not types. An actor reached under another name, through
`getattr`, or an attribute not listed here slips through; and a non-actor object that
happens to be called `scheduler` (the core inside `Engine`) is checked like one, which is
why the state names are a short list rather than "anything but `put`". Tests may inspect
daemon internals; only production code is scanned.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("daemon", "actors", "tui")
ACTOR_NAMES = {"executor", "scheduler", "gateway", "tokenizer", "control", "stream"}
ACTOR_STATE = {"facts", "failure", "running", "streams", "latency", "requests", "counters",
               "draining", "in_flight", "worker_state", "restarts", "pid", "state", "backlog",
               "tokenizing", "pending_prompt_bytes", "peers", "owners", "subscribers"}
CROSS_CALLS = {"vanish", "kill_worker"}


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _is_own_inbox(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "inbox" and _is_self(node.value)


def _names_an_inbox(node: ast.expr) -> bool:
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
    return "inbox" in name


def _names_an_actor(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ACTOR_NAMES
    return isinstance(node, ast.Attribute) and node.attr in ACTOR_NAMES


def findings(source: str, filename: str = "<source>") -> list[str]:
    """Every cross-actor read or call in `source`, as `line: what`."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in CROSS_CALLS and not _is_self(node.func.value):
                found.append(f"{node.lineno}: calls .{node.func.attr}() of another object")
        if not isinstance(node, ast.Attribute):
            continue
        if node.attr == "core" and not _is_self(node.value):
            found.append(f"{node.lineno}: reads the scheduler core of another object")
        elif node.attr == "depth" and _names_an_inbox(node.value) \
                and not _is_own_inbox(node.value):
            found.append(f"{node.lineno}: reads the depth of an inbox not its own")
        elif node.attr == "observers":
            found.append(f"{node.lineno}: registers a callback in another actor")
        elif node.attr in ACTOR_STATE and _names_an_actor(node.value):
            found.append(f"{node.lineno}: reads .{node.attr} of an actor")
    return found


def test_the_check_finds_each_shape() -> None:
    source = "\n".join([
        "self.scheduler.core.requests",
        "daemon.gateway.vanish(b'x')",
        "self.executor.kill_worker()",
        "sum(inbox.depth for inbox in self.downstream)",
        "self.scheduler.latency.observers.append(f)",
        "facts = self.executor.facts",
        "if executor.running: pass",
        "list(self.gateway.streams)",
    ])
    lines = {int(finding.split(":")[0]) for finding in findings(source)}
    assert lines == set(range(1, 9))


def test_what_an_actor_may_do_passes() -> None:
    source = "\n".join([
        "self.core.add_request(request)",  # the scheduler actor's own core
        "core.requests",  # a plain function given the core
        "self.kill_worker()",
        "self.backlog.report(self.inbox.depth, self.scheduler)",
        "self.scheduler.put(m.Admit())",
        "stream.inbox.put(m.ClientGone(identity))",
        "report.requests.running",
        "self.backlog[msg.actor] = msg.depth",
    ])
    assert findings(source) == []


def test_no_actor_reads_another_actors_state() -> None:
    found = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for finding in findings(path.read_text(), str(path)):
                found.append(f"{path.relative_to(ROOT)}:{finding}")
    assert found == []
