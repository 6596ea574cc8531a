"""Typed rejections of `Scheduler.add_request`: one subclass per code the gateway sends back."""

from __future__ import annotations


class Rejected(Exception):
    """A request the scheduler will not take: `code` goes on the wire, `message` names the field."""

    code = "rejected"

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class InvalidRequest(Rejected):
    def __init__(self, message: str):
        super().__init__("invalid", message)


class TooLong(Rejected):
    def __init__(self, message: str):
        super().__init__("too_long", message)


class Quota(Rejected):
    def __init__(self, message: str):
        super().__init__("quota", message)


class Overloaded(Rejected):
    def __init__(self, message: str):
        super().__init__("overloaded", message)
