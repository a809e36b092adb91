"""Reading a trace, finished or still being written (SWMR read)."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from .schema import check_row, str_width

log = logging.getLogger(__name__)


def _decode_strings(raw: np.ndarray) -> np.ndarray:
    out = np.empty(len(raw), dtype=object)
    out[:] = [b.decode("utf-8", errors="replace") for b in raw]
    return out


def _decode_json(ends: np.ndarray, blob: bytes) -> np.ndarray:
    out = np.empty(len(ends), dtype=object)
    start = 0
    for i, end in enumerate(ends.tolist()):
        out[i] = json.loads(blob[start:end])
        start = end
    return out


class Trace:
    """A read-only view of one trace file. Row counts and the summary are as of the last
    ``refresh()`` (done on open); a writer's rows appear after its ``flush()``."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        # no file lock: another account that can open the file (a group-shared run's 0640)
        # could hold one and fail every reader; SWMR's ordering needs none
        self._file = h5py.File(self.path, "r", libver="latest", swmr=True, locking=False)
        try:
            attrs = self._file.attrs
            self.format = str(attrs.get("format", ""))
            self.schema: dict[str, dict[str, str]] = json.loads(attrs["schema"])
            self.meta: dict = json.loads(attrs["meta"])
        except BaseException:
            self._file.close()
            raise
        self._rows: dict[str, int] = {}
        self.summary: dict | None = None
        self.refresh()

    @property
    def tables(self) -> list[str]:
        return list(self.schema)

    def columns(self, name: str) -> list[str]:
        return list(check_row(name, {}, self.schema))

    def refresh(self) -> None:
        """Re-read the committed row counts and the summary (rows flushed since)."""
        committed = self._file["_committed"]
        committed.refresh()
        counts = committed[()].tolist()
        self._rows = dict(zip(self.schema, (int(c) for c in counts)))
        summary = self._file["summary"]
        summary.refresh()
        self.summary = json.loads(summary[()].tobytes()) if summary.shape[0] else None

    def rows(self, name: str) -> int:
        check_row(name, {}, self.schema)
        return self._rows[name]

    def table(self, name: str) -> dict[str, np.ndarray]:
        """Column -> array of the committed rows: float64 / int64, str objects for string
        columns, parsed JSON objects for json columns."""
        columns = check_row(name, {}, self.schema)
        n = self._rows[name]
        group = self._file[name]
        return {column: self._read_column(group, column, ctype, n)
                for column, ctype in columns.items()}

    @staticmethod
    def _read_column(group: h5py.Group, column: str, ctype: str, n: int) -> np.ndarray:
        ds = group[column]
        ds.refresh()
        values = ds[:n]
        if ctype == "json":
            blob_ds = group[f"{column}_json"]
            blob_ds.refresh()
            # len(values), not n: a file whose schema attr lost a table reads past its rows
            blob = blob_ds[: int(values[-1])].tobytes() if len(values) else b""
            return _decode_json(values, blob)
        if str_width(ctype) is not None:
            return _decode_strings(values)
        return values

    def close(self) -> None:
        if self._file.id.valid:
            self._file.close()

    def __enter__(self) -> "Trace":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        rows = ", ".join(f"{k}={v}" for k, v in self._rows.items() if v)
        return f"Trace({str(self.path)!r}, {rows or 'empty'})"


def open_trace(path: str | os.PathLike) -> Trace:
    """Open a trace for reading; works on a finished file and on one being written."""
    return Trace(path)
