"""Typed refusals of `Scheduler.add_request`: one subclass per code the client gets back.

Each carries its `RejectCode`, the `field` it is about (dotted, as the client named it, e.g.
"max_tokens") and a human `message`; nobody reads a field out of the text.
"""

from __future__ import annotations

from sluice.ipc.vocabulary import RejectCode


class AdmissionError(Exception):
    """A request the scheduler will not take."""

    code: RejectCode = RejectCode.INVALID

    def __init__(self, field: str, message: str, *, retry_after: float = 0.0):
        self.field = field
        self.message = f"{field}: {message}" if field else message
        self.retry_after = retry_after  # seconds after which the same request may fit (0: -)
        super().__init__(f"{self.code.name.lower()}: {self.message}")


class InvalidRequest(AdmissionError):
    code = RejectCode.INVALID


class TooLong(AdmissionError):
    code = RejectCode.TOO_LONG


class Quota(AdmissionError):
    code = RejectCode.QUOTA


class Overloaded(AdmissionError):
    code = RejectCode.OVERLOADED
