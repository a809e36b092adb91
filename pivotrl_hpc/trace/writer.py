"""TraceWriter: appends rows to the run's HDF5 trace, readable while written (SWMR).

Layout (see docs/trace.md): root attrs ``format``, ``meta`` (JSON), ``schema`` (JSON);
``/<table>/<column>`` 1-D chunked datasets; a json column is ``<column>`` (int64 end
offsets) plus ``<column>_json`` (uint8 bytes); ``/_committed`` (int64, one per table, in
schema order) holds the rows a reader may trust; ``/summary`` (uint8 JSON, empty while
running). SWMR forbids creating objects or attributes once ``swmr_mode`` is on, so all
of them are created up front; afterwards the writer only resizes and writes datasets.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import h5py
import numpy as np

from .schema import TABLES, check_row, check_schema, encode_value, loose_json_bytes, numpy_dtype
from .tensorboard import EventWriter

log = logging.getLogger(__name__)

FORMAT = "pivotrl-trace/1"
ROW_CHUNK = 1024         # rows per HDF5 chunk of a column
BLOB_CHUNK = 64 * 1024   # bytes per HDF5 chunk of a json blob
WRITE_EVERY = 4096       # buffered rows of one table that trigger a (not yet visible) write


def _create_appendable(group: h5py.Group, name: str, dtype: Any, chunk: int) -> None:
    group.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(chunk,))


def _extend(ds: h5py.Dataset, values: np.ndarray) -> None:
    start = ds.shape[0]
    ds.resize((start + len(values),))
    ds[start:] = values


def _create_swmr(path: Path, group_shared: bool, layout: Callable[[h5py.File], None]) -> h5py.File:
    """A new trace at `path`, with no lock another account could take in its way: made under
    a temp name in its folder (checked, opened without following links: folders.temp_at) with
    `file_mode(group_shared)`, opened by HDF5 through this process's descriptor of that very
    file (/proc/self/fd: no name in between) with file locking off, laid out, switched to
    SWMR, then renamed over `path` (a planted link is replaced; an old trace is replaced
    whole, never truncated first, and its readers keep the old file)."""
    # imported here: importing the trace package stays light (no config, no yaml)
    from pivotrl_hpc.checkpoint.folders import file_mode, open_folder, place_at, temp_at

    dir_fd = open_folder(path.parent, own=0, create=True, group_shared=group_shared)
    try:
        fd, tmp = temp_at(dir_fd, path.name, file_mode(group_shared), os.O_RDWR)
        try:
            f = h5py.File(f"/proc/self/fd/{fd}", "w", libver="latest", locking=False)
        finally:
            os.close(fd)
        try:
            layout(f)
            f.swmr_mode = True
            place_at(dir_fd, tmp, path.name)
        except BaseException:
            f.close()
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        return f
    finally:
        os.close(dir_fd)


class TraceWriter:
    """One run's trace. ``append`` buffers; ``flush`` makes the rows visible to readers."""

    def __init__(self, path: str | os.PathLike, meta: dict | None = None,
                 write_every: int = WRITE_EVERY, tensorboard: str | os.PathLike | None = None,
                 loggers: tuple = (), group_shared: bool = False):
        """`tensorboard`: a folder that also receives every `steps` row's numbers as
        TensorBoard scalars (`steps/<column>` at the row's step). `loggers`: more sinks
        (trace.loggers, e.g. trace.wandb.WandbLogger) that get every `steps`, `validation`
        and `samples` row as it is appended (`row(table, cells)`) and `close()`. The trace
        and its folder get the run files' modes (`group_shared`: 0640 and 0750, else 0600
        and 0700) whatever the umask."""
        check_schema(TABLES)
        self.path = Path(os.path.abspath(path))
        self._tb = EventWriter(tensorboard, group_shared) if tensorboard is not None else None
        self._loggers = list(loggers)
        self._start = time.monotonic()
        self._write_every = max(1, int(write_every))
        self._lock = threading.Lock()
        self._buffers: dict[str, list[dict[str, Any]]] = {name: [] for name in TABLES}
        self._written = {name: 0 for name in TABLES}
        self._closed = False
        self._file = _create_swmr(self.path, group_shared, lambda f: self._create_layout(f, meta))
        log.info("trace %s opened for writing (SWMR)", self.path)

    @staticmethod
    def _create_layout(f: h5py.File, meta: dict | None) -> None:
        f.attrs["format"] = FORMAT
        f.attrs["meta"] = loose_json_bytes(meta or {}).decode()
        f.attrs["schema"] = json.dumps(TABLES)
        f.create_dataset("_committed", data=np.zeros(len(TABLES), "i8"),
                         maxshape=(len(TABLES),), chunks=(len(TABLES),))
        _create_appendable(f, "summary", "u1", BLOB_CHUNK)
        for table, columns in TABLES.items():
            group = f.create_group(table)
            for column, ctype in columns.items():
                _create_appendable(group, column, numpy_dtype(ctype), ROW_CHUNK)
                if ctype == "json":
                    _create_appendable(group, f"{column}_json", "u1", BLOB_CHUNK)

    # --- appending ------------------------------------------------------------------
    def now(self) -> float:
        """Seconds since this writer was created (the default of a row's ``t``)."""
        return time.monotonic() - self._start

    def append(self, table: str, **row: Any) -> int:
        """Buffer one row; returns its index in the table. Unknown table/column or an
        unconvertible value: ValueError. Missing columns get defaults (``t``: ``now()``;
        floats nan, ints -1, strings "", json null)."""
        columns = check_row(table, row)
        if row.get("t") is None:
            row["t"] = self.now()
        cells = {column: encode_value(table, column, ctype, row.get(column))
                 for column, ctype in columns.items()}
        with self._lock:
            self._check_open()
            if table == "steps" and self._tb is not None:
                self._tb.scalars(int(cells["step"]), {
                    f"steps/{c}": float(cells[c]) for c, ctype in columns.items()
                    if ctype in ("float", "int") and c not in ("t", "step")})
            if table == "validation" and self._tb is not None:
                self._tb.scalars(int(cells["step"]), {
                    f"validation/accuracy/{row.get('data_source') or 'all'}":
                        float(cells["accuracy"])})
            for logger in self._loggers:
                logger.row(table, row)
            buf = self._buffers[table]
            buf.append(cells)
            index = self._written[table] + len(buf) - 1
            if len(buf) >= self._write_every:
                self._write_table(table)
            return index

    def update(self, table: str, index: int, **row: Any) -> None:
        """Set cells of row `index` appended earlier (a `steps` row's `val_accuracy`,
        known once its evaluation ends); visible to readers after the next `flush()`.
        Numbers and strings only: a json cell is a slice of its blob."""
        columns = check_row(table, row)
        with self._lock:
            self._check_open()
            if not 0 <= index < self._written[table] + len(self._buffers[table]):
                raise ValueError(f"{table} has no row {index}")
            for column, value in row.items():
                if columns[column] == "json":
                    raise ValueError(f"{table}.{column}: a json cell cannot be updated")
                cell = encode_value(table, column, columns[column], value)
                if index >= self._written[table]:
                    self._buffers[table][index - self._written[table]][column] = cell
                else:
                    self._file[table][column][index] = cell
            if table == "steps" and self._tb is not None:
                self._tb.scalars(self._cell(table, index, "step"), {
                    f"steps/{c}": float(v) for c, v in row.items()
                    if columns[c] in ("float", "int")})

    def _cell(self, table: str, index: int, column: str) -> int:
        if index >= self._written[table]:
            return int(self._buffers[table][index - self._written[table]][column])
        return int(self._file[table][column][index])

    def flush(self) -> None:
        """Write all buffered rows and make them visible to SWMR readers."""
        with self._lock:
            self._check_open()
            self._flush_locked()

    def _flush_locked(self) -> None:
        for table in TABLES:
            self._write_table(table)
        # Data first, then the counters that let readers trust it: a reader never sees
        # a committed row whose cells (or json bytes) are not on disk yet.
        self._file.flush()
        committed = self._file["_committed"]
        committed[:] = np.array([self._written[t] for t in TABLES], "i8")
        committed.flush()

    def _write_table(self, table: str) -> None:
        rows = self._buffers[table]
        if not rows:
            return
        group = self._file[table]
        for column, ctype in TABLES[table].items():
            values = [r[column] for r in rows]
            if ctype == "json":
                self._write_json(group, column, values)
            else:
                _extend(group[column], np.array(values, dtype=numpy_dtype(ctype)))
        self._written[table] += len(rows)
        self._buffers[table] = []

    @staticmethod
    def _write_json(group: h5py.Group, column: str, blobs: list[bytes]) -> None:
        data = group[f"{column}_json"]
        ends = data.shape[0] + np.cumsum([len(b) for b in blobs], dtype="i8")
        _extend(data, np.frombuffer(b"".join(blobs), dtype="u1"))
        _extend(group[column], ends)

    # --- closing --------------------------------------------------------------------
    def close(self, summary: dict | None = None) -> None:
        """Flush, store ``summary`` (JSON) and close. Idempotent; a second call is a no-op."""
        with self._lock:
            if self._closed:
                if summary is not None:
                    log.warning("trace %s already closed; summary ignored", self.path)
                return
            try:
                if summary is not None:
                    _extend(self._file["summary"],
                            np.frombuffer(loose_json_bytes(summary), "u1"))
                self._flush_locked()
            finally:
                self._closed = True
                self._file.close()
                if self._tb is not None:
                    self._tb.close()
                for logger in self._loggers:
                    logger.close()
        log.info("trace %s closed", self.path)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"trace {self.path} is closed")

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close({"error": repr(exc)} if exc is not None else None)
