"""Scenario files for the simulator: the scheduler config, a cost model, tenants and requests.

Only parsing and validation live here; `simulator.py` runs a scenario. A scenario is TOML:
`[scheduler]` (any `SchedulerConfig` key), `[cost]`, `[simulation]` (stop conditions),
`[[tenants]]`, `[[requests]]` and `[[generators]]` (many similar requests at a fixed interval).
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.actors.scheduler.config import ConfigError, SchedulerConfig

_TOP_LEVEL = {
    "scheduler",
    "cost",
    "simulation",
    "tenants",
    "requests",
    "generators",
    "name",
    "description",
}
_REQUEST_KEYS = {
    "id",
    "tenant",
    "arrival_round",
    "arrival_time",
    "prompt",
    "output",
    "priority",
    "cancel_round",
    "cancel_time",
    "prefix",
    "prefix_len",
    "timeout",
}
_GENERATOR_KEYS = {
    "id_prefix",
    "tenant",
    "count",
    "start_round",
    "start_time",
    "every_rounds",
    "every_seconds",
    "prompt",
    "output",
    "priority",
    "prefix",
    "prefix_len",
    "timeout",
}


@dataclass(frozen=True)
class CostModel:
    """Seconds one round takes: step + prefill tokens * per_prefill_token + decodes * per_decode."""

    step: float = 0.0
    per_prefill_token: float = 1.0
    per_decode_token: float = 1.0

    def round_seconds(self, prefill_tokens: int, decode_tokens: int) -> float:
        return (
            self.step
            + prefill_tokens * self.per_prefill_token
            + decode_tokens * self.per_decode_token
        )


@dataclass(frozen=True)
class SimRequest:
    id: str
    prompt: int  # prompt tokens
    output: int  # output tokens it will generate
    tenant: str = "default"
    priority: int = 0
    arrival_round: int | None = None
    arrival_time: float | None = None
    cancel_round: int | None = None
    cancel_time: float | None = None
    prefix: str | None = None  # requests naming the same prefix share their first prefix_len tokens
    prefix_len: int = 0
    timeout: float | None = None  # seconds from arrival; else its tenant's default


@dataclass
class Scenario:
    config: SchedulerConfig
    cost: CostModel
    requests: list[SimRequest]
    max_rounds: int | None = None
    max_time: float | None = None
    name: str = "scenario"
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> Scenario:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except OSError as exc:
            raise ConfigError(f"{path}: {exc.strerror or exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
        data.setdefault("name", path.stem)
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Scenario:
        unknown = sorted(set(data) - _TOP_LEVEL)
        if unknown:
            raise ConfigError(f"scenario: unknown table(s) {', '.join(unknown)}")
        sched = dict(data.get("scheduler", {}))
        sched.setdefault("first_token_from_prefill", True)
        tenants = data.get("tenants", [])
        if tenants:
            merged = dict(_tenant_table(sched.get("tenants", {})))
            merged.update(_tenant_table(tenants))
            sched["tenants"] = merged
        config = SchedulerConfig.from_dict(sched)
        cost_data = dict(data.get("cost", {}))
        bad = sorted(set(cost_data) - {"step", "per_prefill_token", "per_decode_token"})
        if bad:
            raise ConfigError(f"cost: unknown key(s) {', '.join(bad)}")
        cost = CostModel(**{k: float(v) for k, v in cost_data.items()})
        sim = dict(data.get("simulation", {}))
        bad = sorted(set(sim) - {"max_rounds", "max_time"})
        if bad:
            raise ConfigError(f"simulation: unknown key(s) {', '.join(bad)}")
        requests = [_parse_request(i, r) for i, r in enumerate(data.get("requests", []))]
        for g, gen in enumerate(data.get("generators", [])):
            requests.extend(_expand_generator(g, gen))
        ids = [r.id for r in requests]
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})[:3]
            raise ConfigError(f"requests: duplicate id(s) {', '.join(dup)}")
        return cls(
            config,
            cost,
            requests,
            sim.get("max_rounds"),
            sim.get("max_time"),
            str(data.get("name", "scenario")),
        )


def _tenant_table(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return dict(raw)
    table = {}
    for entry in raw:
        if not isinstance(entry, dict) or "name" not in entry:
            raise ConfigError("tenants: each [[tenants]] entry needs a name")
        entry = dict(entry)
        table[str(entry.pop("name"))] = entry
    return table


def _parse_request(index: int, raw: dict[str, Any]) -> SimRequest:
    where = f"requests[{index}]"
    unknown = sorted(set(raw) - _REQUEST_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}")
    if "id" not in raw:
        raise ConfigError(f"{where}: id is required")
    where = f"requests.{raw['id']}"
    for key in ("prompt", "output"):
        if not isinstance(raw.get(key), int) or raw[key] < 1:
            raise ConfigError(f"{where}.{key}: must be an integer >= 1")
    if ("arrival_round" in raw) == ("arrival_time" in raw):
        if "arrival_time" in raw:
            raise ConfigError(f"{where}: give arrival_round or arrival_time, not both")
        raw = {**raw, "arrival_round": 0}
    if "cancel_round" in raw and "cancel_time" in raw:
        raise ConfigError(f"{where}: give cancel_round or cancel_time, not both")
    timeout = raw.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                or not 0 < timeout < math.inf):
        raise ConfigError(f"{where}.timeout: must be a number of seconds > 0")
    values = dict(raw)
    values["id"] = str(values["id"])
    return SimRequest(**values)


def _expand_generator(index: int, raw: dict[str, Any]) -> list[SimRequest]:
    where = f"generators[{index}]"
    unknown = sorted(set(raw) - _GENERATOR_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}")
    count = raw.get("count")
    if not isinstance(count, int) or count < 1:
        raise ConfigError(f"{where}.count: must be an integer >= 1")
    prefix = raw.get("id_prefix", f"g{index}-")
    by_time = "start_time" in raw or "every_seconds" in raw
    requests = []
    for i in range(count):
        item: dict[str, Any] = {
            "id": f"{prefix}{i}",
            "prompt": raw.get("prompt"),
            "output": raw.get("output"),
        }
        for key in ("tenant", "priority", "prefix", "prefix_len", "timeout"):
            if key in raw:
                item[key] = raw[key]
        if by_time:
            item["arrival_time"] = float(raw.get("start_time", 0.0)) + i * float(
                raw.get("every_seconds", 0.0)
            )
        else:
            item["arrival_round"] = int(raw.get("start_round", 0)) + i * int(
                raw.get("every_rounds", 0)
            )
        requests.append(_parse_request(index, item))
    return requests


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
