"""Soak: the daemon under well-behaved load, hostile clients and faults for N minutes.

    .venv/bin/python benchmarks/soak.py --minutes 0.5                      # null executor
    .venv/bin/python benchmarks/soak.py --executor model --minutes 2
    .venv/bin/python benchmarks/soak.py --hostile flood --chaos none       # one mode alone
    .venv/bin/python benchmarks/soak.py --hostile http --chaos none        # the HTTP front's
    .venv/bin/python benchmarks/soak.py --listen ipc --hostile garbage_churn --chaos none

Phases, against one `sluiced serve` child process on loopback: warm-up; a quiet baseline
(the well-behaved clients alone); the soak (the same clients beside the hostile modes of
`soak_hostile.py`, with the faults of `soak_daemon.py` at intervals); then the settle (every
client gone, the daemon must drain to no live request and no used KV block, with the KV
invariant holding). The daemon's clients reach it over tcp:// or, with `--listen ipc`, an
ipc:// socket; with an `http_*` mode its HTTP front runs too, and HTTP clients join the
well-behaved ones. Its RSS is read every second. One JSON object goes to stdout, progress to
stderr; the exit status is 1 when the report lists a problem. A frozen daemon is reported,
not waited for: every wait here has a timeout.

This file holds the phases, the well-behaved ZeroMQ clients (the client library, as
applications use it) and the report; the well-behaved HTTP client is in `soak_http.py`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import trio

from sluice.ipc.client import AsyncClient
from sluice.ipc.control import fetch_status
from sluice.ipc.vocabulary import RejectedError, SluiceError

import soak_daemon as sd
import soak_faults as sf
import soak_hostile as sh
from soak_http import (HTTP_KEYS, WEB_STRANGERS, WEB_TRICKLERS, model_name,
                       well_behaved_http_client)
from soak_report import log_findings, problems, summary
from soak_wire import PROMPT_MARK


@dataclass
class WellBehaved:
    """Requests of the well-behaved clients: latency from send to `Finished`, and failures."""

    latencies: list[float] = field(default_factory=list)
    spans: list[tuple[float, float]] = field(default_factory=list)  # (sent, finished), trio clock
    accepted: int = 0
    without_finished: int = 0  # accepted, then no Finished within the timeout
    failures: Counter = field(default_factory=Counter)  # what went wrong -> n
    reconnects: int = 0  # HTTP: kept-alive connections the daemon closed while idle

    def report(self, outages: list[tuple[float, float]] = ()) -> dict:
        """`outages`: (from, to) on the trio clock while faults kept the daemon from serving;
        the requests that overlap none are also reported apart."""
        report = {"requests": len(self.latencies) + sum(self.failures.values()),
                  "accepted": self.accepted, "completed": len(self.latencies),
                  "without_finished": self.without_finished,
                  "failed": sum(self.failures.values()), "failures": dict(self.failures),
                  "reconnects": self.reconnects,
                  "p50_seconds": _quantile(self.latencies, 0.50),
                  "p99_seconds": _quantile(self.latencies, 0.99)}
        if outages:
            clear = [end - sent for sent, end in self.spans
                     if not any(sent < to and end > since for since, to in outages)]
            report["caught_by_faults"] = len(self.spans) - len(clear)
            report["outside_faults_p50_seconds"] = _quantile(clear, 0.50)
            report["outside_faults_p99_seconds"] = _quantile(clear, 0.99)
        return report


def _quantile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4) if ordered else None


# faults after which no request is served until the daemon says it recovered
OUTAGE_FAULTS = ("kill_worker", "worker_down", "crash_scheduler")


def outages(faults: list[dict], origin: float | None) -> list[tuple[float, float]]:
    """The (from, to) windows, on the trio clock, of the faults that stopped serving."""
    if origin is None:
        return []
    return [(origin + f["at"], origin + f["at"] + f.get("ready_after_seconds", 0.0))
            for f in faults if f.get("kind") in OUTAGE_FAULTS]


async def well_behaved_client(listen: str, number: int, max_tokens: int, timeout: float,
                              record: WellBehaved, stop: trio.Event) -> None:
    """One application: a chat request, read to the end, a short think, again."""
    n = 0
    while not stop.is_set():
        async with AsyncClient(listen, credit_window=8) as client:
            while not stop.is_set():
                n += 1
                started = trio.current_time()
                accepted = False
                try:
                    with trio.fail_after(timeout):
                        generation = await client.generate(
                            messages=[{"role": "user",
                                       "content": f"{PROMPT_MARK} client {number} asks #{n}"}],
                            max_tokens=max_tokens, temperature=0.0)
                        record.accepted += 1
                        accepted = True
                        result = await generation.collect()
                except trio.TooSlowError:
                    record.failures[f"no answer within {timeout:g}s"] += 1
                    record.without_finished += accepted
                    break  # this connection may be wedged: start a fresh one
                except RejectedError as exc:
                    record.failures[f"rejected: {type(exc).__name__} [{exc.field}]"] += 1
                    await trio.sleep(0.2)
                    continue
                except SluiceError as exc:
                    record.failures[f"{type(exc).__name__}"] += 1
                    record.without_finished += accepted
                    break
                if result.finish_reason in ("length", "stop"):
                    record.latencies.append(trio.current_time() - started)
                    record.spans.append((started, trio.current_time()))
                else:
                    record.failures[f"finished: {result.finish_reason}"] += 1
                await trio.sleep(0.05)


async def hostile_process(command: list[str], into: dict) -> None:
    """Run the hostile modes' process to its end; its tallies (or what went wrong) go into
    `into`."""
    done = await trio.run_process(command, capture_stdout=True, capture_stderr=True,
                                  check=False)
    try:
        into["tallies"] = json.loads(done.stdout)
    except ValueError:
        into["error"] = (f"exit {done.returncode}: "
                         f"{done.stderr.decode(errors='replace')[-2000:]}")


async def run_clients(args, daemon: sd.DaemonProcess, seconds: float, record: WellBehaved,
                      extra=None, web: WellBehaved | None = None) -> None:
    """The well-behaved clients (and `extra(nursery, stop)`) for `seconds`, then stop them;
    past a grace period whatever still waits is cancelled. `web`: the HTTP clients' record,
    when they run."""
    stop = trio.Event()
    with trio.move_on_after(seconds + args.request_timeout + 10):
        async with trio.open_nursery() as nursery:
            for number in range(args.clients):
                nursery.start_soon(well_behaved_client, daemon.listen, number, args.max_tokens,
                                   args.request_timeout, record, stop)
            for number in range(args.http_clients if web is not None else 0):
                nursery.start_soon(well_behaved_http_client, daemon.http, args.http_model,
                                   number, args.max_tokens, args.request_timeout, web, stop)
            if extra is not None:
                # applications hold their connections: the hostile ones (a hoarder among
                # them) start once every well-behaved client is connected and served
                with trio.move_on_after(10):
                    while record.accepted < args.clients:
                        await trio.sleep(0.05)
                extra(nursery, stop)
            await trio.sleep(seconds)
            stop.set()


async def settle(control: str, timeout: float) -> dict:
    """Wait for no live request, no used block and no connection (a vanished client is
    noticed within the heartbeat timeout); then the status with the KV check."""
    with trio.move_on_after(timeout):
        while True:
            try:
                report = await fetch_status(control, timeout=5.0)
                live = report.requests.waiting + report.requests.running + report.requests.paused
                if live == 0 and report.kv.used_blocks == 0 and report.connections == 0:
                    break
            except SluiceError:
                pass
            await trio.sleep(0.5)
    try:
        report = await fetch_status(control, check_invariants=True, timeout=10.0)
    except SluiceError as exc:
        return {"error": f"no status: {exc}"}
    return {"worker": asdict(report.worker), "kv": asdict(report.kv),
            "requests": asdict(report.requests), "counters": asdict(report.counters),
            "connections": report.connections, "gateway": asdict(report.gateway),
            "invariant_errors": list(report.invariant_errors)}


async def soak(args, daemon: sd.DaemonProcess) -> dict:
    """The phases, with the daemon's RSS read every second meanwhile."""
    rss = sd.RssWatch(daemon.pid)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(rss.watch)
        report = await phases(args, daemon, rss)
        nursery.cancel_scope.cancel()
    report["daemon_rss"] = rss.report()
    return report


async def phases(args, daemon: sd.DaemonProcess, rss: sd.RssWatch) -> dict:
    report: dict = {"executor": args.executor, "minutes": args.minutes, "listen": args.listen,
                    "hostile_modes": args.hostile, "chaos_kinds": args.chaos}
    if daemon.http:
        args.http_model = await model_name(daemon.http)
    progress("warm-up")
    warm = WellBehaved()
    await run_clients(argparse.Namespace(**{**vars(args), "clients": 1}), daemon,
                      args.warmup_seconds, warm)
    report["memory_after_warmup"] = sd.memory(daemon)

    progress(f"baseline: {args.clients} well-behaved clients"
             f"{f' and {args.http_clients} over HTTP' if daemon.http else ''}"
             f" for {args.baseline_seconds:g}s")
    baseline, quiet = WellBehaved(), sd.Liveness()
    web_baseline, web_loaded = (WellBehaved(), WellBehaved()) if daemon.http else (None, None)
    await run_clients(args, daemon, args.baseline_seconds, baseline,
                      lambda nursery, stop: nursery.start_soon(
                          quiet.watch, daemon.listen, trio.current_time(), stop), web_baseline)

    progress(f"soak: {args.minutes:g} min with {','.join(args.hostile) or 'no hostiles'}"
             f" and {','.join(args.chaos) or 'no faults'}")
    loaded, liveness, watch = WellBehaved(), sd.Liveness(), sd.StatusWatch()
    plan = sh.Plan(max_tokens=args.long_tokens, max_frame_bytes=sd.MAX_FRAME_BYTES,
                   request_timeout=args.request_timeout,
                   non_readers=2 if args.executor == "model" else 4,
                   storm_requests=8 if args.executor == "model" else 16,
                   hoard_connections=sd.MAX_CONNECTIONS + 32,
                   http=daemon.http or "", http_key=HTTP_KEYS[WEB_STRANGERS],
                   http_trickle_key=HTTP_KEYS[WEB_TRICKLERS],
                   http_model=args.http_model,
                   http_flood_connections=2 * sd.HTTP_CONNECTIONS)
    hostile: dict = {}
    faults: list[dict] = []
    origins: list[float] = []

    def hostiles(nursery: trio.Nursery, stop: trio.Event) -> None:
        origin = trio.current_time()  # times of freezes and faults count from here
        origins.append(origin)
        rss.mark_baseline()
        nursery.start_soon(liveness.watch, daemon.listen, origin, stop)
        if args.hostile:
            nursery.start_soon(hostile_process, sh.command(
                daemon.listen, plan, args.hostile, args.minutes * 60), hostile)
        nursery.start_soon(partial(watch.watch, daemon.control, stop, daemon=daemon))
        nursery.start_soon(sf.chaos, args.chaos, daemon, origin, args.chaos_interval, stop,
                           faults, args.recovery_timeout, args.long_tokens)

    await run_clients(args, daemon, args.minutes * 60, loaded, hostiles, web_loaded)

    progress("settle: every client gone; waiting for the daemon to drain")
    report["daemon_alive_after_soak"] = daemon.alive()
    report["memory_after_soak"] = sd.memory(daemon)
    settle_started = trio.current_time()
    # a daemon that does not answer now gets a short settle: one more look, not a minute
    answering = await sd.describe_once(daemon.listen, 5.0) is not None
    settle_seconds = args.settle_seconds if answering else 5.0
    report["end"] = await settle(daemon.control, settle_seconds) if daemon.alive() \
        else {"error": f"the daemon exited with {daemon.process.returncode}"}
    report["memory_at_end"] = sd.memory(daemon)
    rss.mark_end()
    # CPU close to wall time while nothing is asked of it: the daemon is spinning
    cpu = [report[k]["daemon_cpu_seconds"] for k in ("memory_after_soak", "memory_at_end")]
    report["settle"] = {"wall_seconds": round(trio.current_time() - settle_started, 1),
                        "daemon_cpu_seconds": None if None in cpu else round(cpu[1] - cpu[0], 1)}
    answer = await sd.describe_once(daemon.listen, 5.0)
    report["end"]["describe_answered"] = answer is not None
    report["well_behaved"] = {
        "baseline": baseline.report(),
        "under_soak": loaded.report(outages(faults, origins[0] if origins else None))}
    for phase in ("baseline", "under_soak"):
        report["well_behaved"][phase]["liveness"] = (quiet if phase == "baseline"
                                                     else liveness).report()
    if daemon.http:
        report["well_behaved_http"] = {
            "baseline": web_baseline.report(),
            "under_soak": web_loaded.report(outages(faults, origins[0] if origins else None))}
    report["hostile"] = hostile.get("tallies", {})
    if "error" in hostile:
        report["hostile_process_error"] = hostile["error"]
    report["faults"] = faults
    report["status_while_running"] = {**watch.report(),
                                      "max_connections": sd.MAX_CONNECTIONS}
    return report


def progress(line: str) -> None:
    print(f"soak: {line}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--executor", choices=("null", "model"), default="null")
    parser.add_argument("--minutes", type=float, default=1.0, help="length of the soak phase")
    parser.add_argument("--hostile", default=",".join(sh.MODES),
                        help=f"comma-separated modes, zmq or http for all of one front's, or "
                             f"none (default all: {','.join(sh.MODES)})")
    parser.add_argument("--listen", choices=("tcp", "ipc"), default="tcp",
                        help="the daemon's client address, for every ZeroMQ client (default "
                             "tcp: 127.0.0.1, any free port; ipc: a socket in a temporary "
                             "folder)")
    parser.add_argument("--chaos", default=None,
                        help="comma-separated faults of " + ",".join(sf.CHAOS_KINDS) +
                             ", or none (default: all that apply to the executor)")
    parser.add_argument("--chaos-interval", type=float, default=None,
                        help="seconds between faults (default 15 null, 120 model)")
    parser.add_argument("--clients", type=int, default=None,
                        help="well-behaved clients (default 4)")
    parser.add_argument("--http-clients", type=int, default=2,
                        help="well-behaved HTTP clients, when an http mode runs (default 2)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="per well-behaved request (default 32 null, 8 model)")
    parser.add_argument("--no-pin-worker", dest="pin_worker", action="store_false",
                        help="let the model worker share every CPU with the daemon and the "
                             "clients (default: the worker gets a CPU of its own)")
    parser.add_argument("--keep-log", type=Path, default=None,
                        help="copy the daemon's log (JSON lines) to this file")
    parser.add_argument("--baseline-seconds", type=float, default=None,
                        help="quiet baseline (default: a quarter of the soak, 5 to 30 s)")
    args = parser.parse_args(argv)
    model = args.executor == "model"
    args.hostile = _names(args.hostile, sh.MODES, parser, "--hostile", sh.GROUPS)
    args.http = any(name in sh.HTTP_MODES for name in args.hostile)
    args.http_model = ""
    default_chaos = ",".join(sf.CHAOS_KINDS[0 if model else 1:])
    args.chaos = _names(args.chaos or default_chaos, sf.CHAOS_KINDS, parser, "--chaos")
    # at least three faults in a short run. A model worker takes 7-15 s to start again on
    # two cores (weights, known-answer check); a fault every 30 s kept it down a quarter of
    # the soak, which measures restarts, not serving. Every 120 s it is down ~5% of the time.
    args.chaos_interval = args.chaos_interval or min(120.0 if model else 15.0,
                                                     args.minutes * 60 / 4)
    args.clients = args.clients or 4
    args.max_tokens = args.max_tokens or (8 if model else 32)
    args.baseline_seconds = args.baseline_seconds or min(30.0, max(5.0, args.minutes * 15))
    args.warmup_seconds = 10.0 if model else 2.0
    args.long_tokens = 48 if model else 3000  # non-readers, disconnects, decoys
    args.request_timeout = 120.0 if model else 30.0
    args.recovery_timeout = 240.0 if model else 30.0
    args.settle_seconds = 60.0
    return args


def _names(text: str, known, parser: argparse.ArgumentParser, flag: str,
           groups: dict[str, list[str]] | None = None) -> list[str]:
    names = [] if text == "none" else [n.strip() for n in text.split(",") if n.strip()]
    names = list(dict.fromkeys(m for n in names for m in (groups or {}).get(n, [n])))
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"{flag}: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    return names


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sluice-soak-") as folder:
        progress(f"starting sluiced --executor {args.executor}")
        layout = sd.cpu_layout(args.executor, args.pin_worker)
        daemon = sd.start_daemon(args.executor, Path(folder), layout, listen=args.listen,
                                 http=args.http)
        try:
            report = trio.run(soak, args, daemon)
        finally:
            stop = sd.stop_daemon(daemon)
        report["stop"] = stop
        report["cpus"] = layout
        report["log"] = log_findings(daemon.log_path)
        if args.keep_log is not None:
            shutil.copyfile(daemon.log_path, args.keep_log)
    report = {"problems": problems(report), "summary": summary(report), **report}
    print(json.dumps(report, indent=2))
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
