"""The tenant limits are declared once (`TenantLimits`): the core's tenant config, the
operator's command, the status rows and the CLI's flags all take exactly its fields, and each
limit's values are judged by its declared kind, wherever it is set."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from sluice.actors.scheduler.config import ConfigError, TenantConfig
from sluice.daemon.commands import tenants
from sluice.ipc import messages as m
from sluice.ipc.vocabulary import TenantLimits

NAMES = set(TenantLimits.names())


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_every_record_of_a_tenant_carries_every_limit() -> None:
    assert {"max_running", "input_tokens_per_minute", "timeout"} <= NAMES
    assert NAMES <= _fields(TenantConfig)
    assert NAMES <= _fields(m.TenantSet)
    assert _fields(m.TenantRow.__dataclass_fields__["limits"].default.__class__) == NAMES
    parser = argparse.ArgumentParser()
    tenants.add_arguments(parser)
    flags = {action.dest for action in parser._actions}
    assert {"request_timeout" if name == "timeout" else name for name in NAMES} <= flags


@pytest.mark.parametrize(("name", "bad", "why"), [
    ("max_running", -1, "an integer >= 0"),
    ("input_tokens_per_minute", 0, "an integer >= 1"),
    ("max_queue_wait", float("nan"), "a number of seconds > 0"),
    ("max_priority", 1.5, "an integer"),
])
def test_a_bad_limit_is_refused_by_its_name_wherever_it_is_set(name, bad, why) -> None:
    with pytest.raises(ConfigError, match=f"^{name}: must be {why}"):
        TenantConfig(**{name: bad})
    assert m.TenantSet("t", **{name: bad}).problem().startswith(f"{name}: must be {why}")
