"""The trace schema (one place) and the per-value encoding rules.

A column type is one of ``"float"`` (float64, default nan), ``"int"`` (int64, default -1),
``"str:<width>"`` (fixed-size UTF-8 bytes, default "", longer values truncated with
``TRUNCATION_MARKER``) or ``"json"`` (any JSON value, unbounded, default null).
Every table starts with ``t``: seconds since the run started (float64).
"""
from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

TRUNCATION_MARKER = "...[truncated]"

NAME = "str:64"      # role, replica, policy, model names
SHORT = "str:16"     # enumerations: direction, event, op, kind
DEVICES = "str:512"  # device lists like "0,1,2,3"
TEXT = "str:512"     # reasons
MESSAGE = "str:1024"

TABLES: dict[str, dict[str, str]] = {
    "timeseries": {
        "t": "float", "role": NAME, "devices": "int", "replicas": "int", "running": "int",
        "queued": "int", "tokens_per_s": "float", "tokens_total": "int",
    },
    "shifts": {
        "t": "float", "plan_id": "int", "direction": SHORT, "role": NAME, "replica": NAME,
        "devices": DEVICES, "seconds": "float", "phases": "json", "version": "int",
    },
    "planner": {
        "t": "float", "plan_id": "int", "policy": NAME, "decision_s": "float", "chosen": "int",
        "reason": TEXT, "executed": "int", "snapshot": "json", "candidates": "json",
    },
    "sequences": {
        "t": "float", "seq_id": "str:128", "event": SHORT, "role": NAME, "replica": NAME,
        "tokens": "int", "version": "int", "step": "int", "prompt_tokens": "int",
    },
    "steps": {
        "t": "float", "step": "int", "version": "int", "samples": "int", "tokens": "int",
        "reward_mean": "float", "reward_std": "float", "verifiable_mean": "float",
        "genrm_mean": "float", "unparsed": "int", "loss": "float", "max_lag": "int",
        "val_accuracy": "float", "seconds": "float", "prompts": "json",
    },
    "gps": {
        "t": "float", "op": SHORT, "model": NAME, "version": "int", "rank": "int",
        "node": "int", "bytes": "int", "seconds": "float",
    },
    "fits": {
        "t": "float", "role": NAME, "A": "float", "B": "float", "C": "float", "D": "float",
        "error": "float", "samples": "int",
    },
    "events": {"t": "float", "kind": SHORT, "message": MESSAGE},
    "work": {
        "t": "float", "role": NAME, "replica": NAME, "devices": "int", "seconds": "float",
        "engine_s": "float", "tokens": "int", "first": "int",
    },
    "reloads": {"t": "float", "replica": NAME, "devices": DEVICES, "version": "int",
                "seconds": "float"},
    "admission": {"t": "float", "version": "int", "published": "int", "samples": "int",
                  "held_s": "float"},
    "start": {"t": "float", "step": "int", "version": "int", "staleness": "int",
              "held_s": "float", "unparsed": "int", "tau": "json", "tau_counts": "json"},
    "samples": {
        "t": "float", "step": "int", "kind": SHORT, "sample": "int", "data_source": NAME,
        "version": "int", "prompt": "json", "response": "json", "judgement": "json",
        "parse": SHORT, "verifiable": "float", "genrm": "float", "reward": "float",
        "correct": "int", "prompt_tokens": "int", "response_tokens": "int",
        "judge_tokens": "int",
    },
    "validation": {"t": "float", "step": "int", "data_source": NAME, "samples": "int",
                   "correct": "int", "accuracy": "float", "versions": "json"},
}


def str_width(ctype: str) -> int | None:
    """Byte width of a ``str:<width>`` column type, None for other types."""
    if not ctype.startswith("str:"):
        return None
    return int(ctype[4:])


def numpy_dtype(ctype: str) -> np.dtype:
    """The dtype of the column's main dataset (json: int64 end offsets into its blob)."""
    if ctype == "float":
        return np.dtype("f8")
    if ctype in ("int", "json"):
        return np.dtype("i8")
    width = str_width(ctype)
    if width is None:
        raise ValueError(f"unknown column type {ctype!r}")
    return np.dtype(f"S{width}")


def check_schema(tables: dict[str, dict[str, str]]) -> None:
    """Raise ValueError if a column type is unknown (guards edits of TABLES)."""
    for table, columns in tables.items():
        for column, ctype in columns.items():
            try:
                numpy_dtype(ctype)
            except ValueError as exc:
                raise ValueError(f"{table}.{column}: {exc}") from None


def truncate_utf8(text: str, width: int) -> bytes:
    """UTF-8 bytes of ``text``, at most ``width`` long; cut ones end in TRUNCATION_MARKER."""
    raw = text.encode("utf-8")
    if len(raw) <= width:
        return raw
    marker = TRUNCATION_MARKER.encode()
    keep = raw[: max(width - len(marker), 0)].decode("utf-8", errors="ignore").encode()
    return (keep + marker)[:width]


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _loose_default(value: Any) -> Any:
    try:
        return _json_default(value)
    except TypeError:
        return str(value)


def to_json_bytes(value: Any) -> bytes:
    """Compact JSON (numpy scalars/arrays allowed) as UTF-8 bytes; TypeError otherwise."""
    return json.dumps(value, default=_json_default, separators=(",", ":")).encode("utf-8")


def loose_json_bytes(value: Any) -> bytes:
    """Like to_json_bytes, but other objects (paths, enums...) become their str()."""
    return json.dumps(value, default=_loose_default, separators=(",", ":")).encode("utf-8")


def encode_value(table: str, column: str, ctype: str, value: Any) -> Any:
    """The stored form of one cell: float, int, bytes (str / json). ValueError if it
    does not convert."""
    try:
        if ctype == "float":
            return math.nan if value is None else float(value)
        if ctype == "int":
            return -1 if value is None else int(value)
        if ctype == "json":
            return to_json_bytes(value)
        return truncate_utf8("" if value is None else str(value), str_width(ctype))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{table}.{column} ({ctype}): cannot store {value!r}: {exc}") from None


def check_row(table: str, row: dict[str, Any],
              tables: dict[str, dict[str, str]] = TABLES) -> dict[str, str]:
    """The table's columns; ValueError naming an unknown table or column."""
    columns = tables.get(table)
    if columns is None:
        raise ValueError(f"unknown trace table {table!r}; allowed: {', '.join(tables)}")
    unknown = [c for c in row if c not in columns]
    if unknown:
        raise ValueError(f"unknown column(s) {', '.join(map(repr, unknown))} for trace table "
                         f"{table!r}; allowed: {', '.join(columns)}")
    return columns
