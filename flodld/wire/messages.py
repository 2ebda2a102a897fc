"""Message base class, kind registry and codec: pydantic models carried as compact JSON payloads.

How to add a message in your channel's module (kinds: join 0x01xx, store 0x02xx, data 0x03xx,
control 0x04xx):

    @register(0x0201)
    class StoreSet(Message):
        key: ShortText
        value_len: Count

`register` refuses a model with a string, list or dict field that has no length cap: every field a
peer controls is bounded before it can be allocated. The capped types below cover the common cases.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterable, Iterator
from typing import Annotated, Any, ClassVar, Final, TypeVar, Union

import annotated_types
import pydantic
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints
from pydantic.fields import FieldInfo

from flodld.wire.errors import WireError

# Caps shared by every message, see docs/protocol.md.
MAX_HOST_CHARS: Final = 253
MAX_LIST_ITEMS: Final = 4096
MAX_REASON_CHARS: Final = 1024
MAX_SHORT_TEXT_CHARS: Final = 256
MAX_NAME_CHARS: Final = 128
MAX_TAIL_CHARS: Final = 4096  # a rank's output tail in RankExited (flodld/wire/join.py)
MAX_TAIL_LINES: Final = 40
MAX_KIND: Final = 0xFFFF

KIND_RANGES: Final[dict[str, range]] = {
    "join": range(0x0100, 0x0200),
    "store": range(0x0200, 0x0300),
    "data": range(0x0300, 0x0400),
    "control": range(0x0400, 0x0500),
}


def _printable_without_spaces(value: str) -> str:
    # A printable string's only possible whitespace is U+0020 (every other whitespace character is a
    # separator or a control, which isprintable() refuses): one test instead of a loop per character.
    if not value.isprintable() or " " in value:
        raise ValueError("must be printable and contain no whitespace")
    return value


def _printable(value: str) -> str:
    if not value.isprintable():
        raise ValueError("must contain only printable characters (no control characters or newlines)")
    return value


HostName = Annotated[
    str,
    StringConstraints(min_length=1, max_length=MAX_HOST_CHARS),
    AfterValidator(_printable_without_spaces),
]
"""A host name or address literal: 1..253 printable characters, no whitespace."""

Name = Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS), AfterValidator(_printable_without_spaces)]
"""An identifier-like string (run id, variant label, backend name): up to 128 characters, may be empty."""

ShortText = Annotated[str, StringConstraints(max_length=MAX_SHORT_TEXT_CHARS), AfterValidator(_printable)]
"""A free-form label of up to 256 printable characters."""

Reason = Annotated[str, StringConstraints(max_length=MAX_REASON_CHARS)]
"""A human explanation of up to 1024 characters."""

ReasonCode = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[a-z][a-z0-9_]*$")]
"""A stable snake_case reason code."""

HexDigest = Annotated[
    str,
    StringConstraints(min_length=64, max_length=64, pattern=r"^[0-9a-fA-F]{64}$"),
    AfterValidator(str.lower),
]
"""A SHA-256 digest as 64 hex characters, normalised to lowercase."""

Rank = Annotated[int, Field(ge=0, lt=2**31)]
Count = Annotated[int, Field(ge=0, lt=2**63)]
Port = Annotated[int, Field(ge=1, le=65535)]

T = TypeVar("T")
BoundedList = Annotated[list[T], Field(max_length=MAX_LIST_ITEMS)]
"""A list of at most 4096 items."""


class WireModel(BaseModel):
    """Base of everything that crosses the wire: closed, immutable, strictly typed, finite floats."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class Message(WireModel):
    """A top-level message: one frame's payload. `KIND` is set by `register`."""

    KIND: ClassVar[int]


_REGISTRY: dict[int, type[Message]] = {}

M = TypeVar("M", bound=type[Message])


def register(kind: int) -> typing.Callable[[M], M]:
    """Class decorator binding a message class to its frame kind (unique, 1..0xFFFF)."""
    if not 0 < kind <= MAX_KIND:
        raise ValueError(f"message kind must be in 0x0001..0xFFFF, got {kind:#x}")

    def bind(cls: M) -> M:
        existing = _REGISTRY.get(kind)
        if existing is not None and existing is not cls:
            raise ValueError(
                f"message kind {kind:#06x} is already registered to {existing.__qualname__}; "
                f"pick a free kind for {cls.__qualname__} in your channel's range"
            )
        problems = list(uncapped_fields(cls))
        if problems:
            raise TypeError(
                f"{cls.__qualname__} has fields without a length cap: {', '.join(problems)}; "
                "annotate them with max_length (or use HostName, ShortText, Reason, BoundedList, ...)"
            )
        cls.KIND = kind
        _REGISTRY[kind] = cls
        return cls

    return bind


def message_class(kind: int) -> type[Message]:
    """The class registered for `kind`; WireError(unknown_kind) if none."""
    try:
        return _REGISTRY[kind]
    except KeyError:
        raise WireError("unknown_kind", f"no message is registered for kind {kind:#06x}") from None


def registered_kinds() -> dict[int, type[Message]]:
    return dict(_REGISTRY)


def encode_message(msg: Message) -> tuple[int, bytes]:
    """(kind, compact UTF-8 JSON) for a registered message."""
    cls = type(msg)
    kind = getattr(cls, "KIND", None)
    if kind is None or _REGISTRY.get(kind) is not cls:
        raise ValueError(f"{cls.__qualname__} is not registered; decorate it with @register(kind)")
    # What model_dump_json() makes, as the serializer's bytes (no str round trip).
    return kind, cls.__pydantic_serializer__.to_json(msg)


def decode_message(kind: int, payload: bytes) -> Message:
    """Validate `payload` as the message registered for `kind`."""
    cls = _REGISTRY.get(kind) or message_class(kind)
    try:
        # model_validate_json without its keyword plumbing: the class's validator, straight from bytes.
        message: Message = cls.__pydantic_validator__.validate_json(payload)
        return message
    except pydantic.ValidationError as error:
        raise WireError("bad_payload", f"invalid {cls.__qualname__} payload: {_summarise(error)}") from None


def _summarise(error: pydantic.ValidationError) -> str:
    parts = []
    for item in error.errors(include_url=False, include_input=False)[:5]:
        location = ".".join(str(step) for step in item["loc"]) or "<message>"
        parts.append(f"{location}: {item['msg']}")
    more = error.error_count() - len(parts)
    if more > 0:
        parts.append(f"and {more} more")
    return "; ".join(parts)[:MAX_REASON_CHARS]


# --- cap checking -------------------------------------------------------------------------------

_SIZED_ORIGINS: Final = (str, bytes, list, dict, tuple, set, frozenset)


def uncapped_fields(model: type[BaseModel]) -> Iterator[str]:
    """Paths of str/bytes/list/dict fields (nested models and items included) with no max_length."""
    for name, info in model.model_fields.items():
        yield from _uncapped(info.annotation, list(info.metadata), f"{model.__name__}.{name}", set())


def _uncapped(annotation: object, metadata: list[Any], path: str, seen: set[type]) -> Iterator[str]:
    while typing.get_origin(annotation) is Annotated:
        annotation, *extra = typing.get_args(annotation)
        metadata = metadata + extra
    origin = typing.get_origin(annotation)
    if origin is Union or isinstance(annotation, types.UnionType):
        for arm in typing.get_args(annotation):
            yield from _uncapped(arm, metadata, path, seen)
        return
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if annotation not in seen:
            seen.add(annotation)
            for name, info in annotation.model_fields.items():
                yield from _uncapped(info.annotation, list(info.metadata), f"{path}.{name}", seen)
        return
    container = origin if origin is not None else annotation
    if isinstance(container, type) and issubclass(container, _SIZED_ORIGINS):
        if not _has_max_length(metadata):
            yield path
        for index, argument in enumerate(typing.get_args(annotation)):
            if argument is not Ellipsis:
                yield from _uncapped(argument, [], f"{path}[{index}]", seen)


def _has_max_length(metadata: Iterable[Any]) -> bool:
    for item in metadata:
        if isinstance(item, annotated_types.MaxLen | annotated_types.Len):
            if item.max_length is not None:
                return True
        elif isinstance(item, FieldInfo):
            if _has_max_length(item.metadata):
                return True
        elif isinstance(item, annotated_types.GroupedMetadata) and _has_max_length(item):
            return True
    return False
