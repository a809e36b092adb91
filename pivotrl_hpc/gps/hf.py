"""An HF safetensors folder into a GPS segment: its canonical header (the same offsets on
every node, from the same model) and the parallel load of its tensors."""
from __future__ import annotations

import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pivotrl_hpc.gps.layout import TensorInfo
from pivotrl_hpc.gps.segment import MAX_HEADER_BYTES, Header, Segment


def hf_header(folder: Path, metadata: dict[str, str]) -> tuple[Header, dict[str, tuple[Path, int]]]:
    """Canonical header of an HF safetensors folder, and name -> (file, absolute offset)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    specs, where = [], {}
    for f in files:
        with open(f, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            (n,) = struct.unpack("<Q", head) if len(head) == 8 else (0,)
            src = Header.parse(head + fh.read(min(n, MAX_HEADER_BYTES)), size, str(f))
        for t in src.tensors.values():
            specs.append((t.name, t.dtype, t.shape))
            where[t.name] = (f, src.data_start + t.start)
    return Header.build(specs, metadata), where


def load_into(seg: Segment, where: dict[str, tuple[Path, int]], names: set[str] | None = None,
              threads: int = 4) -> int:
    """Read tensors from their safetensors files straight into the segment, in parallel."""
    todo = [t for t in seg.header.tensors.values() if names is None or t.name in names]

    def one(t: TensorInfo) -> int:
        path, off = where[t.name]
        dst = memoryview(seg.bytes_view(t.start, t.stop))
        with open(path, "rb", buffering=0) as fh:
            fh.seek(off)
            got = 0
            while got < t.nbytes:
                n = fh.readinto(dst[got:])
                if not n:
                    raise IOError(f"{path} ends inside {t.name}")
                got += n
        return t.nbytes

    with ThreadPoolExecutor(max_workers=threads) as pool:
        return sum(pool.map(one, todo))
