"""The worker boundary's messages: what the Executor (and, as relayed bytes, the Scheduler)
and the worker process say to each other over the worker's PAIR socket.

Typed messages (`Hello`, `HealthCheck`, `HealthAnswer`, `WorkerError`, `StepOutOfMemory`, the
test fault `InjectOutOfMemory`) beside the core's `StepPlan` and `StepResult`, all packed by
the daemon's one registry (`actors.runtime.registry`; the encoders are in `worker.py`). A plan
is encoded once, by the Scheduler actor, and a result decoded once, by it too: the Executor
relays both as bytes (`PlanFrame`, `ResultFrame`), which is why a result comes as two frames,
`result` and its body, so the Executor can tell it from an error unread.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.actors.runtime.reports import WorkerFacts

RESULT = b"result"  # the first frame of a step's result; its second is `encode_result`'s


@dataclass(frozen=True)
class PlanFrame:
    """A step plan as the worker reads it, on its way from the Scheduler to the worker."""

    step_id: int
    frame: bytes


@dataclass(frozen=True)
class ResultFrame:
    """A step's result as the worker wrote it, on its way from the worker to the Scheduler."""

    frame: bytes


@dataclass(frozen=True)
class Hello:
    """Worker -> Executor, once the model and its pool are loaded."""

    pid: int
    facts: WorkerFacts
    # a tensor-parallel group's processes, rank 0 (`pid`) first, 0 for a rank on another
    # host; empty for one process
    rank_pids: tuple[int, ...] = ()


@dataclass(frozen=True)
class HealthCheck:
    """Executor -> worker: run the known-answer forward on a fresh pool."""


@dataclass(frozen=True)
class HealthAnswer:
    token: int  # what the known-answer forward sampled
    seconds: float


@dataclass(frozen=True)
class WorkerError:
    """Worker -> Executor, instead of an answer: what failed (the Executor restarts it)."""

    message: str


@dataclass(frozen=True)
class StepOutOfMemory:
    """Worker -> Executor -> Scheduler, instead of a step's result: its forward ran out of
    memory. Nothing was sampled and nothing it computed counts; the worker serves on."""

    step_id: int
    message: str


@dataclass(frozen=True)
class InjectOutOfMemory:
    """Daemon -> Executor -> worker, a test fault (`debug_faults`): the next step's forward
    raises torch's out-of-memory error. Unanswered: it may arrive while a step runs."""


WorkerMessage = (Hello | HealthCheck | HealthAnswer | WorkerError | StepOutOfMemory
                 | InjectOutOfMemory)
