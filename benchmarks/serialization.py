"""How many msgpack passes a step's sampled tokens go through on their way to the client.

Starts an in-process daemon on the null executor, wraps every codec the daemon uses with
counters, drives it with `sluice bench` in another process (so the client's own decoding is
not counted), and prints, per hop, the encode and decode calls per step that carry sampled
tokens. A hop that handles one step's outputs of many requests in one call counts once: the
number that matters is how many passes a token goes through, `passes per token` below.

What is counted:

- the internal codec (`sluice.actors.runtime.registry.CODEC`): a top-level encode or decode of a message
  that carries sampled tokens (a step result, step outputs, chunks, a client frame);
- the worker protocol's `encode_*`/`decode_*` (`sluice.actors.executor.worker`, which pack
  with the same codec and are counted once, as theirs), wherever they are called, and the
  compact-form reads and writes of a plan or result (`decode_compact`/`encode_compact`, the
  null executor's, which stands in for the worker process);
- the client codec's encoding of a `Chunk` (`envelope`, or `encode_batch`, which makes most
  envelopes inline: the frame the client receives);
- besides, every msgpack call the daemon makes, by the function that made it, as a check
  that nothing encodes outside the codecs above.

The worker process of `--executor model` is not counted here (it is another process): with
a real model the Executor relays the worker's bytes, and the worker's own encode and decode
are the ones the null executor makes in its place.

    .venv/bin/python benchmarks/serialization.py              # 64 requests, 32 tokens each
    .venv/bin/python benchmarks/serialization.py --requests 256 --json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from collections import Counter

import msgpack
import trio

from sluice.actors.runtime import registry
from sluice.actors.executor import worker
from sluice.actors.scheduler.scheduler import Scheduler
from sluice.daemon.logs import configure_logging
from sluice.ipc.codec import Codec

# message types whose encoding carries a step's sampled tokens, named by their hop
TOKEN_HOPS = {
    "StepResult": "executor -> scheduler",
    "StepOutputs": "scheduler -> tokenizer",
    "Deliver": "tokenizer -> stream",
    "Outbound": "stream -> gateway",
    "Chunk": "stream -> client (wire frame)",
}
PLAN_HOPS = {"StepPlan": "scheduler -> executor"}


class Tally:
    def __init__(self) -> None:
        self.token_passes: Counter[tuple[str, str, str]] = Counter()  # (hop, op, by) -> calls
        self.plan_passes: Counter[tuple[str, str, str]] = Counter()
        self.msgpack_calls: Counter[str] = Counter()  # "op by module.function" -> calls
        self.steps = 0
        self.sampled = 0


TALLY = Tally()


def _hop(name: str, op: str, by: str) -> None:
    if by == "worker protocol":  # the (null) worker's side, or the scheduler's
        hop = "worker -> scheduler" if name == "StepResult" else "scheduler -> worker"
        table = TALLY.token_passes if name == "StepResult" else TALLY.plan_passes
        table[(hop, op, by)] += 1
    elif name in TOKEN_HOPS:
        TALLY.token_passes[(TOKEN_HOPS[name], op, by)] += 1
    elif name in PLAN_HOPS:
        TALLY.plan_passes[(PLAN_HOPS[name], op, by)] += 1


def _caller(depth: int) -> str:
    frame = sys._getframe(depth)
    module = frame.f_globals.get("__name__", "?")
    return f"{module}.{frame.f_code.co_qualname}"


def _nested() -> bool:
    """Whether this msgpack call packs or unpacks an object nested in a message being coded."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return False
        if frame.f_code.co_name in ("_extension", "_unpack_object"):
            return True
        frame = frame.f_back
    return False


def _instrument() -> None:
    codec = registry.CODEC
    encode, decode = codec.encode, codec.decode

    inside_worker_protocol = [0]  # the worker protocol packs with this codec: counted there

    def counted_encode(msg):
        if codec._depth == 0 and not inside_worker_protocol[0]:  # nested: one message's fields
            _hop(type(msg).__name__, "encode", "internal codec")
        return encode(msg)

    def counted_decode(frame):
        msg = decode(frame)
        if not inside_worker_protocol[0]:
            _hop(type(msg).__name__, "decode", "internal codec")  # nested decodes give tuples
        return msg

    codec.encode, codec.decode = counted_encode, counted_decode

    def as_worker_protocol(original, op, kind_of):
        """`original`, counted once as the worker protocol's pass (its inner codec calls not)."""
        def counted(*args, **kwargs):
            _hop(kind_of(args), op, "worker protocol")
            inside_worker_protocol[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                inside_worker_protocol[0] -= 1
        return counted

    # the null executor's compact forms: (cls, plain) to encode, (frame, cls) to decode
    codec.encode_compact = as_worker_protocol(codec.encode_compact, "encode",
                                              lambda args: args[0].__name__)
    codec.decode_compact = as_worker_protocol(codec.decode_compact, "decode",
                                              lambda args: args[1].__name__)

    envelope, encode_batch = Codec.envelope, Codec.encode_batch
    inside_batch = [0]  # a batch counts its messages itself (it makes most envelopes inline)

    def counted_envelope(self, msg):
        if not inside_batch[0]:
            _hop(type(msg).__name__, "encode", "client codec")
        return envelope(self, msg)

    def counted_encode_batch(self, msgs):
        msgs = list(msgs)
        for msg in msgs:
            _hop(type(msg).__name__, "encode", "client codec")
        inside_batch[0] += 1
        try:
            return encode_batch(self, msgs)
        finally:
            inside_batch[0] -= 1

    Codec.envelope = counted_envelope
    Codec.encode_batch = counted_encode_batch

    # the worker protocol, wherever a module imported its functions by name
    for name in [n for n in vars(worker) if n.startswith(("encode_", "decode_"))]:
        original = getattr(worker, name)
        kind = "StepResult" if name.endswith("result") else "StepPlan"
        counted = as_worker_protocol(original, name.split("_")[0], lambda args, _kind=kind: _kind)

        for module in list(sys.modules.values()):
            if module is not None and getattr(module, name, None) is original:
                setattr(module, name, counted)

    # every msgpack call the daemon makes, by caller (packers are made after this runs)
    packb, unpackb = msgpack.packb, msgpack.unpackb

    def counted_packb(*args, **kwargs):
        TALLY.msgpack_calls[f"pack   {_caller(2)}"] += 1
        return packb(*args, **kwargs)

    def counted_unpackb(*args, **kwargs):
        if not _nested():
            TALLY.msgpack_calls[f"unpack {_caller(2)}"] += 1
        return unpackb(*args, **kwargs)

    class CountedPacker(msgpack.Packer):
        def pack(self, obj):
            caller = _caller(2)
            if caller != "msgpack.packb" and not _nested():  # packb was counted
                TALLY.msgpack_calls[f"pack   {caller}"] += 1
            return super().pack(obj)

    msgpack.packb, msgpack.unpackb, msgpack.Packer = counted_packb, counted_unpackb, CountedPacker
    registry.CODEC._packers.clear()

    update = Scheduler.update

    @functools.wraps(update)
    def counted_update(self, plan, result, **kwargs):
        if plan.seqs:
            TALLY.steps += 1
            TALLY.sampled += len(result.sampled)
        return update(self, plan, result, **kwargs)

    Scheduler.update = counted_update


async def _drive(args: argparse.Namespace) -> dict:
    from sluice.daemon.config import load_config
    from sluice.daemon.server import Daemon

    with tempfile.TemporaryDirectory(prefix="sluice-serialization-") as tmp:
        config = load_config(None, {"listen": "tcp://127.0.0.1:0",
                                    "control": f"ipc://{tmp}/control.sock", "executor": "null"})
        async with trio.open_nursery() as nursery:
            daemon = await nursery.start(Daemon(config).run)
            bench = [sys.executable, "-m", "sluice.daemon.cli", "bench",
                     "--connect", daemon.listen_address, "--concurrency", str(args.requests),
                     "--requests", str(args.requests), "--max-tokens", str(args.max_tokens),
                     "--json"]
            done = await trio.run_process(bench, capture_stdout=True, check=True)
            kv = await _kv_after(config.control)
            daemon.stop()
    return {**json.loads(done.stdout), "kv_after": kv}


async def _kv_after(control: str, timeout: float = 10.0) -> dict:
    """The KV pool once every request has ended: blocks still in use, whether every block is
    accounted for, and what the scheduler's invariant check found."""
    from sluice.ipc.control import fetch_status

    with trio.move_on_after(timeout):
        while True:
            report = await fetch_status(control, check_invariants=True)
            live = report.requests.waiting + report.requests.running + report.requests.paused
            if live == 0 and report.kv.used_blocks == 0:
                break
            await trio.sleep(0.05)
    kv = report.kv
    return {"used_blocks": kv.used_blocks,
            "accounted": kv.free_blocks + kv.cached_blocks + kv.used_blocks == kv.total_blocks,
            "invariant_errors": list(report.invariant_errors)}


def _rows(counter: Counter, steps: int) -> list[dict]:
    return [{"hop": hop, "op": op, "by": by, "calls": calls, "per_step": calls / max(1, steps)}
            for (hop, op, by), calls in sorted(counter.items())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64, help="requests, all at once")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    configure_logging("warning")
    _instrument()
    bench = trio.run(_drive, args)
    steps = TALLY.steps
    token_rows = _rows(TALLY.token_passes, steps)
    report = {
        "requests": args.requests, "max_tokens": args.max_tokens, "steps": steps,
        "sampled_tokens": TALLY.sampled, "delivered_tokens": bench["output_tokens"],
        # each hop that encodes or decodes the tokens is one pass, however many calls it takes
        "passes_per_token": len(token_rows),
        "token_passes": token_rows,
        "kv_after": bench["kv_after"],
        "plan_passes": _rows(TALLY.plan_passes, steps),
        "msgpack_calls_per_step": {
            call: round(n / max(1, steps), 2) for call, n in TALLY.msgpack_calls.most_common()
        },
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{args.requests} requests x {args.max_tokens} tokens: {steps} steps, "
          f"{TALLY.sampled} tokens sampled, {bench['output_tokens']} delivered")
    print(f"\nmsgpack passes over a step's sampled tokens: {len(token_rows)}")
    for row in token_rows:
        print(f"  {row['hop']:<32} {row['op']:<7} {row['by']:<16} {row['per_step']:8.2f} calls/step")
    print("\nthe step plan on its way to the worker:")
    for row in report["plan_passes"]:
        print(f"  {row['hop']:<32} {row['op']:<7} {row['by']:<16} {row['per_step']:8.2f} calls/step")
    kv = report["kv_after"]
    print(f"\nKV after the run: {kv['used_blocks']} blocks in use, every block accounted for: "
          f"{kv['accounted']}, invariant errors: {kv['invariant_errors'] or 'none'}")
    print("\nevery msgpack call of the daemon, per step:")
    for call, per_step in report["msgpack_calls_per_step"].items():
        print(f"  {per_step:8.2f}  {call}")


if __name__ == "__main__":
    main()
