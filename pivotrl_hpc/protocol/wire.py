"""A typed message format (JSON of named dataclasses, never pickle) for every channel of the
job: its own sockets (the host forker, the engine hosts) and MPI (`protocol.mpi`).

Why: `pickle.loads` runs whatever the bytes say, so a process that can write to a channel of
the job could run code in it (issue 35: `nobody` sent a pickle to the root host forker and
it ran `id` as root; every TCP listener of an MPI job accepts other accounts' connections).
A `Codec` decodes only JSON values and the dataclasses it was built with, by name, through
their constructors (`__post_init__` checks included): a message of any other shape is a
`WireError`, and nothing in it runs.

Encoding: a dataclass is a JSON object `{"__t": its class name, field: value, ...}` (fields
encoded the same way, recursively), a path is `{"__t": "Path", "p": str}`, bytes are
`{"__t": "bytes", "b": base64}`, a numpy scalar travels as the Python number it holds. JSON
has no tuples and no enums: a field declared a tuple (nested ones too: `tuple[tuple[int,
...], ...]`) or an Enum comes back as one, from the field's type hint. Dict keys must be
strings.

Decoding checks every field against its type hint before the constructor runs (`_checker`):
an int is an int (not a bool, a float or a string of digits), a float a finite number, a str
a str, lists, tuples and dicts hold what they declare, `X | None` is X or None, a nested
message is the declared dataclass, an enum one of its values; `Any` takes any JSON value. A
wrong one is a WireError naming the message and the field. `decode(data, expect=T)` also
refuses a message that is not a T (a bare dict where a command was due). What a well-typed
value means (a path, a count) is the receiver's to check.

Token ids and logprobs are most of the bytes (a Step's reply, an AddSequences): a field
declared `list[int]`, `list[float]`, `tuple[int, ...]` or `tuple[float, ...]` of 16 values
or more travels packed, `{"__t": "i32" | "f64", "b": base64 of the native 4-byte ints or
8-byte floats}` (a job's ranks share one architecture; ints beyond 32 bits stay JSON):
floats bit-exact and ~10x cheaper than JSON's digits to write and read, ints smaller.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
from array import array
import enum
import json
import math
import re
import types
import typing
from pathlib import Path, PurePath
from typing import Any, Callable

TAG = "__t"
_PACKED = {int: "i32", float: "f64"}
_ARRAY_CODE = {"i32": "i", "f64": "d"}
_PACK_MIN = 16   # shorter lists (a Step's token or two a sequence) are cheaper as JSON

Coerce = Callable[[Any], Any]


class WireError(ValueError):
    """Bytes that are not a message of the expected types."""


class Codec:
    """Encoder and decoder of messages built from JSON values and the given dataclasses."""

    def __init__(self, *types_: type):
        for cls in types_:
            if not dataclasses.is_dataclass(cls):
                raise TypeError(f"{cls.__name__} is not a dataclass")
        self._types = {cls.__name__: cls for cls in types_}
        if len(self._types) != len(types_):
            raise TypeError("two wire types share a name")
        # per type, the fields JSON cannot bring back as declared (tuples, enums)
        self._coerce = {cls.__name__: _field_coercers(cls) for cls in types_}
        self._packed = {cls.__name__: _packed_fields(cls) for cls in types_}
        self._checks = {cls.__name__: _field_checks(cls) for cls in types_}

    @property
    def types(self) -> tuple[type, ...]:
        return tuple(self._types.values())

    def encode(self, message: Any) -> bytes:
        try:
            return json.dumps(message, default=self._default, separators=(",", ":"),
                              check_circular=False).encode()
        except (TypeError, ValueError, RecursionError) as e:
            raise WireError(f"cannot encode {type(message).__name__}: {e}") from None

    def decode(self, data: bytes | bytearray | memoryview, expect: Any = None) -> Any:
        """The message in `data`; with `expect` (a type or a union of types) it must be one."""
        try:
            if isinstance(data, memoryview):
                data = data.tobytes()
            message = json.loads(data, object_hook=self._object)
        except WireError:
            raise
        except (ValueError, TypeError, RecursionError, UnicodeDecodeError) as e:
            raise WireError(f"not a message of this channel ({len(data)} bytes): "
                            f"{type(e).__name__}: {str(e)[:200]}") from None
        if expect is not None and not isinstance(message, expect):
            raise WireError(f"a {type(message).__name__} where {_name(expect)} was expected")
        return message

    def _default(self, obj: Any) -> Any:
        cls = type(obj)
        if self._types.get(cls.__name__) is cls:
            out = {TAG: cls.__name__, **vars(obj)}   # the fields (no slots, no extras)
            for key, tag in self._packed[cls.__name__].items():
                out[key] = _pack(out[key], tag)
            return out
        if isinstance(obj, PurePath):
            return {TAG: "Path", "p": str(obj)}
        if isinstance(obj, (bytes, bytearray)):
            return {TAG: "bytes", "b": base64.b64encode(obj).decode()}
        if cls.__module__ == "numpy" and hasattr(obj, "item") and getattr(obj, "ndim", 1) == 0:
            return obj.item()   # np.float32(0.5) -> 0.5: a scalar, not an array
        raise TypeError(f"{cls.__name__} is not a type of this channel")

    def _object(self, obj: dict) -> Any:
        name = obj.pop(TAG, None)
        if name is None:
            return obj
        if name == "Path" and isinstance(obj.get("p"), str) and len(obj) == 1:
            return Path(obj["p"])
        if name in ("bytes", "i32", "f64") and isinstance(obj.get("b"), str) and len(obj) == 1:
            try:
                raw = binascii.a2b_base64(obj["b"], strict_mode=True)
                return raw if name == "bytes" else array(_ARRAY_CODE[name], raw).tolist()
            except (ValueError, binascii.Error) as e:
                raise WireError(f"bad {name}: {e}") from None
        cls = self._types.get(name) if isinstance(name, str) else None
        if cls is None:
            raise WireError(f"{name!r} is not a type of this channel")
        try:
            for key, coerce in self._coerce[name].items():
                if key in obj:
                    obj[key] = coerce(obj[key])
        except (TypeError, ValueError) as e:
            raise WireError(f"bad {name}: {e}") from None
        exact, checks = self._checks[name]
        for key, value in obj.items():   # an unknown key: the constructor's TypeError
            allowed = exact.get(key)
            if allowed is not None and type(value) in allowed:
                continue
            if (check := checks.get(key)) is not None and (why := check(value)) is not None:
                raise WireError(f"bad {name}: field {key!r} {why}")
        try:
            return cls(**obj)
        except (TypeError, ValueError) as e:
            raise WireError(f"bad {name}: {e}") from None


def _packed_fields(cls: type) -> dict[str, str]:
    """Fields declared a flat list or tuple of ints or of floats: name -> packed tag."""
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError):
        return {}
    out = {}
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name)
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin is list and len(args) == 1 and args[0] in _PACKED:
            out[f.name] = _PACKED[args[0]]
        elif origin is tuple and len(args) == 2 and args[1] is Ellipsis and args[0] in _PACKED:
            out[f.name] = _PACKED[args[0]]
    return out


def _pack(value: Any, tag: str) -> Any:
    """Values of a packed field as one base64 string; anything else (an int too big for 8
    bytes, a float in an int list) as it is, in plain JSON."""
    if type(value) not in (list, tuple) or len(value) < _PACK_MIN:
        return value
    try:
        return {TAG: tag, "b": base64.b64encode(array(_ARRAY_CODE[tag], value)).decode()}
    except (TypeError, OverflowError):
        return value


def _field_coercers(cls: type) -> dict[str, Coerce]:
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError):   # a hint this module cannot resolve: tuples by name only
        return {f.name: _tuple(None) for f in dataclasses.fields(cls)
                if str(f.type).startswith(("tuple", "Tuple"))}
    out = {}
    for f in dataclasses.fields(cls):
        coerce = _coercer(hints.get(f.name, Any))
        if coerce is not None:
            out[f.name] = coerce
    return out


def _coercer(hint: Any) -> Coerce | None:
    """What turns a decoded JSON value back into `hint`'s shape; None: nothing to do."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return lambda v: hint(v) if not isinstance(v, hint) else v
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return _tuple(_coercer(args[0]))
        return _fixed_tuple([_coercer(a) for a in args])
    if origin is list and args:
        inner = _coercer(args[0])
        return None if inner is None else (
            lambda v: [inner(x) for x in v] if isinstance(v, list) else v)
    if origin is dict and len(args) == 2:
        inner = _coercer(args[1])
        return None if inner is None else (
            lambda v: {k: inner(x) for k, x in v.items()} if isinstance(v, dict) else v)
    if origin in (typing.Union, types.UnionType):
        found = [c for a in args if a is not type(None) and (c := _coercer(a)) is not None]
        if len(found) == 1:   # X | None: coerce what is there
            inner = found[0]
            return lambda v: None if v is None else inner(v)
    return None


def _tuple(inner: Coerce | None) -> Coerce:
    if inner is None:
        return lambda v: tuple(v) if isinstance(v, list) else v
    return lambda v: tuple(inner(x) for x in v) if isinstance(v, list) else v


def _fixed_tuple(inner: list[Coerce | None]) -> Coerce:
    def coerce(v):
        if not isinstance(v, list):
            return v
        if len(v) != len(inner):
            raise ValueError(f"{len(v)} values for a tuple of {len(inner)}")
        return tuple(c(x) if c is not None else x for c, x in zip(inner, v))
    return coerce


# ---- field types ----------------------------------------------------------------------------
Check = Callable[[Any], "str | None"]   # why a value is not of the field's type; None: it is
_EXACT = 2 ** 53                         # ints a float field takes (exact as floats)
_EXACT_TYPES = (int, str, bool, bytes, type(None))   # a value of these is of the exact type


def _field_checks(cls: type) -> tuple[dict[str, frozenset], dict[str, Check]]:
    """Per field, the exact types that pass at once (a scalar, an enum, a message, a union
    of them: one set lookup per field), and the check that decides (or names) the rest."""
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError) as e:
        raise TypeError(f"wire type {cls.__name__}: its field types do not resolve ({e}); "
                        "a message's fields are checked against them") from None
    exact = {}
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name, Any)
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        parts = typing.get_args(hint) if union else (hint,)
        if all(p in _EXACT_TYPES or isinstance(p, type) and (
                issubclass(p, enum.Enum) or dataclasses.is_dataclass(p)) for p in parts):
            exact[f.name] = frozenset(parts)
    return exact, {f.name: _checker(hints.get(f.name, Any)) for f in dataclasses.fields(cls)}


def _name(hint: Any) -> str:
    """`hint` as written in the source, without module paths."""
    if isinstance(hint, tuple):
        return " | ".join(_name(h) for h in hint)
    if isinstance(hint, type) and not typing.get_args(hint):
        return hint.__name__
    return re.sub(r"\b(?:\w+\.)+(\w+)", r"\1", str(hint))


def _got(v: Any) -> str:
    kind = type(v).__name__
    return f"is {'an' if kind[0] in 'aeiou' else 'a'} {kind} ({str(v)[:40]!r})"


def _scalar(hint: Any) -> Callable[[Any], bool] | None:
    """A test of one value of a scalar hint (None for a hint that is not one)."""
    if hint is bool:
        return lambda v: type(v) is bool
    if hint is int:
        return lambda v: type(v) is int
    if hint is float:   # JSON writes 2.0 as 2.0, but a sender may write 2
        return lambda v: (type(v) is float and math.isfinite(v)
                          or type(v) is int and abs(v) <= _EXACT)
    if hint is str:
        return lambda v: type(v) is str
    if hint is bytes:
        return lambda v: type(v) is bytes
    if hint is type(None):
        return lambda v: v is None
    if isinstance(hint, type) and issubclass(hint, PurePath):
        return lambda v: isinstance(v, PurePath)
    if isinstance(hint, type) and (issubclass(hint, enum.Enum)
                                   or dataclasses.is_dataclass(hint)):
        return lambda v: isinstance(v, hint)
    return None


def _checker(hint: Any) -> Check:
    """What tells whether a decoded (and coerced) value is of type `hint`."""
    name = "finite float" if hint is float else _name(hint)
    if hint is Any or hint is object:
        return lambda v: None
    if (test := _scalar(hint)) is not None:
        return lambda v: None if test(v) else f"{_got(v)}, not {name}"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [_checker(a) for a in args if a is not type(None)]
        if len(inner) == 1 and len(args) == 2:   # X | None: why it is not an X
            return lambda v: None if v is None else inner[0](v)
        inner.append(_checker(type(None)))
        return lambda v: None if any(c(v) is None for c in inner) else f"{_got(v)}, not {name}"
    if origin in (list, tuple) and (len(args) == 1 or len(args) == 2 and args[1] is Ellipsis):
        return _sequence(origin, args[0] if args else Any, name)
    if origin is tuple:
        inner = [_checker(a) for a in args]
        return lambda v: (f"{_got(v)}, not {name}" if type(v) is not tuple
                          or len(v) != len(inner) else
                          next((f"[{i}] {why}" for i, (c, x) in enumerate(zip(inner, v))
                                if (why := c(x)) is not None), None))
    if origin is dict:
        key, value = (_checker(a) for a in (args or (Any, Any)))
        return lambda v: f"{_got(v)}, not {name}" if type(v) is not dict else next(
            (f"[{k!r:.40}] {why}" for k, x in v.items()
             if (why := key(k) or value(x)) is not None), None)
    if origin in (list, tuple, dict):
        return lambda v: None if type(v) is origin else f"{_got(v)}, not {name}"
    raise TypeError(f"a wire field of type {hint} cannot be checked")


def _sequence(kind: type, item: Any, name: str) -> Check:
    """list[X] / tuple[X, ...]. Token ids and logprobs are long: ints, strings and messages
    are told by the set of their types, floats also by a finite sum (a NaN or an infinity
    makes it one), in C; only a list that fails is walked, to name the value."""
    each = _checker(item)
    fast = _fast_items(item)

    def check(v):
        if type(v) is not kind:
            return f"{_got(v)}, not {name}"
        if item is Any or fast is not None and fast(v):
            return None
        return next((f"[{i}] {why}" for i, x in enumerate(v) if (why := each(x)) is not None),
                    None)
    return check


def _fast_items(item: Any) -> Callable[[Any], bool] | None:
    if item in _EXACT_TYPES or isinstance(item, type) and (
            issubclass(item, enum.Enum) or dataclasses.is_dataclass(item)):
        return lambda v: set(map(type, v)) <= {item}
    if item is float:
        return lambda v: set(map(type, v)) <= {float} and math.isfinite(sum(v))
    return None


# JSON values, paths and bytes, no dataclasses: what the launch's collectives carry
PLAIN = Codec()
