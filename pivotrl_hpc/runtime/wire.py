"""A typed message format for the job's own sockets (JSON of named dataclasses, never pickle)
and who is at the other end of one (`peer`).

Why: `pickle.loads` runs whatever the bytes say, so a process that can write to a socket of
the job could run code in it (issue 35: `nobody` sent a pickle to the root host forker and
it ran `id` as root). A `Codec` decodes only JSON values and the dataclasses it was built
with, by name, through their constructors (`__post_init__` checks included): a message of
any other shape is a `WireError`, and nothing in it runs.

Encoding: a dataclass is a JSON object `{"__t": its class name, field: value, ...}` (fields
encoded the same way, recursively), a path is `{"__t": "Path", "p": str}`; tuples travel as
lists and come back as tuples where the field is declared a tuple. Dict keys must be strings.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import struct
from pathlib import Path, PurePath
from typing import Any

TAG = "__t"


_UCRED = struct.Struct("3i")


@dataclasses.dataclass(frozen=True)
class Peer:
    """SO_PEERCRED of a unix socket: the process that connected (seen by the listener), or
    the one that called listen() (seen by the connector), or the socketpair's creator."""
    pid: int
    uid: int
    gid: int


def peer(fd: int) -> Peer:
    """The kernel's word on who is at the other end of the unix socket `fd`."""
    with socket.socket(fileno=os.dup(fd)) as sock:
        return Peer(*_UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                   _UCRED.size)))


class WireError(ValueError):
    """Bytes that are not a message of the expected types."""


class Codec:
    """Encoder and decoder of messages built from JSON values and the given dataclasses."""

    def __init__(self, *types: type):
        for cls in types:
            if not dataclasses.is_dataclass(cls):
                raise TypeError(f"{cls.__name__} is not a dataclass")
        self._types = {cls.__name__: cls for cls in types}
        if len(self._types) != len(types):
            raise TypeError("two wire types share a name")
        # the fields declared as tuples: JSON brings them back as lists
        self._tuples = {cls.__name__: {f.name for f in dataclasses.fields(cls)
                                       if str(f.type).startswith(("tuple", "Tuple"))}
                        for cls in types}

    def encode(self, message: Any) -> bytes:
        try:
            return json.dumps(message, default=self._default, separators=(",", ":"),
                              check_circular=False).encode()
        except (TypeError, ValueError, RecursionError) as e:
            raise WireError(f"cannot encode {type(message).__name__}: {e}") from None

    def decode(self, data: bytes) -> Any:
        try:
            return json.loads(data, object_hook=self._object)
        except WireError:
            raise
        except (ValueError, TypeError, RecursionError, UnicodeDecodeError) as e:
            raise WireError(f"not a message of this channel ({len(data)} bytes): "
                            f"{type(e).__name__}: {str(e)[:200]}") from None

    def _default(self, obj: Any) -> dict:
        cls = type(obj)
        if self._types.get(cls.__name__) is cls:
            return {TAG: cls.__name__, **vars(obj)}   # the fields (no slots, no extras)
        if isinstance(obj, PurePath):
            return {TAG: "Path", "p": str(obj)}
        raise TypeError(f"{cls.__name__} is not a type of this channel")

    def _object(self, obj: dict) -> Any:
        name = obj.pop(TAG, None)
        if name is None:
            return obj
        if name == "Path" and isinstance(obj.get("p"), str) and len(obj) == 1:
            return Path(obj["p"])
        cls = self._types.get(name) if isinstance(name, str) else None
        if cls is None:
            raise WireError(f"{name!r} is not a type of this channel")
        for key in self._tuples[name] & obj.keys():
            if isinstance(obj[key], list):
                obj[key] = tuple(obj[key])
        try:
            return cls(**obj)
        except (TypeError, ValueError) as e:
            raise WireError(f"bad {name}: {e}") from None
