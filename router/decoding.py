"""Parse the public ``Router`` service's requests so that a malformed one is refused, not failed.

gRPC deserializes a request before any handler runs; with the generated deserializer
(``GenerateRequest.FromString``) a message protobuf cannot parse (a ``string`` field
holding invalid UTF-8, truncated or garbled bytes) fails the call with INTERNAL. The
Router service is registered with :func:`parse_or_refusal` instead: it turns protobuf's
``DecodeError`` into an :class:`Unparsable` value, which the handler refuses with
INVALID_ARGUMENT naming the offending field (:func:`bad_utf8_field`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message


@dataclass(frozen=True)
class Unparsable:
    """A request whose bytes did not parse; ``reason`` says why, naming the field if it can."""

    type_name: str
    reason: str

    def message(self) -> str:
        return f"the request is not a valid {self.type_name}: {self.reason}"


def parse_or_refusal(cls: type[Message]) -> Callable[[bytes], Message | Unparsable]:
    """A request deserializer for ``cls`` that returns :class:`Unparsable` instead of raising."""

    def parse(data: bytes) -> Message | Unparsable:
        try:
            return cls.FromString(data)
        except DecodeError as e:
            field = bad_utf8_field(cls.DESCRIPTOR, data)
            reason = f"{field} is not valid UTF-8" if field else str(e)
            return Unparsable(cls.DESCRIPTOR.full_name, reason)

    return parse


def bad_utf8_field(desc: Descriptor, data: bytes) -> str | None:
    """The path (``messages.messages[1].content``) of the first ``string`` field of a
    ``desc`` message in ``data`` whose bytes are not UTF-8; ``None`` when there is none
    (map entries are not searched) or ``data`` does not parse even with every ``string``
    read as ``bytes``."""
    twin, converted = _bytes_twin(desc)
    try:
        lenient = twin.FromString(data)
    except DecodeError:
        return None
    return _first_bad(lenient, "", converted)


def _first_bad(msg: Message, prefix: str, converted: frozenset[str]) -> str | None:
    for field, value in msg.ListFields():
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            continue
        items = enumerate(value) if field.is_repeated else [(None, value)]
        for i, item in items:
            path = prefix + field.name + ("" if i is None else f"[{i}]")
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                found = _first_bad(item, path + ".", converted)
                if found:
                    return found
            elif field.full_name in converted:
                try:
                    item.decode("utf-8")
                except UnicodeDecodeError:
                    return path
    return None


@cache
def _bytes_twin(desc: Descriptor) -> tuple[type[Message], frozenset[str]]:
    """A message class with ``desc``'s wire format in which every ``string`` field is
    ``bytes`` (built once per type in a pool of its own), and the full names of those fields."""
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()
    converted: set[str] = set()

    def add(file) -> None:
        if file.name in added:
            return
        for dep in file.dependencies:
            add(dep)
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        for m in proto.message_type:
            _strings_to_bytes(m, f"{proto.package}.{m.name}", converted)
        pool.Add(proto)
        added.add(file.name)

    add(desc.file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(desc.full_name)), frozenset(converted)


def _strings_to_bytes(m: descriptor_pb2.DescriptorProto, full_name: str, converted: set[str]) -> None:
    for f in m.field:
        if f.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
            f.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
            converted.add(f"{full_name}.{f.name}")
    for nested in m.nested_type:
        _strings_to_bytes(nested, f"{full_name}.{nested.name}", converted)
