"""What a node agent pulls from its peers: a Write's replication and the remote part of a Read.

A `Pull` is the transfers from one source node; a transfer error (NIXL `ERR`, an MPI request
the holder refused, a peer that never announced the segment) is retried up to
`MAX_ATTEMPTS` times, then raised as `TransferError` for the agent to report to the client
whose Write or Read it served: never an uncaught exception that ends the agent (issue 11.9).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from pivotrl_hpc.gps.conns import Conn
from pivotrl_hpc.gps.plan import Range
from pivotrl_hpc.gps.segment import SHM_DIR, RawMap, staging_prefix
from pivotrl_hpc.gps.transport import Pending

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3


class TransferError(RuntimeError):
    """Bytes could not be moved from a peer node after `MAX_ATTEMPTS` tries."""


@dataclass
class Pull:
    src: int
    nbytes: int
    start: Callable[[], Pending]   # issues the transfers (again, on a retry)
    what: str = ""
    attempts: int = 0
    pending: Pending | None = None

    def done(self) -> bool:
        try:
            if self.pending is None:
                self.attempts += 1
                self.pending = self.start()
            return self.pending.done()
        except Exception as e:  # any transport failure: retry, then report
            self.pending = None
            if self.attempts >= MAX_ATTEMPTS:
                raise TransferError(f"{self.what}: transfer from node {self.src} failed "
                                    f"{self.attempts} times: {type(e).__name__}: {e}") from e
            log.warning("%s: transfer from node %d failed (attempt %d of %d), retrying: %s",
                        self.what, self.src, self.attempts, MAX_ATTEMPTS, e)
            return False


def all_done(pulls: list[Pull]) -> bool:
    """Poll every pull (so all progress); True when all finished."""
    return all([p.done() for p in pulls])


@dataclass
class ReadFetch:
    """The remote part of one client's Read of `version`: data ranges `items` into the
    client's staging file, in order. Waits while the version is still being replicated
    (until then its holders may not have their tensors yet)."""
    conn: Conn
    model: str
    version: int
    items: list[Range]
    dest: RawMap
    pulls: list[Pull] | None = None
    offsets: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        pos = 0
        for a, b in self.items:
            self.offsets[a] = pos
            pos += b - a

    def view(self, a: int, b: int) -> np.ndarray:
        """The staging bytes of data range [a, b) (inside one item)."""
        start = max(x for x in self.offsets if x <= a)
        off = self.offsets[start] + (a - start)
        return self.dest._u8[off: off + (b - a)]

    def close(self) -> None:
        self.pulls = None   # their retry closures hold views of the staging map
        self.dest.close()


def staging_file(dest: str, job: str, node: str) -> Path:
    """Only this job's own staging files: the agent maps `dest` read-write."""
    path = Path(dest)
    if path.parent != SHM_DIR or not path.name.startswith(staging_prefix(job, node)):
        raise PermissionError(f"fetch into {dest!r} refused: not a staging file of job "
                              f"{job} on {node}")
    return path
