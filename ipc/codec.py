"""The one msgpack codec for every wire message.

A frame is `[major, minor, tag, {field: value}]` or a batch of those. Decoding checks the size,
the msgpack, the major version, the tag and every field's type, naming the offending field, and
never raises anything but `CodecError`; fields of a newer minor version are ignored. Checks that
need the daemon's limits or model are made where a request enters the daemon
(`sluice.actors.front.intake`). See docs/wire-protocol.md, "Frames".
"""

from __future__ import annotations

import dataclasses
import enum
import re
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any

import msgpack

from sluice.ipc import messages as m
from sluice.ipc.vocabulary import InvalidParams

DEFAULT_MAX_FRAME_BYTES = 4 * 1024 * 1024


class CodecError(Exception):
    """A frame that cannot be accepted; `code` is the `RejectCode` the sender should get."""

    def __init__(
        self,
        message: str,
        *,
        field: str = "",
        code: m.RejectCode = m.RejectCode.INVALID,
        request_id: str = "",
    ):
        super().__init__(f"{field}: {message}" if field else message)
        self.message = message
        self.field = field
        self.code = code
        self.request_id = request_id  # when the frame named one, so the reply can too


class _FieldError(Exception):
    def __init__(self, path: str, message: str):
        self.path = path
        self.message = message


_Check = Callable[[Any, str], Any]  # (raw value, dotted path) -> decoded value


def _type_name(value: object) -> str:
    return type(value).__name__


def _check_int(value: Any, path: str) -> int:
    if type(value) is not int:
        raise _FieldError(path, f"expected an integer, got {_type_name(value)}")
    return value


def _check_float(value: Any, path: str) -> float:
    if type(value) is float:
        return value
    if type(value) is int:
        return float(value)
    raise _FieldError(path, f"expected a number, got {_type_name(value)}")


def _check_str(value: Any, path: str) -> str:
    if type(value) is not str:
        raise _FieldError(path, f"expected a string, got {_type_name(value)}")
    return value


def _check_bool(value: Any, path: str) -> bool:
    if type(value) is not bool:
        raise _FieldError(path, f"expected true or false, got {_type_name(value)}")
    return value


def _check_bytes(value: Any, path: str) -> bytes:
    if type(value) is not bytes:
        raise _FieldError(path, f"expected bytes, got {_type_name(value)}")
    return value


def _enum_check(enum_type: type[enum.IntEnum]) -> _Check:
    def check(value: Any, path: str) -> enum.IntEnum:
        if type(value) is not int:
            raise _FieldError(path, f"expected an integer code, got {_type_name(value)}")
        try:
            return enum_type(value)
        except ValueError:
            raise _FieldError(path, f"unknown {enum_type.__name__} {value}") from None

    return check


def _optional(inner: _Check) -> _Check:
    def check(value: Any, path: str) -> Any:
        return None if value is None else inner(value, path)

    return check


_JUST_INT = frozenset((int,))


def _tuple_of(inner: _Check) -> _Check:
    def check(value: Any, path: str) -> tuple:
        if type(value) is not list:
            raise _FieldError(path, f"expected a list, got {_type_name(value)}")
        if inner is _check_int:  # token ids: the one long list on the hot path
            if set(map(type, value)) <= _JUST_INT:  # the types gathered in C: half the time
                return tuple(value)
        else:
            try:
                return tuple([inner(item, path) for item in value])
            except _FieldError:
                pass
        # an item failed: check again with each item's path, so the error names it
        return tuple([inner(item, f"{path}[{i}]") for i, item in enumerate(value)])

    return check


def _map_of(inner: _Check) -> _Check:
    def check(value: Any, path: str) -> dict:
        if type(value) is not dict:
            raise _FieldError(path, f"expected a map, got {_type_name(value)}")
        checked = {}
        for key, item in value.items():
            entry = f"{path}[{key!r}]"
            checked[_check_str(key, entry)] = inner(item, entry)
        return checked

    return check


class _Schema:
    """How to encode and decode one dataclass: its fields, defaults and checks."""

    def __init__(self, cls: type):
        self.cls = cls
        hints = typing.get_type_hints(cls)
        self.fields = [f for f in dataclasses.fields(cls)]
        self.names = tuple(f.name for f in self.fields)
        self.required = frozenset(
            f.name
            for f in self.fields
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        self.checks: dict[str, _Check] = {f.name: _compile(hints[f.name]) for f in self.fields}
        self.defaults = {f.name: f.default for f in self.fields
                         if f.default is not dataclasses.MISSING}
        self.factories = {f.name: f.default_factory for f in self.fields
                          if f.default_factory is not dataclasses.MISSING}
        # a class that checks its own values when built (`SamplingParams`) is built by its
        # `__init__`; the others are filled directly (`decode`)
        self.built_by_init = hasattr(cls, "__post_init__") or hasattr(cls, "__slots__")
        self.decode_plain = _plain_decoder(cls, self.fields, hints, self.built_by_init)
        self.nested = {
            f.name: _nested_encoder(hints[f.name])
            for f in self.fields
            if _nested_encoder(hints[f.name]) is not None
        }

    def encode(self, msg: Any) -> dict:
        body = getattr(msg, "__dict__", None)
        if body is not None and len(body) == len(self.names):  # the fields alone: copied
            body = body.copy()
        else:  # slots, or a cached value beside them (`SamplingParams.plain`) not to send
            body = {name: getattr(msg, name) for name in self.names}
        for name, encode in self.nested.items():
            value = body[name]
            if value is not None:
                body[name] = encode(value)
        return body

    def known_fields(self, body: dict) -> dict:
        """The body without the fields a newer minor version added, which this reader ignores."""
        checks = self.checks
        return {key: value for key, value in body.items() if key in checks}

    def decode(self, body: Any, path: str) -> Any:
        if self.decode_plain is not None and type(body) is dict:
            obj = self.decode_plain(body)
            if obj is not None:
                return obj
        if type(body) is not dict:
            raise _FieldError(path or "body", f"expected a map, got {_type_name(body)}")
        checks = self.checks
        prefix = f"{path}." if path else ""
        if not body.keys() <= checks.keys():
            for key in body:
                if key not in checks:
                    # an empty key is named by its quotes: a bare "" would name no field
                    label = key if isinstance(key, str) and key else repr(key)
                    raise _FieldError(f"{prefix}{label}",
                                      f"unknown field for {self.cls.__name__}")
        if not self.required <= body.keys():
            for name in self.names:
                if name in self.required and name not in body:
                    raise _FieldError(f"{prefix}{name}", "missing required field")
        if path:
            values = {name: checks[name](value, prefix + name) for name, value in body.items()}
        else:  # a message's own fields: each path is the field's name
            values = {name: checks[name](value, name) for name, value in body.items()}
        if self.built_by_init:
            try:
                return self.cls(**values)
            except InvalidParams as exc:  # the value's own range check
                raise _FieldError(f"{prefix}{exc.field}", exc.message) from None
        # every value is checked and the class checks nothing more: fill the fields as
        # `__init__` would, without its per-field `object.__setattr__` (frozen classes)
        obj = object.__new__(self.cls)
        fields = obj.__dict__
        if len(values) < len(self.names):
            fields.update(self.defaults)
            for name, factory in self.factories.items():
                fields[name] = factory()
        fields.update(values)
        return obj


_ABSENT = object()


def _plain_decoder(cls: type, fields: list, hints: dict,
                   built_by_init: bool) -> Callable[[dict], Any] | None:
    """For a message whose fields are all strings, integers, booleans, tuples of integers or
    optional values, a function that builds it from a body holding every field with a plain
    value of its type (an optional one only when null), and returns None for any other body,
    which then takes the checking path that names what is wrong. None for other messages.

    The function is written out for the class, one exact type test per field, as `dataclasses`
    writes `__init__`: a loop over a table of kinds cost twice as much per chunk."""
    if built_by_init:
        return None
    lines = ["def decode(body, _new=object.__new__, _cls=_cls, _absent=_absent):",
             f"    if len(body) != {len(fields)}:",
             "        return None"]
    for i, f in enumerate(fields):
        hint = hints[f.name]
        origin = typing.get_origin(hint)
        lines.append(f"    v{i} = body.get({f.name!r}, _absent)")
        if hint in (str, int, bool):
            lines += [f"    if type(v{i}) is not {hint.__name__}:", "        return None"]
        elif origin is tuple and typing.get_args(hint) == (int, Ellipsis):
            lines += [f"    if type(v{i}) is not list:", "        return None",
                      f"    for item in v{i}:", "        if type(item) is not int:",
                      "            return None", f"    v{i} = tuple(v{i})"]
        elif origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint):
            lines += [f"    if v{i} is not None:", "        return None"]
        else:
            return None
    lines += ["    obj = _new(_cls)", "    fields = obj.__dict__"]
    lines += [f"    fields[{f.name!r}] = v{i}" for i, f in enumerate(fields)]
    lines.append("    return obj")
    namespace = {"_cls": cls, "_absent": _ABSENT}
    exec("\n".join(lines), namespace)  # noqa: S102 -- source built above from field names
    return namespace["decode"]


_SCHEMAS: dict[type, _Schema] = {}
_CHUNK_TAG = m.Chunk.TAG


def _schema(cls: type) -> _Schema:
    schema = _SCHEMAS.get(cls)
    if schema is None:
        schema = _SCHEMAS[cls] = _Schema(cls)
    return schema


def _compile(hint: Any) -> _Check:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported union {hint}")
        return _optional(_compile(args[0]))
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"only tuple[X, ...] is supported, got {hint}")
        return _tuple_of(_compile(args[0]))
    if origin is dict:
        key, value = typing.get_args(hint)
        if key is not str:
            raise TypeError(f"only dict[str, X] is supported, got {hint}")
        return _map_of(_compile(value))
    if isinstance(hint, type) and issubclass(hint, enum.IntEnum):
        return _enum_check(hint)
    if dataclasses.is_dataclass(hint):
        return _schema(hint).decode  # built now, so a field it cannot check fails here
    simple: dict[Any, _Check] = {
        int: _check_int,
        float: _check_float,
        str: _check_str,
        bool: _check_bool,
        bytes: _check_bytes,
    }
    if hint in simple:
        return simple[hint]
    raise TypeError(f"unsupported field type {hint!r}")


def _nested_encoder(hint: Any) -> Callable[[Any], Any] | None:
    """An encoder for fields holding dataclasses (directly, optionally, in a tuple or as the
    values of a map)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        inner = _nested_encoder(args[0])
        return None if inner is None else (lambda v: None if v is None else inner(v))
    if origin is tuple:
        inner = _nested_encoder(typing.get_args(hint)[0])
        return None if inner is None else (lambda v: [inner(item) for item in v])
    if origin is dict:
        inner = _nested_encoder(typing.get_args(hint)[1])
        return None if inner is None else (lambda v: {k: inner(item) for k, item in v.items()})
    if dataclasses.is_dataclass(hint):
        return lambda v: _schema(hint).encode(v)
    return None


def _reject_ext(code: int, data: bytes) -> Any:
    raise _FieldError("", f"msgpack extension type {code} is not allowed")


class Codec:
    """Encodes any wire message; decodes only the messages its receiver accepts."""

    def __init__(
        self,
        accepts: Iterable[type] = m.WIRE_MESSAGES,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_items: int | None = None,
    ):
        self.max_frame_bytes = max_frame_bytes
        # items of any one array or map in a frame (None: as many as its bytes can hold). A
        # longer one is refused at its header, before a single item is built: decoding a
        # frame of millions of token ids would hold the event loop for a tenth of a second
        self.max_items = max_items
        self._item_limits = {} if max_items is None else {"max_array_len": max_items,
                                                          "max_map_len": max_items}
        self._by_tag: dict[int, type] = {cls.TAG: cls for cls in accepts}
        for cls in (*m.WIRE_MESSAGES, *self._by_tag.values()):
            _schema(cls)
        self._packer = msgpack.Packer(use_bin_type=True)

    def envelope(self, msg: Any) -> list:
        """The msgpack-ready form of one message (what `encode_batch` packs)."""
        cls = type(msg)
        return [m.PROTOCOL_MAJOR, m.PROTOCOL_MINOR, cls.TAG, _schema(cls).encode(msg)]

    def encode(self, msg: Any) -> bytes:
        return self._packer.pack(self.envelope(msg))

    def pack_envelopes(self, envelopes: list[list]) -> bytes:
        """One frame carrying several messages, in order."""
        if len(envelopes) == 1:
            return self._packer.pack(envelopes[0])
        return self._packer.pack(envelopes)

    def encode_batch(self, msgs: Iterable[Any]) -> bytes:
        envelopes = []
        add = envelopes.append
        for msg in msgs:
            if type(msg) is m.Chunk and msg.logprobs is None:
                # nearly every message a daemon sends: its envelope made here, the fields'
                # values as they are (a frozen dataclass's `__dict__` holds exactly those)
                add([m.PROTOCOL_MAJOR, m.PROTOCOL_MINOR, _CHUNK_TAG, msg.__dict__.copy()])
            else:
                add(self.envelope(msg))
        return self.pack_envelopes(envelopes)

    def decode(self, frame: bytes) -> Any:
        raw = self._unpack(frame)
        return self._decode_envelope(raw)

    def decode_batch(self, frame: bytes) -> list[Any]:
        """The messages of a frame that holds one message or a batch of them."""
        raw = self._unpack(frame)
        if type(raw) is list and raw and type(raw[0]) is list:
            return [self._decode_envelope(item) for item in raw]
        return [self._decode_envelope(raw)]

    def _unpack(self, frame: bytes) -> Any:
        if len(frame) > self.max_frame_bytes:
            raise CodecError(
                f"frame of {len(frame)} bytes exceeds the limit of {self.max_frame_bytes}",
                field="frame",
            )
        try:
            return msgpack.unpackb(
                frame, raw=False, use_list=True, strict_map_key=True, ext_hook=_reject_ext,
                **self._item_limits,
            )
        except _FieldError as exc:
            raise CodecError(exc.message, field="frame") from None
        except ValueError as exc:
            if self.max_items is not None and (over := _OVER_ITEMS.match(str(exc))):
                raise _too_many_items(frame, int(over[1]), self.max_items) from None
            raise CodecError(f"not a msgpack frame ({type(exc).__name__})", field="frame") from None
        except Exception as exc:  # msgpack raises many types for garbage input
            raise CodecError(f"not a msgpack frame ({type(exc).__name__})", field="frame") from None

    def _decode_envelope(self, raw: Any) -> Any:
        if type(raw) is not list or len(raw) != 4:
            raise CodecError("expected [major, minor, tag, body]", field="frame")
        major, minor, tag, body = raw
        if type(major) is not int or major != m.PROTOCOL_MAJOR:
            raise CodecError(
                f"protocol version {major!r} is not supported; this daemon speaks "
                f"{m.PROTOCOL_VERSION}",
                field="version",
                code=m.RejectCode.PROTOCOL_VERSION,
                request_id=_request_id(body),
            )
        cls = self._by_tag.get(tag) if type(tag) is int else None
        if cls is None:
            raise CodecError(f"unknown message tag {tag!r}", field="tag",
                             request_id=_request_id(body))
        if type(minor) is int and minor > m.PROTOCOL_MINOR and type(body) is dict:
            body = _SCHEMAS[cls].known_fields(body)
        try:
            return _SCHEMAS[cls].decode(body, "")  # built for every accepted class in __init__
        except _FieldError as exc:
            raise CodecError(exc.message, field=exc.path, request_id=_request_id(body)) from None
        except (TypeError, ValueError) as exc:  # a dataclass __post_init__ refused the value
            raise CodecError(str(exc), field=cls.__name__, request_id=_request_id(body)) from None


_OVER_ITEMS = re.compile(r"(\d+) exceeds max_(?:array|map)_len")


def _too_many_items(frame: bytes, count: int, limit: int) -> CodecError:
    """The refusal of a frame with an array or map past `limit`, naming the request and the
    top-level field that holds it where the message's fields before it say so."""
    request_id, field = "", "frame"
    unpacker = msgpack.Unpacker(raw=False, max_array_len=limit, max_map_len=limit,
                                ext_hook=_reject_ext)
    unpacker.feed(frame)
    try:
        if unpacker.read_array_header() == 4:  # [major, minor, tag, body]
            for _ in range(3):
                unpacker.skip()
            for _ in range(unpacker.read_map_header()):
                key = unpacker.unpack()
                try:
                    value = unpacker.unpack()
                except ValueError:
                    field = key if type(key) is str else field
                    break
                if key == "request_id" and type(value) is str:
                    request_id = value
    except Exception:  # noqa: BLE001 - garbage past the oversize header: name no more
        pass
    code = m.RejectCode.TOO_LONG if field in ("prompt_ids", "messages") else m.RejectCode.INVALID
    return CodecError(f"{count} items exceed limits.max_frame_items = {limit}", field=field,
                      code=code, request_id=request_id)


def _request_id(body: Any) -> str:
    """The request a refused frame named, so the reply can name it too ("" if none)."""
    if type(body) is dict and type(body.get("request_id")) is str:
        return body["request_id"]
    return ""


def to_plain(msg: Any) -> Any:
    """A message as plain dicts/lists/ints, the shape `--json` output uses."""
    if dataclasses.is_dataclass(msg) and not isinstance(msg, type):
        return {f.name: to_plain(getattr(msg, f.name)) for f in dataclasses.fields(msg)}
    if isinstance(msg, enum.IntEnum):
        return msg.name.lower()
    if isinstance(msg, (list, tuple)):
        return [to_plain(item) for item in msg]
    if isinstance(msg, dict):
        return {key: to_plain(value) for key, value in msg.items()}
    return msg
