"""`sluice bench`: load-test a running daemon and report latency, throughput and fairness.

Arrivals are Poisson at `--rate` requests/s, or a fixed number of requests in flight
(`--concurrency`). It stops after `--requests` requests or `--duration` seconds. Requests
come from `--workload` (JSON lines: prompt or prompt_ids, max_tokens, optional tenant) or
repeat `--prompt`; `--tenants a:2,b:1` spreads them over tenants by weight. Reported: TTFT,
TPOT, ITL and E2E percentiles, output tokens/s, goodput under the SLOs, rejections, and per
tenant the tokens served and the Jain index of weight-normalised service. The report's `run`
records what the load ran against (`bench_record`): the arrival process, the prompt and
output lengths the daemon counted, and with `--connect-control` the daemon's model, dtype,
device, version, scheduler settings and KV peak.

`--http URL` drives the daemon's OpenAI-compatible front instead (`http_load`), with the same
workloads and report; a tenant is then chosen by its API key (`--api-key TENANT=KEY`).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import random
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sluice.daemon.commands.bench_record import Sample

if TYPE_CHECKING:
    from sluice.daemon.commands.bench_record import DaemonWatch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--connect", metavar="ADDR", default="tcp://127.0.0.1:7340")
    parser.add_argument("--http", metavar="URL",
                        help="drive the OpenAI-compatible front at http://HOST:PORT instead")
    parser.add_argument("--api-key", action="append", default=[], metavar="TENANT=KEY",
                        help="with --http: the API key of a tenant (repeatable)")
    parser.add_argument("--connect-control", metavar="ADDR", default=None,
                        help="also record the daemon's model, settings, KV peak and "
                             "preemptions from its control socket")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, help="Poisson arrivals, requests per second")
    load.add_argument("--concurrency", type=int, help="requests kept in flight (default 16)")
    stop = parser.add_mutually_exclusive_group()
    stop.add_argument("--duration", type=float, help="seconds to send requests for")
    stop.add_argument("--requests", type=int, help="requests to send (default 100)")
    parser.add_argument("--workload", help="JSON lines: prompt|prompt_ids, max_tokens, tenant")
    parser.add_argument("--prompt", default="Write a short story about a lighthouse keeper.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="every request generates --max-tokens tokens, so that the report "
                             "measures decoding (a small model may end the default prompt "
                             "after a token or two); --no-ignore-eos stops at the model's end")
    parser.add_argument("--tenants", default=None, help="weights, e.g. a:2,b:1")
    parser.add_argument("--connections", type=int, default=8, help="client connections to use")
    parser.add_argument("--credit-window", type=int, default=64)
    parser.add_argument("--slo-ttft", type=float, default=None, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=None, help="seconds per output token")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {"p50": pick(0.50), "p95": pick(0.95), "p99": pick(0.99)}


def jain_index(values: list[float]) -> float | None:
    if not values or not any(values):
        return None
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def parse_tenants(spec: str | None) -> dict[str, float]:
    if not spec:
        return {"default": 1.0}
    weights = {}
    for part in spec.split(","):
        name, _, weight = part.partition(":")
        weights[name.strip()] = float(weight or 1)
        if weights[name.strip()] <= 0:
            raise ValueError(f"--tenants: weight of {name} must be > 0")
    return weights


def load_workload(args: argparse.Namespace) -> list[dict]:
    if not args.workload:
        return [{"prompt": args.prompt, "max_tokens": args.max_tokens}]
    items = []
    with open(args.workload) as handle:
        for line in handle:
            if line.strip():
                items.append(json.loads(line))
    if not items:
        raise ValueError(f"--workload {args.workload} is empty")
    return items


async def _one(client, item: dict, tenant: str, args, samples: list[Sample]) -> None:
    from sluice.ipc.vocabulary import RejectedError

    sample = Sample(tenant, time.perf_counter())
    samples.append(sample)
    kwargs = {k: item[k] for k in ("prompt", "prompt_ids", "messages") if k in item}
    try:
        generation = await client.generate(
            **kwargs, max_tokens=int(item.get("max_tokens", args.max_tokens)),
            temperature=args.temperature, ignore_eos=args.ignore_eos,
            tenant=item.get("tenant", tenant),
        )
    except RejectedError as exc:
        sample.rejected = exc.code.name.lower()
        return
    last = None
    async for chunk in generation:
        now = time.perf_counter()
        if not chunk.token_ids:
            continue
        if sample.ttft is None:
            sample.ttft = now - sample.start
        elif last is not None:
            sample.itl.append((now - last) / len(chunk.token_ids))
        last = now
        sample.tokens += len(chunk.token_ids)
    sample.e2e = time.perf_counter() - sample.start
    result = generation.result
    sample.finish_reason = result.finish_reason
    sample.prompt_tokens = result.usage.prompt_tokens
    sample.completion_tokens = result.usage.completion_tokens


def parse_api_keys(pairs: list[str]) -> dict[str, str]:
    keys = {}
    for pair in pairs:
        tenant, sep, key = pair.partition("=")
        if not sep or not tenant or not key:
            raise ValueError(f"--api-key {tenant}...: expected TENANT=KEY")
        keys[tenant] = key
    return keys


async def _one_http(front, item: dict, tenant: str, args, samples: list[Sample]) -> None:
    sample = Sample(tenant, time.perf_counter())
    samples.append(sample)
    await front.generate(item, item.get("tenant", tenant), sample,
                         max_tokens=int(item.get("max_tokens", args.max_tokens)),
                         temperature=args.temperature, ignore_eos=args.ignore_eos)


@dataclass
class Load:
    """What one load produced."""

    samples: list[Sample]
    seconds: float
    requests: int | None  # asked for (--requests, or the default); None: until --duration
    watch: DaemonWatch | None  # the daemon's status over the load; None without --connect-control


async def run_load(args: argparse.Namespace) -> Load:
    import trio

    from sluice.daemon.commands.bench_record import DaemonWatch
    from sluice.ipc.client import AsyncClient

    workload = load_workload(args)
    weights = parse_tenants(args.tenants)
    names = list(weights)
    rng = random.Random(args.seed)
    total = args.requests if args.requests is not None else (None if args.duration else 100)
    samples: list[Sample] = []
    watch = DaemonWatch(args.connect_control) if args.connect_control else None
    if watch is not None:
        await watch.sample()
    started = time.perf_counter()
    deadline = started + args.duration if args.duration else float("inf")
    async with contextlib.AsyncExitStack() as stack:
        if args.http:
            from sluice.daemon.commands.http_load import HttpFront

            front = HttpFront(args.http, parse_api_keys(args.api_key))
            stack.push_async_callback(front.aclose)
            await front.start()
            clients, one = [front], _one_http
        else:
            clients = [
                await stack.enter_async_context(
                    AsyncClient(args.connect, credit_window=args.credit_window))
                for _ in range(max(1, args.connections))
            ]
            one = _one
        async with trio.open_nursery() as watching:
            if watch is not None:
                watching.start_soon(watch.run)
            async with trio.open_nursery() as nursery:
                limiter = trio.Semaphore(args.concurrency or 16) if not args.rate else None
                for n in itertools.count():
                    if (total is not None and n >= total) or time.perf_counter() >= deadline:
                        break
                    if args.rate:
                        await trio.sleep(rng.expovariate(args.rate))
                    else:
                        await limiter.acquire()
                    item = workload[n % len(workload)]
                    tenant = rng.choices(names, weights=[weights[t] for t in names])[0]

                    async def task(client=clients[n % len(clients)], item=item, tenant=tenant):
                        try:
                            await one(client, item, tenant, args, samples)
                        finally:
                            if limiter is not None:
                                limiter.release()

                    nursery.start_soon(task)
            watching.cancel_scope.cancel()
    seconds = time.perf_counter() - started
    if watch is not None:
        await watch.sample()  # the KV left in use, and the preemptions over the load
    return Load(samples, seconds, total, watch)


async def bench(args: argparse.Namespace) -> dict:
    """Run the load `args` describe against the daemon; the report `--json` prints."""
    return summarize(args, await run_load(args))


def summarize(args, load: Load) -> dict:
    from sluice.daemon.commands.bench_record import run_record

    samples, seconds = load.samples, load.seconds
    done = [s for s in samples if s.rejected is None]
    output_tokens = sum(s.tokens for s in done)
    weights = parse_tenants(args.tenants)
    per_tenant = {}
    for name in weights:
        mine = [s for s in done if s.tenant == name]
        tokens = sum(s.tokens for s in mine)
        per_tenant[name] = {"requests": len(mine), "output_tokens": tokens,
                            "normalized_service": tokens / weights[name]}
    good = [s for s in done if s.ttft is not None
            and (args.slo_ttft is None or s.ttft <= args.slo_ttft)
            and (args.slo_tpot is None or (s.tpot or 0.0) <= args.slo_tpot)]
    rejected_by_code: dict[str, int] = {}
    for s in samples:
        if s.rejected:
            rejected_by_code[s.rejected] = rejected_by_code.get(s.rejected, 0) + 1
    run = run_record(args, load.requests,
                     [s.prompt_tokens for s in done if s.prompt_tokens is not None],
                     [s.completion_tokens for s in done if s.completion_tokens is not None],
                     load.watch)
    return {
        "run": run,
        "completed": len(done),
        "rejected": len(samples) - len(done),
        "rejected_by_code": rejected_by_code,
        "output_tokens": output_tokens,
        "seconds": seconds,
        "output_tokens_per_s": output_tokens / seconds if seconds else 0.0,
        "requests_per_s": len(done) / seconds if seconds else 0.0,
        "goodput_requests_per_s": len(good) / seconds if seconds else 0.0,
        "ttft": percentiles([s.ttft for s in done if s.ttft is not None]),
        "tpot": percentiles([s.tpot for s in done if s.tpot is not None]),
        "itl": percentiles([gap for s in done for gap in s.itl]),
        "e2e": percentiles([s.e2e for s in done]),
        "preemptions": None if load.watch is None else load.watch.preemptions,
        "finish_reasons": {r: sum(s.finish_reason == r for s in done)
                           for r in sorted({s.finish_reason for s in done})},
        "tenants": per_tenant,
        "jain_index": jain_index([t["normalized_service"] for t in per_tenant.values()]),
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}ms"


def run(args: argparse.Namespace) -> int:
    import trio

    from sluice.daemon.commands.http_load import HttpLoadError
    from sluice.ipc.vocabulary import SluiceError

    from sluice.daemon.commands.bench_record import header
    from sluice.daemon.heap import settle_collector

    # the load's messages are short-lived and free no cycles, as in the daemon: a young
    # collection every 700 allocations would be the client's cost, not the daemon's
    settle_collector()
    try:
        report = trio.run(bench, args)
    except (SluiceError, ValueError, OSError, HttpLoadError) as exc:
        print(f"sluice bench: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
        return 0
    seconds = report["seconds"]
    for line in header(report["run"]):
        print(line)
    print(f"completed {report['completed']}  rejected {report['rejected']}  "
          f"in {seconds:.2f}s  output {report['output_tokens']} tokens "
          f"({report['output_tokens_per_s']:.0f} tok/s)  goodput "
          f"{report['goodput_requests_per_s']:.2f} req/s")
    for name in ("ttft", "tpot", "itl", "e2e"):
        p = report[name]
        print(f"{name:5s} p50 {_ms(p['p50'])}  p95 {_ms(p['p95'])}  p99 {_ms(p['p99'])}")
    if report["preemptions"] is not None:
        print(f"preemptions {report['preemptions']}")
    if len(report["tenants"]) > 1:
        for name, t in report["tenants"].items():
            print(f"tenant {name}: {t['requests']} requests, {t['output_tokens']} tokens")
        print(f"jain index {report['jain_index']:.3f}")
    return 0
