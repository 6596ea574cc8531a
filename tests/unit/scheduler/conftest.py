"""Fixtures for the scheduler core tests."""

from __future__ import annotations

import pytest
from support.scheduler import FakeClock, make_scheduler


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_sched(clock):
    def make(**settings):
        return make_scheduler(clock, **settings)

    return make
