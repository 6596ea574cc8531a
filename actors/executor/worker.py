"""The worker process: the model, its paged KV pool and the sampler, behind one PAIR socket.

Started by the Executor actor as `python -m sluice.actors.executor.worker --endpoint ...`.
It connects, builds a `ModelRunner`, says `hello` with the facts the scheduler needs, then
serves requests one at a time: `step` (a StepPlan -> a StepResult), `health` (a known-answer
forward on a fresh pool), `stop`. It dies with its parent, whatever it is doing then: a
worker left behind by a killed daemon would hold its memory (and a GPU) for nobody.

The plan/result encoding used on this socket lives here too, so both ends share it. A plan
is encoded once, by the Scheduler actor, and a result decoded once, by the Scheduler actor:
the Executor relays both as bytes (`PlanFrame`, `ResultFrame`), which is why a result comes
as two frames, `result` and its body, so the Executor can tell it from an error unread.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgpack

from sluice.actors.scheduler.plan import SamplingParams, ScheduledSeq, StepPlan, StepResult

# the fixed forward of the health check: a short greedy prompt in block 0 of a fresh pool
HEALTH_PROMPT = (1, 504, 3458, 282, 4649, 314, 2, 28, 19)
HEALTH_REQUEST = "__health__"


# -- encoding shared with the Executor actor -------------------------------------------------


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


def encode_plan(plan: StepPlan) -> bytes:
    return msgpack.packb({"op": "step", "plan": plan.to_plain()})


def decode_plan(msg: dict[str, Any]) -> StepPlan:
    return StepPlan.from_plain(msg["plan"])


def encode_result(result: StepResult) -> bytes:
    return msgpack.packb(result.to_plain())


def decode_result(frame: bytes) -> StepResult:
    return StepResult.from_plain(msgpack.unpackb(frame, strict_map_key=False))


def health_plan(vocab_size: int) -> StepPlan:
    tokens = [t % vocab_size for t in HEALTH_PROMPT]
    seq = ScheduledSeq(HEALTH_REQUEST, tokens, 0, [0], True, SamplingParams(temperature=0.0))
    return StepPlan(0, [seq])


# -- the process ------------------------------------------------------------------------------


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sluice-worker")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-dtype", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--debug-fail-token", type=int, default=None,
                        help="a test fault: fail every step that computes this token id")
    parser.add_argument("--debug-fail-start-if", default=None, metavar="PATH",
                        help="a test fault: exit before saying hello while PATH exists")
    parser.add_argument("--debug-hang-token", type=int, default=None,
                        help="a test fault: hang in every step that computes this token id")
    parser.add_argument("--debug-health-offset", type=int, default=0,
                        help="a test fault: answer the health check off by this much")
    return parser.parse_args(argv)


def _log_to_stderr() -> None:
    """The worker shares the daemon's stdout, whose first line is the daemon's ready line
    (scripts and tests read it): its own log lines go to stderr, as JSON lines like the
    daemon's under journald."""
    import structlog

    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper("iso"),
                    structlog.processors.JSONRenderer()],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


PARENT_CHECK_SECONDS = 0.5


def die_with_parent() -> None:
    """Exit when the daemon goes away, even mid-load or inside a step that never returns: a
    thread polls the parent pid, since a main thread stuck in native code never reaches a
    check of its own. (Not prctl's PR_SET_PDEATHSIG: it fires when the parent *thread* that
    spawned us exits, and trio spawns processes from its worker threads, which end when
    idle.)"""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_SECONDS)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    die_with_parent()
    if args.debug_fail_start_if and os.path.exists(args.debug_fail_start_if):
        print("sluice-worker: test fault: refusing to start", file=sys.stderr)
        return 3
    _log_to_stderr()
    import torch
    import zmq

    from sluice.actors.executor.dtypes import dtype_name
    from sluice.actors.executor.runner import ModelRunner

    if args.threads:
        torch.set_num_threads(args.threads)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(args.endpoint)
    runner = ModelRunner(args.model, dtype=args.dtype, kv_dtype=args.kv_dtype, device=args.device,
                         num_blocks=args.num_blocks, block_size=args.block_size,
                         max_model_len=args.max_model_len)
    sock.send(msgpack.packb({
        "op": "hello", "pid": os.getpid(), "num_blocks": runner.num_blocks,
        "block_size": runner.block_size, "max_model_len": runner.max_model_len,
        "vocab_size": runner.config.vocab_size, "dtype": dtype_name(runner.model.dtype),
        "kv_dtype": dtype_name(runner.model.kv_dtype),
    }))
    while True:
        msg = msgpack.unpackb(sock.recv(), strict_map_key=False)
        op = msg.get("op")
        if op == "stop":
            return 0
        try:
            if op == "step":
                plan = decode_plan(msg)
                poison = args.debug_fail_token
                if poison is not None and any(poison in s.token_ids for s in plan.seqs):
                    raise RuntimeError(f"test fault: a step computes token {poison}")
                hang = args.debug_hang_token
                if hang is not None and any(hang in s.token_ids for s in plan.seqs):
                    while True:  # until the executor's step_timeout kills this process
                        time.sleep(60)
                sock.send_multipart([RESULT, encode_result(runner.execute(plan))])
                continue
            elif op == "health":
                started = time.perf_counter()
                runner.reset_kv()
                plan = health_plan(runner.config.vocab_size)
                if args.debug_fail_token in plan.seqs[0].token_ids:  # the poison fails it too
                    raise RuntimeError(f"test fault: a step computes token {args.debug_fail_token}")
                result = runner.execute(plan)
                runner.reset_kv()
                token = result.sampled[HEALTH_REQUEST].token_id + args.debug_health_offset
                reply = msgpack.packb({"op": "health", "token": token % runner.config.vocab_size,
                                       "seconds": time.perf_counter() - started})
            else:
                reply = msgpack.packb({"op": "error", "message": f"unknown op {op!r}"})
        except Exception as exc:  # report, let the executor decide to restart us
            reply = msgpack.packb({"op": "error", "message": f"{type(exc).__name__}: {exc}"})
        sock.send(reply)


if __name__ == "__main__":
    sys.exit(main())
