"""The codec for messages between the actors of one daemon (over `inproc://` sockets).

It trusts its peers and checks no ranges; it guarantees only that data crosses: msgpack types
plus registered dataclasses (tags are registration positions), and anything else (an inbox, a
socket) raises `TypeError` at the sender, so actors never share mutable state. The wire codec
(`codec.py`) guards the edge. See docs/architecture.md, "Messages, by boundary".
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import types
import typing
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import msgpack

_OBJECT = 1  # msgpack extension code of a registered dataclass
_MANY = 2  # ... of a sequence of them, all of one type

_Convert = Callable[[Any], Any]


def dataclasses_of(module: ModuleType) -> list[type]:
    """The dataclasses a module defines, in definition order."""
    return [
        value
        for value in vars(module).values()
        if isinstance(value, type)
        and dataclasses.is_dataclass(value)
        and value.__module__ == module.__name__
    ]


def _converter(hint: Any) -> _Convert | None:
    """How to restore a field msgpack cannot bring back as it was (enums, lists)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        inner = _converter(args[0]) if len(args) == 1 else None
        return None if inner is None else (lambda v: None if v is None else inner(v))
    if origin is list or hint is list:
        return list
    if origin is tuple:  # tuple[X, ...]: each item restored as X is
        args = typing.get_args(hint)
        inner = _converter(args[0]) if args else None
        return None if inner is None else (lambda v: tuple(inner(item) for item in v))
    if origin in (set, frozenset):
        return origin
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint
    return None


def _values_of(names: tuple[str, ...]) -> Callable[[Any], tuple]:
    """A function that reads the named attributes of an object, as a tuple."""
    if len(names) > 1:
        return operator.attrgetter(*names)
    if names:
        name = names[0]
        return lambda obj: (getattr(obj, name),)
    return lambda obj: ()


_PLAIN = (int, float, str, bytes, bool, type(None))


def _plain(hint: Any) -> bool:
    """Whether a field of this type holds msgpack's own values only (no registered object
    that `_pack_field` could group)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType, tuple, list, set, frozenset):
        return all(_plain(arg) for arg in typing.get_args(hint) if arg is not Ellipsis)
    return hint in _PLAIN or (isinstance(hint, type) and issubclass(hint, enum.Enum))


class _Type:
    def __init__(self, cls: type, tag: int):
        self.cls = cls
        self.tag = tag
        # a type with a compact form (`to_plain`/`from_plain`) is sent as that form
        self.compact = hasattr(cls, "to_plain") and hasattr(cls, "from_plain")
        hints = typing.get_type_hints(cls)
        self.names = tuple(f.name for f in dataclasses.fields(cls))
        self.converters = tuple(
            (i, convert)
            for i, name in enumerate(self.names)
            if (convert := _converter(hints[name])) is not None
        )
        # the fields that may hold a sequence of registered objects, packed as one group
        self.grouped = tuple(i for i, name in enumerate(self.names) if not _plain(hints[name]))
        self.values: Callable[[Any], tuple] = _values_of(self.names)

    def build(self, packed: Any) -> Any:
        """The object from what `InternalCodec` packed for it."""
        if self.compact:
            return self.cls.from_plain(packed)
        if self.converters:
            packed = list(packed)
            for i, convert in self.converters:
                packed[i] = convert(packed[i])
        # Trusted data from a peer actor: fill the fields directly instead of re-running
        # `__init__` and its checks, which the sender's object already passed.
        obj = object.__new__(self.cls)
        obj.__dict__.update(zip(self.names, packed))
        return obj


class InternalCodec:
    def __init__(self, registered: Iterable[type]):
        self._by_class: dict[type, _Type] = {}
        self._by_tag: list[_Type] = []
        for cls in registered:
            if cls in self._by_class:
                raise ValueError(f"{cls.__name__} is registered twice")
            entry = _Type(cls, len(self._by_tag))
            self._by_class[cls] = entry
            self._by_tag.append(entry)
        # one packer per nesting depth: a packer is not re-entrant, and building one per
        # object would allocate its buffer every time
        self._packers: list[msgpack.Packer] = []
        self._depth = 0

    def encode(self, msg: Any) -> bytes:
        depth = self._depth
        if depth == len(self._packers):
            self._packers.append(msgpack.Packer(default=self._pack_object, use_bin_type=True))
        self._depth = depth + 1
        try:
            return self._packers[depth].pack(msg)
        finally:
            self._depth = depth

    def decode(self, frame: bytes) -> Any:
        return msgpack.unpackb(frame, ext_hook=self._unpack_object, use_list=False, raw=False,
                               strict_map_key=False)

    def encode_compact(self, cls: type, plain: list) -> bytes:
        """A message of `cls` (a type with `to_plain`/`from_plain`) encoded from that compact
        form, for a sender that built the form without building the object."""
        return self.encode(self._extension(_OBJECT, [self._by_class[cls].tag, plain]))

    def decode_compact(self, frame: bytes, cls: type) -> Any:
        """The compact form of an encoded `cls` message, not built into the object, for a
        reader that needs only a few of its fields."""
        outer = msgpack.unpackb(frame, ext_hook=lambda code, data: (code, data), raw=False)
        if type(outer) is not tuple or outer[0] != _OBJECT:
            raise TypeError(f"expected a {cls.__name__}, got {type(outer).__name__}")
        tag, packed = self.decode(outer[1])
        if tag != self._by_class[cls].tag:
            raise TypeError(f"expected a {cls.__name__}, got a {self._by_tag[tag].cls.__name__}")
        return packed

    def _pack_object(self, obj: Any) -> msgpack.ExtType | list:
        entry = self._by_class.get(type(obj))
        if entry is None and isinstance(obj, (set, frozenset)):
            return list(obj)  # a set field comes back as its set type (see `_converter`)
        if entry is None:
            raise TypeError(f"a {type(obj).__name__} cannot travel between actors: only "
                            f"registered message dataclasses and plain data can")
        return self._extension(_OBJECT, [entry.tag, self._pack_fields(entry, obj)])

    def _pack_fields(self, entry: _Type, obj: Any) -> Any:
        if entry.compact:
            return obj.to_plain()
        values = entry.values(obj)
        if not entry.grouped:
            return values
        values = list(values)
        for i in entry.grouped:
            values[i] = self._pack_field(values[i])
        return values

    def _pack_field(self, value: Any) -> Any:
        # A sequence of one registered type (a step's outputs, a run of chunks) is packed as
        # one extension holding the tag once, instead of one extension per item.
        if type(value) in (tuple, list) and len(value) > 1:
            entry = self._by_class.get(type(value[0]))
            if entry is not None and all(type(item) is entry.cls for item in value):
                items = [self._pack_fields(entry, item) for item in value]
                return self._extension(_MANY, [entry.tag, items])
        return value

    def _extension(self, code: int, body: list) -> msgpack.ExtType:
        # tuple.__new__ skips ExtType's own argument checks, a measurable cost per object
        return tuple.__new__(msgpack.ExtType, (code, self.encode(body)))

    def _unpack_object(self, code: int, data: bytes) -> Any:
        tag, packed = self.decode(data)
        entry = self._by_tag[tag]
        if code == _OBJECT:
            return entry.build(packed)
        if code == _MANY:
            return tuple(entry.build(item) for item in packed)
        raise ValueError(f"unknown msgpack extension {code} between actors")
