"""Point-to-point byte movement between node agents: NIXL over UCX, MPI as the fallback.

Both are pull-based: the receiving agent fetches byte ranges of a peer's exposed buffer into a
local buffer. NIXL READs are one-sided (the holder's CPU does nothing); the MPI fallback sends
a small request on the agents' control channel and the holder answers with `Isend`s from its
event loop. Agent metadata for NIXL is exchanged once with an MPI allgather. Control
messages (plain dicts) cross MPI as `PEER_WIRE` JSON bytes, never pickled (issue 51).

Set `UCX_MODULES=^ib,rdmacm` on machines without InfiniBand (every NIXL process segfaults at
exit otherwise); `make_transport` sets it when unset. When NIXL cannot start, `make_transport`
falls back to MPI and records why in `fallback` (the agent reports it to `ping`).
`PIVOTRL_GPS_MPI_CHUNK_BYTES` sets the MPI message size (default 1 GiB, the int-count limit).

Fault injection, for tests only: `PIVOTRL_TEST_FAULTS=gps_nacks=N` makes this agent refuse the first
N MPI data requests it serves, exactly as it refuses a request for a buffer it no longer
exposes (the fault is otherwise a race that the retirement protocol of store.py prevents).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pivotrl_hpc import envs
from pivotrl_hpc.protocol import mpi
from pivotrl_hpc.protocol.wire import Codec

log = logging.getLogger(__name__)

CTRL_TAG = 71
PEER_WIRE = Codec()   # the agents' control messages: JSON values (and bytes) only
_DATA_TAG0 = 1000
_MAX_MSG = 1 << 30  # MPI counts are ints: move big ranges in 1 GiB pieces


def chunk_bytes() -> int:
    n = envs.GPS_MPI_CHUNK_BYTES.get()
    if not 0 < n <= _MAX_MSG:
        raise ValueError(f"{envs.GPS_MPI_CHUNK_BYTES.name} must be in (0, {_MAX_MSG}]: {n}")
    return n


@dataclass
class Pending:
    """One fetch in flight; `done()` polls it."""
    poll: Any
    nbytes: int
    _done: bool = False
    keep: list = field(default_factory=list)
    error: str | None = None   # set when the holder refused the request

    def done(self) -> bool:
        if self.error is not None:
            raise RuntimeError(self.error)
        if not self._done:
            self._done = bool(self.poll())
        return self._done


class MPITransport:
    """Fallback: request over the control channel, data by Isend/Irecv."""
    name = "mpi"

    def __init__(self, comm, fallback: str | None = None):
        self.comm = comm
        self.fallback = fallback  # why NIXL was not used, when it was asked for
        self.chunk = chunk_bytes()
        self.chunks_fetched = 0
        self.bytes_served: dict[int, int] = {}   # peer -> bytes this agent sent it
        self.exposed: dict[Any, np.ndarray] = {}
        self._next_tag = _DATA_TAG0
        self._sending: list = []
        self._receiving: dict[int, tuple[Pending, list]] = {}   # first tag -> fetch
        self._nacks_left = envs.fault("gps_nacks")   # tests only (module docstring)

    def expose(self, key, buf: np.ndarray) -> dict:
        self.exposed[key] = buf
        return {}

    def withdraw(self, key) -> None:
        self.exposed.pop(key, None)

    def learn(self, peer: int, info: dict) -> None:
        pass

    def fetch(self, peer: int, key, info: dict, pieces: list[tuple[int, np.ndarray]]) -> Pending:
        from mpi4py import MPI
        reqs, asks = [], []
        for off, dst in pieces:
            for lo in range(0, dst.size, self.chunk):
                part = dst[lo: lo + self.chunk]
                tag = self._tag()
                reqs.append(self.comm.Irecv([part, MPI.BYTE], source=peer, tag=tag))
                asks.append((off + lo, part.size, tag))
        self.chunks_fetched += len(asks)
        first = asks[0][2] if asks else None

        def poll() -> bool:
            if not MPI.Request.Testall(reqs):
                return False
            self._receiving.pop(first, None)
            return True

        pending = Pending(poll, sum(d.size for _, d in pieces))
        if first is not None:
            self._receiving[first] = (pending, reqs)
        mpi.send(self.comm, PEER_WIRE, {"op": "mpi_get", "key": tuple(key), "asks": asks},
                 peer, CTRL_TAG)
        return pending

    def serve(self, src: int, msg: dict) -> None:
        from mpi4py import MPI
        key = tuple(msg["key"])   # a JSON list on the wire, the tuple it was exposed under
        buf = self.exposed.get(key)
        if buf is None or self._nacks_left > 0:
            self._nacks_left -= buf is not None
            why = "fault injected" if buf is not None else "not exposed here (retired?)"
            log.error("MPI data request from agent %d for %s refused: %s", src, key, why)
            mpi.send(self.comm, PEER_WIRE,
                     {"op": "mpi_nack", "first": msg["asks"][0][2] if msg["asks"] else None,
                      "error": f"{key} refused by its holder: {why}"}, src, CTRL_TAG)
            return
        for off, n, tag in msg["asks"]:
            self.bytes_served[src] = self.bytes_served.get(src, 0) + n
            self._sending.append(self.comm.Isend([buf[off: off + n], MPI.BYTE], dest=src, tag=tag))
        self._sending = [r for r in self._sending if not r.Test()]

    def progress(self) -> None:
        if self._sending:
            self._sending = [r for r in self._sending if not r.Test()]

    def _tag(self) -> int:
        self._next_tag = _DATA_TAG0 + (self._next_tag - _DATA_TAG0 + 1) % 30000
        return self._next_tag

    def nack(self, msg: dict) -> None:
        """The holder refused a fetch of ours: its receives are cancelled, the fetch fails."""
        pending, reqs = self._receiving.pop(msg["first"], (None, []))
        for r in reqs:
            r.Cancel()
        if pending is not None:
            pending.error = msg["error"]

    def close(self, timeout_s: float = 5.0) -> None:
        """Finish the sends in flight, for at most `timeout_s`: a peer that is gone never
        receives them, and `Wait()` would block this agent's exit forever (issue 11.12)."""
        deadline = time.monotonic() + timeout_s
        while self._sending and time.monotonic() < deadline:
            self._sending = [r for r in self._sending if not r.Test()]
            time.sleep(0.001)
        if self._sending:
            log.warning("GPS MPI transport: %d sends not received within %.0f s; cancelled",
                        len(self._sending), timeout_s)
            for r in self._sending:
                r.Cancel()
        self._sending = []
        for _, reqs in self._receiving.values():
            for r in reqs:
                r.Cancel()
        self._receiving.clear()


class NIXLTransport:
    """NIXL agent per node agent; exposed buffers registered as DRAM, READ from peers."""
    name = "nixl"
    fallback = None

    def __init__(self, comm, node_index: int):
        self.comm = comm
        self.me = f"gps{node_index}"
        try:
            from nixl._api import nixl_agent, nixl_agent_config
            # No progress thread: NIXL's UCX thread polls with a zero timeout, a whole core
            # per node agent, taken from the capped devices. The agent's loop progresses
            # UCX itself (`progress`, every 2 ms while a transfer is in flight).
            self.agent = nixl_agent(self.me, nixl_agent_config(enable_prog_thread=False,
                                                               backends=["UCX"]))
            err = ""
        except Exception as e:  # noqa: BLE001 - reported collectively below
            err = f"{type(e).__name__}: {e}"
        errors = [x for x in mpi.allgather(comm, PEER_WIRE, err) if x]
        if errors:  # every node agrees on the transport, or the allgathers would mismatch
            raise RuntimeError(errors[0])
        metas = mpi.allgather(comm, PEER_WIRE, self.agent.get_agent_metadata())
        self.peers = {}
        for i, meta in enumerate(metas):
            if i != comm.rank:
                self.peers[i] = self.agent.add_remote_agent(meta)
        self.regs: dict[Any, Any] = {}
        self.spans: dict[Any, tuple[int, int]] = {}

    def expose(self, key, buf: np.ndarray) -> dict:
        if key not in self.regs:
            self.regs[key] = self.agent.register_memory([(buf.ctypes.data, buf.size, 0, "")],
                                                        "DRAM")
            self.spans[key] = (buf.ctypes.data, buf.size)
        # Peers need our metadata again after every registration (it carries the new keys).
        return {"addr": buf.ctypes.data, "meta": self.agent.get_agent_metadata()}

    def learn(self, peer: int, info: dict) -> None:
        if "meta" in info:
            self.agent.add_remote_agent(info["meta"])

    def withdraw(self, key) -> None:
        reg = self.regs.pop(key, None)
        self.spans.pop(key, None)
        if reg is not None:
            self.agent.deregister_memory(reg)

    def fetch(self, peer: int, key, info: dict, pieces: list[tuple[int, np.ndarray]]) -> Pending:
        keep = []
        for _, dst in pieces:  # staging buffers are registered for the fetch's lifetime
            if not self._registered(dst):
                keep.append(self.agent.register_memory([(dst.ctypes.data, dst.size, 0, "")],
                                                       "DRAM"))
        local = self.agent.get_xfer_descs([(d.ctypes.data, d.size, 0) for _, d in pieces], "DRAM")
        remote = self.agent.get_xfer_descs([(info["addr"] + off, d.size, 0) for off, d in pieces],
                                           "DRAM")
        handle = self.agent.initialize_xfer("READ", local, remote, self.peers[peer], b"")
        state = self.agent.transfer(handle)
        if state == "ERR":
            raise RuntimeError(f"NIXL READ from peer {peer} failed to start")

        def poll() -> bool:
            st = self.agent.check_xfer_state(handle)
            if st == "ERR":
                raise RuntimeError(f"NIXL READ from peer {peer} failed")
            if st == "DONE":
                self.agent.release_xfer_handle(handle)
                for reg in keep:
                    self.agent.deregister_memory(reg)
                return True
            return False

        return Pending(poll, sum(d.size for _, d in pieces), keep=keep)

    def _registered(self, dst: np.ndarray) -> bool:
        a = dst.ctypes.data
        return any(lo <= a and a + dst.size <= lo + n for lo, n in self.spans.values())

    def serve(self, src: int, msg: dict) -> None:
        raise RuntimeError("NIXL transport got an MPI data request")

    def progress(self) -> None:
        # Over TCP, UCX emulates one-sided READs with active messages: the holder's worker
        # must be progressed too, and polling notifications does that.
        self.agent.get_new_notifs()

    def close(self) -> None:
        for key in list(self.regs):
            self.withdraw(key)


def make_transport(kind: str, comm, node_index: int):
    """`nixl` (falls back to MPI when NIXL cannot start) or `mpi`."""
    if kind == "nixl":
        os.environ.setdefault("UCX_MODULES", "^ib,rdmacm")
        try:
            return NIXLTransport(comm, node_index)
        except Exception as e:  # noqa: BLE001 - any NIXL/UCX start failure means: use MPI
            reason = f"{type(e).__name__}: {e}"
            log.warning("NIXL unavailable (%s); GPS uses the MPI transport", reason)
            return MPITransport(comm, fallback=reason)
    if kind != "mpi":
        raise ValueError(f"unknown GPS transport {kind!r} (nixl or mpi)")
    return MPITransport(comm)
