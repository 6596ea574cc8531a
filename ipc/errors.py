"""What the client library adds to sluice's refusals: `DaemonGone`, and `error_for`, which
turns a `Rejected` answer into its exception. The refusals themselves (`RejectedError`, one
subclass per code) are declared beside the codes in `sluice.ipc.vocabulary`, since the
scheduler core and the in-process `Engine` raise the same classes.

Applications catch `RejectedError` for any refusal, or one subclass for one reason
(`OverloadedError` to back off and retry, `TooLongError` to shorten the prompt).
"""

from __future__ import annotations

from sluice.ipc.messages import Rejected
from sluice.ipc.vocabulary import REJECTED_ERRORS, RejectedError, SluiceError


class DaemonGone(SluiceError):
    """The daemon stopped answering (no frame within the client's timeout)."""


def error_for(rejected: Rejected) -> RejectedError:
    cls = REJECTED_ERRORS.get(rejected.code, RejectedError)
    return cls(rejected.message, field=rejected.field, request_id=rejected.request_id,
               retry_after=rejected.retry_after)
