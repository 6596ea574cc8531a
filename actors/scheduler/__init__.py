"""The scheduler core, free of I/O: the scheduler (queues and state transitions), the KV cache
manager (blocks and the prefix cache), the tenant ledger (limits and accounting), the plan
builder (the state of one planning iteration), policies and the wait queue.

The daemon's Scheduler actor (`sluice.actors.scheduler.actor`) and the in-process engine both
drive this core; the simulator (`simulator.py`) drives it with a cost model instead of a model.
"""

from sluice.actors.scheduler.config import ConfigError, SchedulerConfig, TenantConfig
from sluice.actors.scheduler.kv_cache import KVCacheManager
from sluice.actors.scheduler.request import Request, RequestState
from sluice.actors.scheduler.scheduler import Scheduler
from sluice.actors.scheduler.tenant_ledger import TenantLedger

__all__ = [
    "ConfigError",
    "KVCacheManager",
    "Request",
    "RequestState",
    "Scheduler",
    "SchedulerConfig",
    "TenantConfig",
    "TenantLedger",
]
