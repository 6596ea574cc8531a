"""The soak's report: the summary a reader looks at first, and the list of problems.

Everything here reads the report dictionary `soak.py` assembled (and the daemon's log); it
measures nothing itself. A problem is anything a user of the daemon would call a defect:
a lost or doubled `Finished`, a KV block still held, a broken invariant, a failed
well-behaved request (ZeroMQ or HTTP), a freeze, an answer to a hostile HTTP client other
than the one the README promises, the daemon's RSS past its baseline by more than
`RSS_GROWTH_LIMIT_MIB`, prompt text in the log, an unclean stop.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from soak_wire import PROMPT_MARK


def log_findings(path: Path) -> dict:
    """Levels of the daemon's log events, the warnings' names, and any prompt text in it."""
    levels, events, leaks = Counter(), Counter(), 0
    for line in path.read_text(errors="replace").splitlines():
        leaks += PROMPT_MARK in line
        try:
            event = json.loads(line)
        except ValueError:
            levels["not json"] += 1
            continue
        level = str(event.get("level", "?"))
        levels[level] += 1
        if level in ("warning", "error", "critical"):
            events[f"{level}: {event.get('event', '?')}"] += 1
    return {"levels": dict(levels), "warnings_and_errors": dict(events.most_common(15)),
            "lines_with_prompt_text": leaks}


LOAD_WARMUP_SECONDS = 120  # hostile load fills allocator arenas and caches in this time
# the daemon's RSS may rise this far above its baseline (when the hostile clients start)
# under their load: queues and caches whose bounds are set by the config, not by the load
RSS_GROWTH_LIMIT_MIB = 200


def growth_after_load_warmup(samples: list, last: dict) -> dict:
    """RSS once the soak's load ran `LOAD_WARMUP_SECONDS`, and its growth from there to the end
    (per cent): what a leak would show as, free of the first minutes' one-off growth. The
    worker is restarted by the faults, so its growth is taken per process, from its first
    sample serving after the warm-up to its last sample serving, and the largest is given."""
    warmed = next((s for s in samples if s[0] >= LOAD_WARMUP_SECONDS), None)
    if warmed is None:
        return {}

    def growth(then: float | None, now: float | None) -> float | None:
        return round(100 * (now - then) / then, 1) if then and now else None

    serving: dict[int, list[float]] = {}  # worker pid -> its RSS while ready, in order
    for at, _, rss, pid, state in (s for s in samples if len(s) == 5):
        if at >= LOAD_WARMUP_SECONDS and state == "ready" and pid and rss:
            serving.setdefault(pid, []).append(rss)
    per_worker = [growth(rss[0], rss[-1]) for rss in serving.values() if len(rss) > 1]
    return {"daemon_after_load_warmup": warmed[1],
            "daemon_growth_percent": growth(warmed[1], last["daemon_rss_mib"]),
            "worker_processes_sampled": len(per_worker),
            "worker_longest_sampled_minutes": max((len(r) - 1 for r in serving.values()),
                                                  default=0),
            "worker_growth_percent": max(per_worker, default=None)}


def summary(report: dict) -> dict:
    """The numbers a reader looks at first; the rest of the report explains them."""
    base, load = report["well_behaved"]["baseline"], report["well_behaved"]["under_soak"]
    tallies = report["hostile"].values()
    end = report["end"]
    never_ended = None
    if "counters" in end:
        counters, live = end["counters"], sum(end["requests"].values())
        # the daemon counts a request cancelled before it was admitted as cancelled, not
        # accepted, so this goes negative in cancel storms; above zero, requests were lost
        never_ended = counters["accepted"] - counters["finished"] - counters["cancelled"] - live

    def ratio(key: str) -> float | None:
        return round(load[key] / base[key], 2) if load[key] and base[key] else None

    warm, last = report["memory_after_warmup"], report["memory_at_end"]
    return {
        "requests_accepted": {"well_behaved": base["accepted"] + load["accepted"],
                              "hostile": sum(t["accepted"] for t in tallies),
                              "daemon_counter": end.get("counters", {}).get("accepted")},
        # non-readers and mid-stream disconnects are not waited for: they left on purpose
        "without_exactly_one_finished": {
            "well_behaved": base["without_finished"] + load["without_finished"],
            "hostile_missing": sum(t["missing_finished"] for t in tallies),
            "hostile_duplicate": sum(t["duplicate_finished"] for t in tallies),
            "daemon_accepted_minus_ended": never_ended},
        "kv_blocks_held_at_end": end.get("kv", {}).get("used_blocks"),
        "invariant_errors": end.get("invariant_errors"),
        "rss_mib": {"daemon_after_warmup": warm["daemon_rss_mib"],
                    "daemon_at_end": last["daemon_rss_mib"],
                    "worker_after_warmup": warm["worker_rss_mib"],
                    "worker_at_end": last["worker_rss_mib"],
                    **growth_after_load_warmup(report["status_while_running"]["memory"], last)},
        "well_behaved_latency_seconds": {
            "baseline_p50": base["p50_seconds"], "baseline_p99": base["p99_seconds"],
            "under_soak_p50": load["p50_seconds"], "under_soak_p99": load["p99_seconds"],
            "p50_ratio": ratio("p50_seconds"), "p99_ratio": ratio("p99_seconds"),
            # requests that overlapped no worker or scheduler outage: what the load alone cost
            "caught_by_faults": load.get("caught_by_faults"),
            "under_soak_p99_outside_faults": load.get("outside_faults_p99_seconds"),
            "p99_ratio_outside_faults": (
                round(load["outside_faults_p99_seconds"] / base["p99_seconds"], 2)
                if load.get("outside_faults_p99_seconds") and base["p99_seconds"] else None)},
        "well_behaved_failed": {"baseline": base["failed"], "under_soak": load["failed"]},
        "freezes": load["liveness"]["freezes"] + base["liveness"]["freezes"],
        "daemon_cpu_while_settling": report["settle"],
        "daemon_rss_mib": {key: report.get("daemon_rss", {}).get(f"{key}_mib")
                           for key in ("baseline", "peak", "end")},
        **({"well_behaved_http": {
            phase: {key: numbers[key] for key in ("requests", "completed", "failed",
                                                  "reconnects", "p50_seconds", "p99_seconds")}
            for phase, numbers in report["well_behaved_http"].items()}}
           if "well_behaved_http" in report else {}),
    }


def problems(report: dict) -> list[str]:
    """Everything in the report a user of the daemon would call a defect."""
    found = []
    end = report.get("end", {})
    if "error" in end:
        found.append(f"end state unknown: {end['error']}")
    else:
        if end["invariant_errors"]:
            found.append(f"KV invariant broken: {end['invariant_errors'][:3]}")
        if end["kv"]["used_blocks"]:
            found.append(f"{end['kv']['used_blocks']} KV blocks still held after the settle")
        live = sum(end["requests"].values())
        if live:
            found.append(f"{live} requests still live after the settle")
        if end["connections"]:
            found.append(f"{end['connections']} connections still open after every client left")
    # a crashed actor ends the requests it held with an error (docs/architecture.md): those are the
    # fault doing what it should, not a defect; any other failure is one
    crashes = "crash_scheduler" in report.get("chaos_kinds", ())
    for phase, numbers in report["well_behaved"].items():
        expected = numbers["failures"].get("finished: error", 0) if crashes else 0
        if numbers["failed"] > expected:
            found.append(f"{numbers['failed'] - expected} well-behaved requests failed "
                         f"({phase}): {numbers['failures']}")
        frozen = numbers["liveness"]
        if frozen["unanswered"]:
            found.append(f"daemon unresponsive ({phase}): {frozen['unanswered']} of "
                         f"{frozen['probes']} probes unanswered, freezes {frozen['freezes']}")
    for phase, numbers in report.get("well_behaved_http", {}).items():
        failures = numbers["failures"]
        expected = (failures.get("error event: error", 0) + failures.get("http 500: error", 0)
                    if crashes else 0)
        if numbers["failed"] > expected:
            found.append(f"{numbers['failed'] - expected} well-behaved HTTP requests failed "
                         f"({phase}): {failures}")
    rss = report.get("daemon_rss", {})
    if rss.get("peak_mib") and rss["peak_mib"] - rss["baseline_mib"] > RSS_GROWTH_LIMIT_MIB:
        found.append(f"the daemon's RSS peaked at {rss['peak_mib']} MiB, "
                     f"{rss['peak_mib'] - rss['baseline_mib']:.0f} MiB over its baseline of "
                     f"{rss['baseline_mib']} MiB ({rss['peak_at_seconds']} s into the soak)")
    never_ended = summary(report)["without_exactly_one_finished"]["daemon_accepted_minus_ended"]
    if never_ended and never_ended > 0:
        found.append(f"{never_ended} requests the daemon accepted neither finished nor live")
    if "hostile_process_error" in report:
        found.append(f"the hostile clients' process failed: {report['hostile_process_error']}")
    for name, tally in report["hostile"].items():
        if tally["missing_finished"] or tally["duplicate_finished"]:
            found.append(f"{name}: {tally['missing_finished']} accepted requests without a "
                         f"Finished, {tally['duplicate_finished']} with more than one")
        unexpected = {k: n for k, n in tally["outcomes"].items() if k.startswith("unexpected")}
        if unexpected:
            found.append(f"{name}: answers other than the README's: {unexpected}")
    for fault in report["faults"]:
        if "error" in fault or fault.get("ready_after_seconds", 0) is None:
            found.append(f"fault {fault['kind']} at {fault['at']}s: "
                         f"{fault.get('error', 'the worker did not come back')}")
    status = report["status_while_running"]
    if status["peak_connections"] > status["max_connections"]:
        found.append(f"connection cap not enforced: the daemon reported "
                     f"{status['peak_connections']} live connections with max_connections = "
                     f"{status['max_connections']}")
    if not report["daemon_alive_after_soak"]:
        found.append("the daemon died during the soak")
    stopped = report.get("stop", {})
    if stopped.get("exit_code") not in (0, None) or stopped.get("killed_after_sigterm"):
        found.append(f"SIGTERM did not end the daemon cleanly: {stopped}")
    if report.get("log", {}).get("lines_with_prompt_text"):
        found.append("prompt text in the daemon's log")
    return found
