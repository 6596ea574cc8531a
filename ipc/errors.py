"""The exceptions the client library raises: one class per `Rejected` code, and the rest.

Applications catch `RejectedError` for any refusal, or one subclass for one reason
(`OverloadedError` to back off and retry, `TooLongError` to shorten the prompt).
"""

from __future__ import annotations

from sluice.ipc.messages import Rejected
from sluice.ipc.vocabulary import RejectCode


class SluiceError(Exception):
    """Base of every error the client library raises."""


class DaemonGone(SluiceError):
    """The daemon stopped answering (no frame within the client's timeout)."""


class RejectedError(SluiceError):
    code: RejectCode = RejectCode.INVALID

    def __init__(self, message: str, *, field: str = "", request_id: str = "",
                 retry_after: float = 0.0):
        super().__init__(f"{self.code.name.lower()}: {message}" + (f" [{field}]" if field else ""))
        self.message = message
        self.field = field
        self.request_id = request_id
        self.retry_after = retry_after  # seconds the daemon says to wait (0.0: no estimate)


class InvalidRequestError(RejectedError):
    code = RejectCode.INVALID


class TooLongError(RejectedError):
    code = RejectCode.TOO_LONG


class OverloadedError(RejectedError):
    code = RejectCode.OVERLOADED


class DrainingError(RejectedError):
    code = RejectCode.DRAINING


class QuotaError(RejectedError):
    code = RejectCode.QUOTA


class UnauthorizedError(RejectedError):
    code = RejectCode.UNAUTHORIZED


class ProtocolVersionError(RejectedError):
    code = RejectCode.PROTOCOL_VERSION


REJECTED_ERRORS: dict[RejectCode, type[RejectedError]] = {
    cls.code: cls
    for cls in (InvalidRequestError, TooLongError, OverloadedError, DrainingError, QuotaError,
                UnauthorizedError, ProtocolVersionError)
}


def error_for(rejected: Rejected) -> RejectedError:
    cls = REJECTED_ERRORS.get(rejected.code, RejectedError)
    return cls(rejected.message, field=rejected.field, request_id=rejected.request_id,
               retry_after=rejected.retry_after)
