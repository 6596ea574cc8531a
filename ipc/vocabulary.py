"""The values the client protocol and the scheduler core both speak.

A client's sampling parameters travel unchanged from the frame that carries them to the
worker that samples with them; a request ends with the `FinishReason`, or is refused with the
`RejectCode`, that the scheduler core chose, and the client receives that value, never a
spelling of it; the refusal's exception (`RejectedError`, one subclass per code) is the same
class in the core, the engine and the client library. The scheduler core
(`sluice.actors.scheduler`) imports this module and `messages` puts the same types on the
wire, so it imports nothing of sluice and nothing but the standard library: no sockets, no
trio, no msgpack.

What does not belong here: messages (see `messages`), encoding (see `codec`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass, field


class RejectCode(enum.IntEnum):
    """Why a request or frame was refused before any work was done for it."""

    INVALID = 1  # malformed frame or out-of-range parameter; `field` names it
    TOO_LONG = 2  # prompt plus max_tokens exceed the model's context
    OVERLOADED = 3  # queue full
    DRAINING = 4  # the daemon is shutting down or drained by an operator
    QUOTA = 5  # the tenant is over its limits
    UNAUTHORIZED = 6
    PROTOCOL_VERSION = 7  # the frame's major version differs from the daemon's


# -- refusals: one tree, raised by the scheduler core, the engine and the client library --

class SluiceError(Exception):
    """Base of every error sluice's client library and engine raise."""


class RejectedError(SluiceError):
    """A request sluice will not take: its `code`, the `field` it is about (dotted, as the
    client named it, e.g. "max_tokens"; nobody reads a field out of the text) and a human
    `message`."""

    code: RejectCode = RejectCode.INVALID

    def __init__(self, message: str, *, field: str = "", request_id: str = "",
                 retry_after: float = 0.0):
        named = field and not message.startswith(f"{field}: ")
        super().__init__(f"{self.code.name.lower()}: {message}" + (f" [{field}]" if named else ""))
        self.message = message
        self.field = field
        self.request_id = request_id
        self.retry_after = retry_after  # seconds the daemon says to wait (0.0: no estimate)

    @classmethod
    def about(cls, field: str, message: str, *, retry_after: float = 0.0) -> RejectedError:
        """The refusal of what `field` holds, its message led by the field's name."""
        return cls(f"{field}: {message}" if field else message, field=field,
                   retry_after=retry_after)


class InvalidRequestError(RejectedError):
    """A malformed request or an out-of-range parameter (`field` names it)."""

    code = RejectCode.INVALID


class TooLongError(RejectedError):
    """The prompt, or prompt plus max_tokens, exceeds the model's context or the KV pool."""

    code = RejectCode.TOO_LONG


class OverloadedError(RejectedError):
    """The daemon's queue or a connection's limit is full: back off and retry."""

    code = RejectCode.OVERLOADED


class DrainingError(RejectedError):
    """The daemon is shutting down, or an operator drained it."""

    code = RejectCode.DRAINING


class QuotaError(RejectedError):
    """The tenant is over one of its limits (`retry_after` when its token rate frees up)."""

    code = RejectCode.QUOTA


class UnauthorizedError(RejectedError):
    """The client may not act as the tenant it names, or on the connection it uses."""

    code = RejectCode.UNAUTHORIZED


class ProtocolVersionError(RejectedError):
    """The frame's major protocol version is not the daemon's."""

    code = RejectCode.PROTOCOL_VERSION


REJECTED_ERRORS: dict[RejectCode, type[RejectedError]] = {
    cls.code: cls
    for cls in (InvalidRequestError, TooLongError, OverloadedError, DrainingError, QuotaError,
                UnauthorizedError, ProtocolVersionError)
}


class FinishReason(enum.IntEnum):
    STOP = 1  # EOS, a stop token or a stop string
    LENGTH = 2  # max_tokens or the model's context reached
    CANCELLED = 3  # the client cancelled, or went away
    TIMEOUT = 4  # paused by backpressure longer than pause_timeout
    ERROR = 5  # an actor or the worker failed for this request
    PREEMPTED_ABORT = 6  # preempted and could not be resumed


class InvalidParams(ValueError):
    """A request parameter is out of range: `field` names it, `message` says why."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens, and when it stops.

    The same object is what a client sends in `Generate.sampling`, what the scheduler core
    plans with and what the worker samples with. It checks its ranges when it is built (the
    wire codec builds it as a frame is decoded, so a bad value costs a `Rejected` naming
    `sampling.<field>`); `from_plain` trusts values that were checked by the sender.
    """

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # on prompt and output tokens, as in transformers
    presence_penalty: float = 0.0  # on output tokens
    frequency_penalty: float = 0.0  # on output tokens
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, handled by the detokenizer, never sent
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per sampled token, None for none
    # OpenAI's logit_bias as two columns: token ids, and what is added to each one's logit
    # before penalties and temperature (a tuple of pairs would not be one wire type)
    logit_bias_ids: tuple[int, ...] = ()
    logit_bias_values: tuple[float, ...] = ()
    # a constraint on the output: "" none, else one of GRAMMAR_KINDS, spelled by `grammar`
    # (a JSON schema's text, a regular expression, a JSON list of choices, a Lark grammar)
    grammar_kind: str = ""
    grammar: str = ""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        # every integer fits the wire between the daemon's actors and its worker (msgpack
        # carries 64 bits) and the worker's int64 tensors; every float is finite
        _check_int("max_tokens", self.max_tokens, 1)
        if not _is_number(self.temperature) or self.temperature < 0:
            raise InvalidParams("temperature", f"must be >= 0, got {shown(self.temperature)}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidParams("top_p", f"must be in (0, 1], got {shown(self.top_p)}")
        _check_int("top_k", self.top_k, 0)
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidParams("min_p", f"must be in [0, 1], got {shown(self.min_p)}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidParams(
                "repetition_penalty", f"must be > 0, got {shown(self.repetition_penalty)}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise InvalidParams(name, f"must be in [-2, 2], got {shown(value)}")
        if self.seed is not None:
            _check_int("seed", self.seed, 0)
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20
        ):
            raise InvalidParams("logprobs", f"must be in [0, 20], got {shown(self.logprobs)}")
        for i, token in enumerate(self.stop_token_ids):
            _check_int(f"stop_token_ids[{i}]", token, 0)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidParams("stop", "stop strings must be non-empty strings")
        if len(self.logit_bias_ids) != len(self.logit_bias_values):
            raise InvalidParams("logit_bias", "needs as many values as token ids")
        for i, token in enumerate(self.logit_bias_ids):
            _check_int(f"logit_bias[{i}]", token, 0)
        for i, bias in enumerate(self.logit_bias_values):
            if not _is_number(bias) or not -100.0 <= bias <= 100.0:
                raise InvalidParams(f"logit_bias[{i}]", f"a bias must be in [-100, 100], "
                                    f"got {shown(bias)}")
        if self.grammar_kind not in ("", *GRAMMAR_KINDS):
            raise InvalidParams("grammar_kind", f"must be one of {', '.join(GRAMMAR_KINDS)}, "
                                f"got {shown(self.grammar_kind)}")
        if bool(self.grammar_kind) != bool(self.grammar):
            raise InvalidParams("grammar", "a grammar and its kind go together")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def constrained(self) -> bool:
        """The output follows a grammar: the sampler masks what it does not allow."""
        return bool(self.grammar_kind)

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @functools.cached_property
    def plain(self) -> tuple:
        """The field values in order: the compact form, and a cheap key for equal params."""
        return tuple(getattr(self, name) for name in _SAMPLING_FIELDS)

    def to_plain(self) -> tuple:
        return self.plain

    @classmethod
    def from_plain(cls, values: list | tuple) -> SamplingParams:
        # no `__init__`: the sender's params passed `validate()` already
        params = object.__new__(cls)
        fields = dict(zip(_SAMPLING_FIELDS, values))
        fields["stop_token_ids"] = tuple(fields["stop_token_ids"])
        fields["stop"] = tuple(fields["stop"])
        fields["logit_bias_ids"] = tuple(fields["logit_bias_ids"])
        fields["logit_bias_values"] = tuple(fields["logit_bias_values"])
        params.__dict__.update(fields)
        params.__dict__["plain"] = tuple(fields.values())  # its compact form, for the next hop
        return params

    @classmethod
    def from_dict(cls, data: dict) -> SamplingParams:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise InvalidParams(sorted(unknown)[0], "unknown sampling parameter")
        values = dict(data)
        for name in ("stop_token_ids", "stop", "logit_bias_ids", "logit_bias_values"):
            if name in values and values[name] is not None:
                values[name] = tuple(values[name])
        return cls(**values)


# json_schema: a schema's JSON text; regex: a regular expression the whole output matches;
# choice: a JSON list of strings, the output one of them; lark: a Lark grammar
GRAMMAR_KINDS = ("json_schema", "regex", "choice", "lark")

_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


INT64_MAX = 2**63 - 1  # the largest integer a request may carry anywhere


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request of n choices seeded `seed`: choice 0 keeps it
    (the answer with n = 1), the others each get a stream of their own."""
    if index == 0:
        return seed
    return (seed * 0x9E3779B97F4A7C15 + index * 0xD1B54A32D192ED03) % (1 << 63)


def grammar_of(json_schema: object = None, regex: str | None = None,
               choices: object = None, lark: str | None = None) -> tuple[str, str]:
    """(`grammar_kind`, `grammar`) from at most one of a JSON schema (an object or its
    text), a regular expression, a list of choices or a Lark grammar; ("", "") for none."""
    import json

    given = [(kind, value) for kind, value in (("json_schema", json_schema), ("regex", regex),
                                               ("choice", choices), ("lark", lark))
             if value is not None]
    if not given:
        return "", ""
    if len(given) > 1:
        raise InvalidParams(given[1][0], f"only one constraint per request: {given[0][0]} "
                            "is given")
    kind, value = given[0]
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise InvalidParams("grammar", "the JSON schema is not JSON") from None
        if not isinstance(value, (dict, bool)):
            raise InvalidParams("grammar", "a JSON schema is an object")
        return kind, json.dumps(value, sort_keys=True, separators=(",", ":"))
    if kind == "choice":
        if isinstance(value, str) or not all(isinstance(c, str) and c for c in value):
            raise InvalidParams("grammar", "choices are a list of non-empty strings")
        return kind, json.dumps(list(value), separators=(",", ":"))
    return kind, value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A finite number; an integer one within 64 bits."""
    if _is_int(value):
        return -INT64_MAX - 1 <= value <= INT64_MAX
    return isinstance(value, float) and value - value == 0.0  # NaN for NaN and infinities


def _check_int(field_name: str, value: object, low: int) -> None:
    if not _is_int(value) or not low <= value <= INT64_MAX:
        raise InvalidParams(field_name, f"must be an integer in [{low}, 2**63 - 1], "
                                        f"got {shown(value)}")


def shown(value: object) -> str:
    """A client's value as an error message quotes it: a huge integer by its size alone."""
    if _is_int(value) and not -10**20 < value < 10**20:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "…"


# what each tenant limit is, which says what values it takes
_COUNT = {"kind": "count"}  # an integer >= 0
_RATE = {"kind": "rate"}  # an integer >= 1
_SECONDS = {"kind": "seconds"}  # a number of seconds > 0
_LEVEL = {"kind": "level"}  # any integer


@dataclass(frozen=True, kw_only=True)
class TenantLimits:
    """What one tenant may use: the one declaration of the tenant limits. None is no limit.

    The scheduler core's tenant config, the operator's `TenantSet`, the status rows, the
    `[scheduler.tenants.NAME]` tables and `sluice tenants set`'s flags all take these fields
    from here."""

    max_running: int | None = field(default=None, metadata=_COUNT)  # requests holding KV
    # requests waiting for admission at once (in status: its own cap, else the default cap)
    max_queued: int | None = field(default=None, metadata=_COUNT)
    max_context: int | None = field(default=None, metadata=_COUNT)  # prompt + max_tokens
    max_new_tokens: int | None = field(default=None, metadata=_COUNT)  # max_tokens of one
    # token buckets, each holding one minute's worth: prompt tokens and max_tokens admitted
    # per minute; over the rate a request waits
    input_tokens_per_minute: int | None = field(default=None, metadata=_RATE)
    output_tokens_per_minute: int | None = field(default=None, metadata=_RATE)
    # seconds a request may expect to wait for the rates before it is refused (quota, with
    # retry_after) at arrival; None: it waits however long (its timeout still holds)
    max_queue_wait: float | None = field(default=None, metadata=_SECONDS)
    max_kv_blocks: int | None = field(default=None, metadata=_COUNT)  # KV its requests hold
    max_priority: int | None = field(default=None, metadata=_LEVEL)  # higher is lowered to it
    timeout: float | None = field(default=None, metadata=_SECONDS)  # for requests naming none

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(TenantLimits))

    @classmethod
    def takes_seconds(cls, name: str) -> bool:
        """Whether the limit `name` is a number of seconds (else an integer)."""
        return _LIMIT_KINDS[name] == "seconds"

    def limits(self) -> TenantLimits:
        """These limits alone, from a record that has more fields (a config, a command)."""
        return TenantLimits(**{name: getattr(self, name) for name in self.names()})

    def problem(self) -> str | None:
        """What is wrong with a value, as `name: must be ..., got ...`; None if nothing."""
        for name in self.names():
            value = getattr(self, name)
            if value is None:
                continue
            kind = _LIMIT_KINDS[name]
            if kind == "count" and not (_is_int(value) and value >= 0):
                return f"{name}: must be an integer >= 0, got {value!r}"
            if kind == "rate" and not (_is_int(value) and value >= 1):
                return f"{name}: must be an integer >= 1, got {value!r}"
            if kind == "seconds" and not (_is_real(value) and 0 < value < float("inf")):
                return f"{name}: must be a number of seconds > 0, got {value!r}"
            if kind == "level" and not _is_int(value):
                return f"{name}: must be an integer, got {value!r}"
        return None


_LIMIT_KINDS = {f.name: f.metadata["kind"] for f in dataclasses.fields(TenantLimits)}


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
