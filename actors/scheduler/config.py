"""Scheduler settings: the `[scheduler]` table of a config or scenario file, and per-tenant limits.

Only plain data and its validation live here; what the numbers mean in a step is `scheduler.py`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from sluice.ipc.vocabulary import TenantLimits

DEFAULT_TENANT = "default"  # always exists: requests that name no tenant run as it
POLICIES = ("fcfs", "priority", "srpt", "fair")
ORDERS = ("decode_first", "prefill_first")
ADMISSIONS = ("optimistic", "reserve")


class ConfigError(ValueError):
    """A scheduler setting is unknown or out of range; the message names the key."""


@dataclass(frozen=True)
class TenantConfig(TenantLimits):
    """What one tenant may use: its limits (`TenantLimits`, `None` for no limit of that
    kind, given by keyword) and its share and cache settings."""

    weight: float = 1.0  # share in the fair policy, relative to other tenants
    # prefix-cache hits reveal that someone sent the same text, so each tenant's hash chain
    # starts from its own salt; tenants that opt in share one chain (`share_prefix_cache`
    # with every other opted-in tenant, or `prefix_cache_group` with that group's members)
    share_prefix_cache: bool = False
    prefix_cache_group: str | None = None

    def __post_init__(self) -> None:
        if not _is_number(self.weight) or self.weight <= 0:
            raise ConfigError(f"weight: must be > 0, got {self.weight!r}")
        if not isinstance(self.share_prefix_cache, bool):
            raise ConfigError(
                f"share_prefix_cache: must be true or false, got {self.share_prefix_cache!r}"
            )
        group = self.prefix_cache_group
        if group is not None and (not isinstance(group, str) or not group):
            raise ConfigError(f"prefix_cache_group: must be a non-empty string, got {group!r}")
        if (problem := self.problem()) is not None:
            raise ConfigError(problem)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TenantConfig:
        _reject_unknown(cls, data, "tenant")
        return cls(**data)


@dataclass(frozen=True)
class SchedulerConfig:
    """How the core spends each iteration; defaults suit a real engine on one device."""

    policy: str = "fair"
    order: str = "decode_first"  # which of decode tokens and prefill chunks get the budget first
    token_budget: float = 512  # C in  w_p * prefill_tokens + w_d * decode_tokens <= C
    prefill_weight: float = 1.0  # w_p
    decode_weight: float = 1.0  # w_d
    decode_share: float = 0.0  # fraction of C that prefill can never take while decodes wait
    max_prefill_chunk: int = 512  # prompt tokens of one request per iteration
    max_prefilling: int = 4  # requests prefilling in the same iteration
    max_running: int = 256  # requests holding KV and being stepped
    max_wait: float | None = 30.0  # seconds; past it a waiting request goes first (aging)
    fair_prompt_cost: float = 1.0  # c_p in the fair policy's service count
    fair_output_cost: float = 1.0  # c_d
    first_token_from_prefill: bool = True
    kv_blocks: int = 1024  # blocks in the KV pool (the engine overrides it from memory)
    block_size: int = 16
    kv_high_watermark: float = 0.95  # stop admitting when this fraction of KV is referenced
    kv_low_watermark: float = 0.85  # resume admitting below this fraction
    admission: str = "optimistic"  # or "reserve": admit only if prompt + max_tokens fits
    # times a request may lose its KV to memory pressure; the next time it ends with
    # preempted_abort instead of thrashing (None: no cap). Preemptions for a higher
    # priority (`priority` policy) do not count.
    max_preemptions: int | None = None
    # count recomputed prompt tokens in the fair policy's service, so a tenant whose requests
    # are preempted pays for the recompute (off: only fresh tokens count)
    charge_recompute: bool = False
    enable_prefix_caching: bool = True
    max_queued: int = 4096  # waiting requests over all tenants; past it -> overloaded
    tenants: dict[str, TenantConfig] = field(default_factory=dict)
    seed: int | None = None  # for the seeds drawn for unseeded requests (simulations)
    # May a request name a tenant that is neither "default" nor in `tenants`? Open here, for
    # the engine and simulations; the daemon closes it unless `[limits] open_tenants` is set,
    # so a client cannot invent tenants (a heavier weight, fresh limits, unbounded tables).
    open_tenants: bool = True
    # waiting requests of a tenant whose own `max_queued` is unset; None: no cap
    default_tenant_max_queued: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"policy: must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.order not in ORDERS:
            raise ConfigError(f"order: must be one of {', '.join(ORDERS)}, got {self.order!r}")
        if self.admission not in ADMISSIONS:
            raise ConfigError(
                f"admission: must be one of {', '.join(ADMISSIONS)}, got {self.admission!r}"
            )
        for name in ("token_budget", "prefill_weight", "decode_weight"):
            value = getattr(self, name)
            if not _is_number(value) or value <= 0:
                raise ConfigError(f"{name}: must be > 0, got {value!r}")
        for name in (
            "max_prefill_chunk",
            "max_prefilling",
            "max_running",
            "kv_blocks",
            "block_size",
            "max_queued",
        ):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ConfigError(f"{name}: must be an integer >= 1, got {value!r}")
        for name in ("decode_share", "kv_high_watermark", "kv_low_watermark"):
            value = getattr(self, name)
            if not _is_number(value) or not 0.0 <= value <= 1.0:
                raise ConfigError(f"{name}: must be in [0, 1], got {value!r}")
        if self.kv_low_watermark > self.kv_high_watermark:
            raise ConfigError(
                f"kv_low_watermark: must not exceed kv_high_watermark "
                f"({self.kv_low_watermark} > {self.kv_high_watermark})"
            )
        if self.max_wait is not None and (not _is_number(self.max_wait) or self.max_wait <= 0):
            raise ConfigError(f"max_wait: must be > 0 seconds, got {self.max_wait!r}")
        for name in ("fair_prompt_cost", "fair_output_cost"):
            value = getattr(self, name)
            if not _is_number(value) or value < 0:
                raise ConfigError(f"{name}: must be >= 0, got {value!r}")
        if self.decode_weight > self.token_budget:
            raise ConfigError("decode_weight: one decode token must fit in token_budget")
        for name, tenant in self.tenants.items():
            if not isinstance(tenant, TenantConfig):
                raise ConfigError(f"tenants.{name}: must be a TenantConfig")
        cap = self.max_preemptions
        if cap is not None and (not _is_int(cap) or cap < 0):
            raise ConfigError(f"max_preemptions: must be an integer >= 0, got {cap!r}")
        if not isinstance(self.charge_recompute, bool):
            raise ConfigError(f"charge_recompute: must be true or false, got "
                              f"{self.charge_recompute!r}")
        cap = self.default_tenant_max_queued
        if cap is not None and (not _is_int(cap) or cap < 0):
            raise ConfigError(f"default_tenant_max_queued: must be an integer >= 0, got {cap!r}")

    def tenant(self, name: str) -> TenantConfig:
        return self.tenants.get(name) or _DEFAULT_LIMITS

    def is_configured(self, name: str) -> bool:
        """A tenant the config or an operator created (not one a client merely named)."""
        return name == DEFAULT_TENANT or name in self.tenants

    def tenant_exists(self, name: str) -> bool:
        """Whether a request may name this tenant: "default", a configured one, or any if open."""
        return self.open_tenants or self.is_configured(name)

    def max_queued_of(self, name: str) -> int | None:
        """The queue cap of a tenant: its own `max_queued`, else the default cap."""
        own = self.tenant(name).max_queued
        return own if own is not None else self.default_tenant_max_queued

    @property
    def aging_seconds(self) -> float:
        return math.inf if self.max_wait is None else float(self.max_wait)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SchedulerConfig:
        """Build from a TOML table; unknown keys are an error that names them.

        `tenants` may be a table of tables (`[scheduler.tenants.a]`) or a list of tables each
        with a `name` (`[[tenants]]` in a scenario).
        """
        _reject_unknown(cls, data, "scheduler")
        values = dict(data)
        if "tenants" in values:
            values["tenants"] = _parse_tenants(values["tenants"])
        if values.get("max_wait") in ("none", "off"):  # TOML has no null
            values["max_wait"] = None
        try:
            return cls(**values)
        except TypeError as exc:  # e.g. a table where a number belongs
            raise ConfigError(str(exc)) from None


def _parse_tenants(raw: Any) -> dict[str, TenantConfig]:
    if isinstance(raw, dict):
        items = list(raw.items())
    elif isinstance(raw, list):
        items = []
        for entry in raw:
            if not isinstance(entry, dict) or "name" not in entry:
                raise ConfigError("tenants: each entry needs a name")
            entry = dict(entry)
            items.append((str(entry.pop("name")), entry))
    else:
        raise ConfigError("tenants: must be a table or a list of tables")
    tenants = {}
    for name, entry in items:
        if isinstance(entry, TenantConfig):
            tenants[name] = entry
            continue
        try:
            tenants[name] = TenantConfig.from_dict(dict(entry))
        except ConfigError as exc:
            raise ConfigError(f"tenants.{name}.{exc}") from None
    return tenants


def _reject_unknown(cls: type, data: dict[str, Any], table: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{table}: unknown key(s) {', '.join(unknown)}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_DEFAULT_LIMITS = TenantConfig()
