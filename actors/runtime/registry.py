"""The one registry of types that travel inside a daemon: between its actors and to and from
its worker process.

`CODEC` packs the messages between actors (`actors.runtime.messages`), the client and control
messages they pass along (`ipc.messages`), the values those share (`ipc.vocabulary`), the
scheduler core's step plan and result (`actors.scheduler.plan`), the worker protocol
(`actors.executor.protocol`) and the records actors report their state in (`actors.runtime.reports`).
A type's tag is its position here, so every process of one sluice version agrees on the
table. It loads no trio, socket or model: the worker process uses it too.

What does not belong here: the wire codec clients speak (`ipc.codec`), which distrusts every
byte; this one trusts its peers and only guarantees that nothing but data crosses.
"""

from __future__ import annotations

from sluice.actors.runtime import messages
from sluice.actors.runtime import reports
from sluice.actors.executor import protocol
from sluice.actors.scheduler import plan
from sluice.ipc import messages as wire
from sluice.ipc import vocabulary
from sluice.ipc.internal import InternalCodec, dataclasses_of

CODEC = InternalCodec([
    *dataclasses_of(vocabulary), *dataclasses_of(wire), *dataclasses_of(messages),
    *dataclasses_of(plan), *dataclasses_of(protocol), *dataclasses_of(reports),
])
