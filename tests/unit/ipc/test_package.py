"""The client package's front door: the client library is one import away, and the values the
scheduler core shares with the wire load no I/O library."""

from __future__ import annotations

import subprocess
import sys


def test_the_clients_come_from_the_package() -> None:
    from sluice.ipc import AsyncClient, Client
    from sluice.ipc import client

    assert Client is client.Client and AsyncClient is client.AsyncClient


def test_the_shared_vocabulary_loads_neither_trio_nor_zeromq() -> None:
    code = ("import sys, sluice.ipc.vocabulary, sluice.actors.scheduler.plan; "
            "print(sorted({'trio', 'zmq'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_package_holds_only_what_goes_on_the_wire() -> None:
    """Every message class the client package defines is a client or control message, or a
    value nested in one; the messages between actors live with the actors."""
    import dataclasses
    import typing

    from sluice.actors.runtime import messages as between_actors
    from sluice.ipc import messages as m
    from sluice.ipc.internal import dataclasses_of

    reachable: set[type] = set()
    todo = list(m.WIRE_MESSAGES)
    while todo:
        cls = todo.pop()
        if cls in reachable:
            continue
        reachable.add(cls)
        for hint in typing.get_type_hints(cls).values():
            for inner in (hint, *typing.get_args(hint)):
                for candidate in (inner, *typing.get_args(inner)):
                    if dataclasses.is_dataclass(candidate):
                        todo.append(candidate)
    defined = set(dataclasses_of(m))
    assert defined - reachable == set()
    internal = {cls.__name__ for cls in dataclasses_of(between_actors)}
    assert {"Admit", "StepOutputs", "Deliver", "Ask", "Operate", "Reply"} <= internal
    assert internal.isdisjoint(cls.__name__ for cls in defined)


def test_every_message_says_what_it_carries() -> None:
    import dataclasses
    import re

    from sluice.actors.runtime import messages as between_actors
    from sluice.actors.runtime import reports
    from sluice.ipc import messages as wire
    from sluice.ipc.internal import dataclasses_of

    untyped = [f"{cls.__name__}.{f.name}"
               for module in (wire, between_actors, reports) for cls in dataclasses_of(module)
               for f in dataclasses.fields(cls) if re.search(r"\bAny\b", str(f.type))]
    assert untyped == []
