"""The worker process: the model, its paged KV pool and the sampler, behind one PAIR socket.

Started by the Executor actor as `python -m sluice.actors.executor.worker --endpoint ...`.
It connects, builds a `ModelRunner`, says `hello` with the facts the scheduler needs, then
serves requests one at a time: a `StepPlan` (-> a `StepResult`, or `StepOutOfMemory` when
its forward ran out of memory: the worker lives on and the step can be planned again
smaller) or a `HealthCheck` (a known-answer forward on a fresh pool). It dies with its
parent, whatever it is doing then: a worker left behind by a killed daemon would hold its
memory (and a GPU) for nobody. It ignores SIGINT (a terminal's Ctrl-C is the daemon's, which
stops its worker after draining).

The messages on this socket are in `protocol.py`; they are packed here, by the daemon's one
registry (`actors.runtime.registry.CODEC`), with the encoders both ends use.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from sluice.actors.executor.lifeline import die_with_parent
from sluice.actors.executor.protocol import (
    RESULT, Hello, HealthAnswer, HealthCheck, InjectOutOfMemory, StepOutOfMemory, WorkerError,
    WorkerMessage,
)  # fmt: skip
from sluice.actors.runtime.registry import CODEC
from sluice.actors.runtime.reports import WorkerFacts
from sluice.actors.scheduler.plan import ScheduledSeq, StepPlan, StepResult
from sluice.ipc.vocabulary import SamplingParams

# the fixed forward of the health check: a short greedy prompt in block 0 of a fresh pool
HEALTH_PROMPT = (1, 504, 3458, 282, 4649, 314, 2, 28, 19)
HEALTH_REQUEST = "__health__"


# -- encoding shared with the Executor actor -------------------------------------------------


def encode(msg: WorkerMessage) -> bytes:
    return CODEC.encode(msg)


def decode(frame: bytes) -> WorkerMessage | StepPlan:
    return CODEC.decode(frame)


def encode_plan(plan: StepPlan) -> bytes:
    return CODEC.encode(plan)


def decode_plan(frame: bytes) -> StepPlan:
    plan = CODEC.decode(frame)
    if not isinstance(plan, StepPlan):
        raise TypeError(f"expected a StepPlan, got a {type(plan).__name__}")
    return plan


def encode_result(result: StepResult) -> bytes:
    return CODEC.encode(result)


def decode_result(frame: bytes) -> StepResult:
    result = CODEC.decode(frame)
    if not isinstance(result, StepResult):
        raise TypeError(f"expected a StepResult, got a {type(result).__name__}")
    return result


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
    parser.add_argument("--kv-memory-fraction", type=float, default=None)
    parser.add_argument("--kv-max-bytes", type=int, default=None)
    parser.add_argument("--profile-tokens", type=int, default=None,
                        help="tokens of the largest step, profiled to size the KV pool")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--deterministic", action="store_true",
                        help="greedy output independent of batch, chunking and prefix cache")
    parser.add_argument("--cpus", default=None, metavar="N,N,...",
                        help="run on these CPUs only; --threads defaults to their number")
    parser.add_argument("--tensor-parallel", type=int, default=1,
                        help="rank processes to split the model across (this one is rank 0)")
    parser.add_argument("--collective-timeout", type=float, default=300.0,
                        help="seconds a tensor-parallel rank waits in a step's collective")
    parser.add_argument("--join-listen", default=None, metavar="tcp://HOST:PORT",
                        help="where ranks on other hosts join the group (CURVE)")
    parser.add_argument("--join-host", action="append", default=[],
                        help="the IP address of each rank on another host (the last ranks)")
    parser.add_argument("--join-secret-key-file", default=None,
                        help="this worker's CURVE secret key, for ranks that join")
    parser.add_argument("--join-public-key", action="append", default=[],
                        help="a CURVE public key (Z85) allowed to join")
    parser.add_argument("--group-timeout", type=float, default=300.0,
                        help="seconds for a tensor-parallel group to form (every rank joined, "
                             "loaded and ready)")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="the daemon's pid: exit at once if it is gone before this starts")
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
    (scripts and tests read it): its own log lines go to stderr, the daemon's too, in the
    daemon's format by the daemon's rule (its stderr and environment are the daemon's):
    JSON lines unless stderr is a TTY or `SLUICE_LOG_FORMAT` says `console` (or `json`),
    coloured on a TTY or where `FORCE_COLOR` asks."""
    import structlog

    chosen = os.environ.get("SLUICE_LOG_FORMAT", "")
    as_json = chosen == "json" or (chosen != "console" and not sys.stderr.isatty())
    colors = bool(os.environ.get("FORCE_COLOR")) or (sys.stderr.isatty()
                                                     and not os.environ.get("NO_COLOR"))
    renderer = (structlog.processors.JSONRenderer() if as_json
                else structlog.dev.ConsoleRenderer(colors=colors))
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper("iso"),
                    renderer],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def _rank_setup() -> None:
    """What another rank of this worker's tensor-parallel group does first: log as the
    worker does, and leave SIGINT to the daemon."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _log_to_stderr()


def model_label(spec: str | None) -> tuple[str, str]:
    """What the loading line names: the model's file or folder name, and its weights' size
    on disk ("92 MB"). A model that cannot be found is named as given (its load says why)."""
    from sluice.actors.executor.model_files import resolve_model_path

    try:
        path = resolve_model_path(spec)
        files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
        size = sum(file.stat().st_size for file in files)
    except (OSError, ValueError):
        return str(spec), "?"
    for unit in ("bytes", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            break
        size /= 1000
    return path.name, f"{size:.3g} {unit}"


def main(argv: list[str] | None = None) -> int:
    # the daemon stops its worker (and a worker outlives no daemon, see `die_with_parent`):
    # an interrupt meant for the daemon is not the worker's, nor a reason for a traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    args = _parse(sys.argv[1:] if argv is None else argv)
    threads = args.threads
    cpus = None
    if args.cpus:
        cpus = sorted({int(c) for c in args.cpus.split(",")})
        os.sched_setaffinity(0, cpus)  # before any thread starts: each inherits it
        threads = threads or len(cpus)
    die_with_parent(args.parent_pid)
    if args.debug_fail_start_if and os.path.exists(args.debug_fail_start_if):
        print("sluice-worker: test fault: refusing to start", file=sys.stderr)
        return 3
    _log_to_stderr()
    import structlog
    import torch
    import zmq

    from sluice.actors.executor.dtypes import dtype_name
    from sluice.actors.executor.runner import ModelRunner

    log = structlog.get_logger("sluice.worker")

    if threads and args.tensor_parallel == 1:  # a group shares them out among its ranks
        torch.set_num_threads(threads)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(args.endpoint)
    sizing = {name: value for name, value in (
        ("kv_memory_fraction", args.kv_memory_fraction), ("kv_max_bytes", args.kv_max_bytes),
        ("profile_tokens", args.profile_tokens)) if value is not None}
    name, size = model_label(args.model)
    log.info("loading model", model=name, size=size, device=args.device)
    started = time.perf_counter()
    rank_pids: tuple[int, ...] = ()
    if args.tensor_parallel > 1:
        from sluice.actors.executor.rank_join import JoinSettings, read_key_file
        from sluice.actors.executor.tensor_parallel import TensorParallelRunner

        join = None
        if args.join_host:
            join = JoinSettings(args.join_listen, tuple(args.join_host),
                                read_key_file(args.join_secret_key_file),
                                tuple(args.join_public_key))
            log.info("waiting for ranks on other hosts", listen=args.join_listen,
                     hosts=list(args.join_host))
        # the other ranks are this process's children, in its process group: the executor
        # kills the group, and each rank also exits when this process is gone
        runner = TensorParallelRunner(
            args.model, args.tensor_parallel, dtype=args.dtype, kv_dtype=args.kv_dtype,
            device=args.device, num_blocks=args.num_blocks, block_size=args.block_size,
            max_model_len=args.max_model_len, threads=threads, cpus=cpus,
            kv_max_bytes=args.kv_max_bytes, timeout_s=args.collective_timeout,
            startup_timeout_s=args.group_timeout,
            rank_setup=_rank_setup, join=join, log=log.info)
        rank_pids = tuple(runner.rank_pids)
        log.info("tensor parallel group formed", ranks=args.tensor_parallel,
                 rank_pids=list(rank_pids))
    else:
        runner = ModelRunner(args.model, dtype=args.dtype, kv_dtype=args.kv_dtype,
                             device=args.device, num_blocks=args.num_blocks,
                             block_size=args.block_size, max_model_len=args.max_model_len,
                             deterministic=args.deterministic, **sizing)
    log.info("model loaded", model=name, seconds=round(time.perf_counter() - started, 1))
    if (kv := runner.kv_sizing) is not None:
        log.info("kv pool sized", available_bytes=kv.available_bytes,
                 profile_peak_bytes=kv.profile_peak_bytes, kv_bytes=kv.kv_bytes,
                 blocks=kv.num_blocks, device=args.device)
    sock.send(encode(Hello(os.getpid(), WorkerFacts(
        runner.num_blocks, runner.block_size, runner.max_model_len, runner.config.vocab_size,
        dtype_name(runner.model.dtype), dtype_name(runner.model.kv_dtype),
        runner.config.kv_window), rank_pids)))
    while True:
        msg = decode(sock.recv())
        try:
            if isinstance(msg, StepPlan):
                plan = msg
                poison = args.debug_fail_token
                if poison is not None and any(poison in s.token_ids for s in plan.seqs):
                    raise RuntimeError(f"test fault: a step computes token {poison}")
                hang = args.debug_hang_token
                if hang is not None and any(hang in s.token_ids for s in plan.seqs):
                    while True:  # until the executor's step_timeout kills this process
                        time.sleep(60)
                try:
                    result = runner.execute(plan)
                except torch.OutOfMemoryError as exc:
                    reply = StepOutOfMemory(plan.step_id, str(exc)[:500])
                else:
                    sock.send_multipart([RESULT, encode_result(result)])
                    continue
                # past the `except`, whose traceback held the failed step's tensors
                runner.free_cached_memory()
                log.warning("step out of memory", step_id=plan.step_id, tokens=plan.num_tokens)
            elif isinstance(msg, InjectOutOfMemory):
                runner.inject_out_of_memory()
                continue
            elif isinstance(msg, HealthCheck):
                started = time.perf_counter()
                runner.reset_kv()
                plan = health_plan(runner.config.vocab_size)
                if args.debug_fail_token in plan.seqs[0].token_ids:  # the poison fails it too
                    raise RuntimeError(f"test fault: a step computes token {args.debug_fail_token}")
                result = runner.execute(plan)
                runner.reset_kv()
                token = result.sampled[HEALTH_REQUEST] + args.debug_health_offset
                reply = HealthAnswer(token % runner.config.vocab_size,
                                     time.perf_counter() - started)
            else:
                reply = WorkerError(f"a worker cannot handle a {type(msg).__name__}")
        except Exception as exc:  # report, let the executor decide to restart us
            reply = WorkerError(f"{type(exc).__name__}: {exc}")
        sock.send(encode(reply))


if __name__ == "__main__":
    # run the module's own copy, not this `__main__` one: the registry knows the protocol's
    # classes as `sluice.actors.executor.worker`'s
    from sluice.actors.executor.worker import main as worker_main

    sys.exit(worker_main())
