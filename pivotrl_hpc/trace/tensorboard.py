"""Per-step metrics as TensorBoard event files, written without TensorFlow or TensorBoard.

An event file is a TFRecord stream: each record is its length (uint64, little endian), the
masked CRC-32C of those 8 bytes, the payload, and the masked CRC-32C of the payload. Each
payload is a serialized `tensorflow.Event` (event.proto: wall_time = 1 double, step = 2 int64,
file_version = 3 string, summary = 5), whose `Summary` holds repeated `Value`s (summary.proto:
tag = 1 string, simple_value = 2 float). The first event names the file version
("brain.Event:2"), as TensorBoard expects. These few fields are encoded by hand here so that
the offline logger needs no extra package; TensorBoard and `tbparse` read the files.
"""
from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1   # Castagnoli, reflected
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1   # int64 two's complement, as protobuf encodes negatives
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event_bytes(wall_time: float, step: int, *, file_version: str | None = None,
                scalars: dict[str, float] | None = None) -> bytes:
    """One serialized Event: the file version, or a Summary of simple scalar values."""
    out = bytearray(_varint(1 << 3 | 1) + struct.pack("<d", wall_time))
    out += _varint(2 << 3 | 0) + _varint(step)
    if file_version is not None:
        out += _field_bytes(3, file_version.encode())
    if scalars:
        values = b"".join(
            _field_bytes(1, _field_bytes(1, tag.encode()) + _varint(2 << 3 | 5)
                         + struct.pack("<f", value))
            for tag, value in scalars.items())
        out += _field_bytes(5, values)
    return bytes(out)


def record(payload: bytes) -> bytes:
    header = struct.pack("<Q", len(payload))
    return (header + struct.pack("<I", masked_crc(header)) + payload
            + struct.pack("<I", masked_crc(payload)))


class EventWriter:
    """One event file in `folder` (TensorBoard's name pattern); scalars per step. The folder
    is the user's own (made `folder_mode`, checked level by level without following links);
    the file is made fresh under the folder's descriptor (O_EXCL | O_NOFOLLOW, renamed into
    place: a planted link of its name is replaced, never written through) with
    `file_mode(group_shared)`, whatever the umask."""

    def __init__(self, folder: str | os.PathLike, group_shared: bool = False):
        from pivotrl_hpc.checkpoint.folders import create_at, file_mode, open_folder

        self.folder = Path(folder)
        now = time.time()
        self.path = self.folder / (f"events.out.tfevents.{int(now)}."
                                   f"{socket.gethostname()}.{os.getpid()}")
        dir_fd = open_folder(self.folder, own=1, create=True, group_shared=group_shared)
        try:
            fd = create_at(dir_fd, self.path.name, file_mode(group_shared), os.O_WRONLY)
        finally:
            os.close(dir_fd)
        self._file = os.fdopen(fd, "wb")
        self._file.write(record(event_bytes(now, 0, file_version="brain.Event:2")))
        self._file.flush()

    def scalars(self, step: int, values: dict[str, float],
                wall_time: float | None = None) -> None:
        """Write the finite values of one step (NaN means "not measured" in the trace)."""
        finite = {k: float(v) for k, v in values.items() if v == v}
        if finite:
            self._file.write(record(event_bytes(wall_time or time.time(), step,
                                                scalars=finite)))
            self._file.flush()   # a TensorBoard watching the folder sees the step now

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def tensorboard_dir(trace_path: str | os.PathLike, enabled: bool) -> Path | None:
    """Where a run's event files go (`trace.tensorboard: true`): beside its first trace,
    one folder for every segment of the run (x.seg2.h5 -> x.tensorboard/, an event file of
    its own in it), whose steps continue the earlier segments'."""
    from pivotrl_hpc.checkpoint.layout import base_trace

    return base_trace(Path(trace_path)).with_suffix(".tensorboard") if enabled else None
