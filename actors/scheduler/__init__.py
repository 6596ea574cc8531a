"""The scheduler core: request table, block manager, policies and admission, free of I/O.

The daemon's Scheduler actor (`actor.py`) and the in-process engine both drive this core;
the simulator (`simulator.py`) drives it with a cost model instead of a model.
"""

from sluice.actors.scheduler.block_manager import BlockManager
from sluice.actors.scheduler.config import ConfigError, SchedulerConfig, TenantConfig
from sluice.actors.scheduler.core import Scheduler
from sluice.actors.scheduler.errors import InvalidRequest, Overloaded, Quota, Rejected, TooLong
from sluice.actors.scheduler.request import Request, RequestState

__all__ = [
    "BlockManager",
    "ConfigError",
    "InvalidRequest",
    "Overloaded",
    "Quota",
    "Rejected",
    "Request",
    "RequestState",
    "Scheduler",
    "SchedulerConfig",
    "TenantConfig",
    "TooLong",
]
