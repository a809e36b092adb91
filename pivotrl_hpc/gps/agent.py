"""The GPS node agent: one per node (MPI local rank 0), owner of that node's segments.

Start-up: sweep stale segments of this job on this node, check memory (clear error naming the
bytes needed and available), pick the replication-group size k (appendix B.1), create v0 of
every model and read the owned tensors from the HF safetensors folder in parallel, publish v0
in the control block, exchange NIXL metadata and segment addresses with the other agents.

Then a single-threaded event loop, so no step ever blocks in C for long (a SIGTERM from
`scancel` is handled within one loop turn and removes every segment):

- workers on the node talk to it over a Unix socket (abstract name
  `pivotrl-u<uid>-<job>-<node>-<token>`, the token random per agent and published only in the
  control file of the user's 0700 folder, so no other account can predict and squat it;
  newline-delimited JSON; see client.py for the requests). Reads need no message at all:
  workers map the published version directly (control.py).
- agents talk to each other over an MPI communicator (one rank per node, tag CTRL_TAG):
  `segment` (address of a new version's segment), `have` (byte ranges a node's writers wrote),
  `holds` (pieces of a version being replicated that a node now holds, to the next node of its
  chain), `published`, `released` (versions no reader of a node pins any more),
  `write_failed`, `bye`, and the MPI transport's `mpi_get` / `mpi_nack`.

What moves between nodes (a Write's replication, the remote part of a hybrid-layout Read) is
replication.py; old versions are retired by `_collect` (store.py says how).

Signals: the agent installs its SIGTERM/SIGINT/SIGHUP handlers only on the main thread (Python
runs handlers there only). Hosted in a thread (launch/entry.py), the host's main thread owns
the signals and calls `close()`; `atexit` covers a host that simply returns.
"""
from __future__ import annotations

import atexit
import logging
import os
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pivotrl_hpc.gps import control, shmdir
from pivotrl_hpc.gps.conns import ClientListener, Conn
from pivotrl_hpc.gps.fetch import ReadFetch
from pivotrl_hpc.gps.layout import choose_group_size
from pivotrl_hpc.gps.plan import LinkModel, PlanCache, merge_ranges
from pivotrl_hpc.gps.replication import Transfers, _Write
from pivotrl_hpc.gps.hf import hf_header, load_into
from pivotrl_hpc.gps.segment import (SHM_DIR, check_memory, memory_available, segment_prefix,
                                     sweep)
from pivotrl_hpc.gps.store import ModelStore
from pivotrl_hpc.gps.transport import CTRL_TAG, PEER_WIRE, make_transport
from pivotrl_hpc.protocol import mpi

log = logging.getLogger(__name__)


def socket_address(job: str, node: str, token: str) -> str:
    """The agent's abstract socket name: the uid (two users' jobs never collide) and the
    agent's random token (nobody outside the user's folder can know the name in advance)."""
    return f"\0pivotrl-u{os.getuid()}-{segment_prefix(job, node)}{token}"


def new_token() -> str:
    return secrets.token_hex(8)


def control_path(job: str, node: str) -> Path:
    return SHM_DIR / (segment_prefix(job, node) + "ctl")


@dataclass(frozen=True)
class AgentConfig:
    job: str
    node: str
    models: dict[str, str]  # model name -> HF safetensors folder
    budget_bytes: int | None = None  # per-node GPS budget; None = what shm/host memory allow
    transport: str = "nixl"
    links: LinkModel = field(default_factory=LinkModel)
    load_threads: int = 4
    # model -> the version its folder is loaded as (a resumed job: the checkpoint's policy
    # version, so versions keep counting the trained steps); 0 when absent
    first_versions: dict[str, int] = field(default_factory=dict)
    # a Write's replication (plan.chain): piece size (None: plan.chunk_size from `links`),
    # and how long a node waits on a silent relay before pulling from the writers instead
    chunk_bytes: int | None = None
    relay_wait_s: float = 10.0


class NodeAgent(Transfers):
    def __init__(self, cfg: AgentConfig, comm=None):
        self.cfg, self.comm = cfg, comm
        self.index = comm.rank if comm is not None else 0
        self.n_nodes = comm.size if comm is not None else 1
        self.stores: dict[str, ModelStore] = {}
        self.writes: dict[tuple[str, int], _Write] = {}
        self.seg_info: dict[tuple[int, str, int], dict] = {}
        self.plans = PlanCache()
        self.ctl: control.ControlBlock | None = None
        self.transport = None
        self.clients: ClientListener | None = None
        self._fetches: list[ReadFetch] = []
        # (model, version) -> nodes whose readers released it (hybrid layout, store.collect)
        self._released: dict[tuple[str, int], set[int]] = {}
        self.replications: dict[str, dict] = {}   # model -> how its last Write came here
        self._byes: set[int] = set()
        self._stopping = False
        self._shm_hold: int | None = None
        self.token = new_token()
        self.closed = False

    # ---- start-up -------------------------------------------------------------------------
    def start(self) -> None:
        self._shm_hold = shmdir.hold()   # this user's 0700 folder, or a clear refusal
        sweep(self.cfg.job, self.cfg.node)
        # also when the hosting process ends without serve_forever's cleanup (an exception,
        # or the agent in a daemon thread of a process that simply returns)
        atexit.register(self.close)
        budget = self.cfg.budget_bytes or int(min(memory_available()) * 0.9)
        headers = {m: hf_header(Path(f), {})[0] for m, f in self.cfg.models.items()}
        sizes = [[t.nbytes for t in h.tensors.values()] for h in headers.values()]
        group_size = choose_group_size(sizes, self.n_nodes, budget)
        for m, f in self.cfg.models.items():
            self.stores[m] = ModelStore.from_folder(m, Path(f), self.cfg.job, self.cfg.node,
                                                    self.index, self.n_nodes, group_size)
        need = sum(s.owned_bytes() for s in self.stores.values())
        need += max(s.owned_bytes() for s in self.stores.values())  # one Write in flight
        check_memory(need, f"{len(self.stores)} models on node {self.cfg.node} "
                           f"(group size {group_size})")
        self._install_signals()
        first = {m: self.cfg.first_versions.get(m, 0) for m in self.stores}
        for store in self.stores.values():
            seg = store.new_version(first[store.model])
            n = load_into(seg, store.source, store.owned_names, self.cfg.load_threads)
            log.info("GPS %s v%d on %s: %d bytes loaded (group size %d)", store.model,
                     first[store.model], self.cfg.node, n, group_size)
        if self.comm is not None:
            self.transport = make_transport(self.cfg.transport, self.comm, self.index)
            log.info("GPS agent %s: %s transport", self.cfg.node, self.transport.name)
            mine = {m: self._expose(m, first[m]) for m in self.stores}
            for node, infos in enumerate(mpi.allgather(self.comm, PEER_WIRE, mine)):
                for m, info in infos.items():
                    self.seg_info[(node, m, first[m])] = info
                    if node != self.index:
                        self.transport.learn(node, info)
        self._listen()
        # The control block appears last: a client that finds it finds a served first version.
        self.ctl = control.ControlBlock(control_path(self.cfg.job, self.cfg.node), create=True,
                                        group_size=group_size, token=self.token,
                                        dir_fd=self._shm_hold)
        for store in self.stores.values():
            store.publish(self.ctl, first[store.model])

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.closed:   # a second signal while the first one's close runs: let it finish
            return
        log.warning("GPS agent on %s got signal %d: removing segments", self.cfg.node, signum)
        self.close()
        os._exit(128 + signum)  # no MPI_Finalize: the other ranks are being killed too

    def _listen(self) -> None:
        self.clients = ClientListener(socket_address(self.cfg.job, self.cfg.node, self.token),
                                    token=self.token)

    def _expose(self, model: str, version: int) -> dict:
        seg = self.stores[model].versions[version]
        return self.transport.expose((model, version), seg._u8)

    # ---- event loop -----------------------------------------------------------------------
    def serve_forever(self, busy_s: float = 0.002, idle_s: float = 0.02) -> None:
        """Poll at `busy_s` while anything moves, backing off to `idle_s` when idle: the
        agent shares its node with capped devices, and an MPI probe every 2 ms cost ~half a
        core. Clients wake it at once (select); peers' messages wait at most `idle_s`."""
        timeout = busy_s
        try:
            while not self._done():
                timeout = busy_s if self.step(timeout) else min(2 * timeout, idle_s)
        finally:
            self.close()

    def _done(self) -> bool:
        return self._stopping and len(self._byes) >= self.n_nodes and not self._fetches

    def step(self, timeout: float = 0.002) -> bool:
        """One turn of the loop; True when anything happened or is in progress."""
        busy = self._poll_clients(timeout)
        if self.comm is not None:
            busy = self._poll_peers() or busy
            self.transport.progress()
        self._advance_writes()
        self._advance_fetches()
        self._collect()
        return busy or bool(self._fetches) or bool(self.writes)

    def _collect(self) -> None:
        """Retire old versions. Under the hybrid layout on several nodes a version's memory
        stays until every node released it: another node's reader may pin it and fetch this
        node's tensors of it (the NIXL READs are one-sided: this node would never know)."""
        for store in self.stores.values():
            m = store.model
            shared = self.comm is not None and store.ownership.group_size > 1
            freeable = (lambda v, m=m: len(self._released.get((m, v), ())) == self.n_nodes) \
                if shared else None
            released = store.collect(self.ctl, on_retire=lambda v, m=m: self._retire(m, v),
                                     freeable=freeable)
            if shared and released:
                for v in released:
                    self._released.setdefault((m, v), set()).add(self.index)
                self._broadcast({"op": "released", "model": m, "versions": released})

    def _retire(self, model: str, version: int) -> None:
        """Right before a version's memory goes: no more remote access to it."""
        if self.transport is not None:
            self.transport.withdraw((model, version))
        self._released.pop((model, version), None)

    def _poll_clients(self, timeout: float) -> bool:
        return self.clients.poll(timeout, self._handle_client)

    def _reply(self, conn: Conn, msg: dict) -> None:
        self.clients.reply(conn, msg)

    def _poll_peers(self) -> bool:
        from mpi4py import MPI
        status, got = MPI.Status(), False
        while True:
            polled, msg = mpi.try_recv(self.comm, PEER_WIRE, MPI.ANY_SOURCE, CTRL_TAG, status)
            if not polled:
                break
            got, src = True, status.Get_source()
            try:
                self._handle_peer(src, msg)
            except ValueError:  # a report about a version this node already finished
                log.error("peer message %r from agent %d ignored", msg.get("op"), src,
                          exc_info=True)
        return got

    def _broadcast(self, msg: dict) -> None:
        data = PEER_WIRE.encode(msg)
        for node in range(self.n_nodes):
            if node != self.index:
                mpi.send_bytes(self.comm, data, node, CTRL_TAG)

    # ---- requests -------------------------------------------------------------------------
    def _handle_client(self, conn: Conn, msg: dict) -> None:
        op = msg["op"]
        if op == "begin_write":
            w = self._write_for(msg["model"], self._next_version(msg["model"],
                                                                 msg.get("version")))
            self._reply(conn, {"op": "begin_write", "version": w.version,
                               "path": str(self.stores[w.model].versions[w.version].path)})
        elif op == "written":
            w = self._write_for(msg["model"], self._next_version(msg["model"], msg["version"]))
            ranges = [tuple(r) for r in msg["ranges"]]
            w.holders[self.index] = merge_ranges(w.holders.get(self.index, []) + ranges)
            w.nonces[self.index] = w.nonce
            if conn not in w.waiters:
                w.waiters.append(conn)
            if self.comm is not None:
                self._broadcast({"op": "have", "model": w.model, "version": w.version,
                                 "ranges": ranges, "nonce": w.nonce})
            self._reply(conn, {"op": "written", "version": w.version})
        elif op == "fetch":
            self._start_fetch(conn, msg)
        elif op == "ping":
            t = self.transport
            self._reply(conn, {"op": "ping", "node": self.cfg.node, "index": self.index,
                               "n_nodes": self.n_nodes, "transport": t and t.name,
                               "transport_fallback": t and t.fallback})
        elif op == "shutdown":
            self._reply(conn, {"op": "shutdown"})
            self._stopping = True
            self._byes.add(self.index)
            if self.comm is not None:
                self._broadcast({"op": "bye"})
        else:
            self._reply(conn, {"op": "error", "error": f"unknown request {op!r}"})

    def _next_version(self, model: str, version: int | None) -> int | None:
        """A client may name only the next version (or one being written): never a segment
        per number it makes up."""
        store = self.stores[model]
        pending = {v for (m, v) in self.writes if m == model}
        if version is not None and version not in pending and version != (store.current or 0) + 1:
            raise ValueError(f"{model} v{version} cannot be written on {self.cfg.node}: the next "
                             f"version is v{(store.current or 0) + 1}")
        return version

    def _handle_peer(self, src: int, msg: dict) -> None:
        op = msg["op"]
        if op == "segment":
            self.seg_info[(src, msg["model"], msg["version"])] = msg["info"]
            self.transport.learn(src, msg["info"])
        elif op == "have":
            w = self._write_for(msg["model"], msg["version"])
            got = [tuple(r) for r in msg["ranges"]]
            w.holders[src] = merge_ranges(w.holders.get(src, []) + got)
            w.nonces[src] = msg["nonce"]
        elif op == "holds":
            self._on_holds(src, msg)
        elif op == "published":
            w = self._write_for(msg["model"], msg["version"])
            w.published[src] = time.monotonic() - w.t0
            w.sources[src] = msg["from"]
        elif op == "released":
            for v in msg["versions"]:
                self._released.setdefault((msg["model"], v), set()).add(src)
        elif op == "write_failed":
            w = self.writes.get((msg["model"], msg["version"]))
            if w is not None:
                self._fail_write(w, msg["error"], tell_peers=False)
        elif op == "mpi_get":
            self.transport.serve(src, msg)
        elif op == "mpi_nack":
            self.transport.nack(msg)
        elif op == "bye":
            self._byes.add(src)
        else:
            log.error("unknown peer message %r from agent %d", op, src)

    # ---- shutdown -------------------------------------------------------------------------
    def close(self) -> None:
        """Remove every segment of this node (also the control block): idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.ctl is not None:
            self.ctl.mark_closed()  # clients waiting on this node stop at once
        for store in self.stores.values():
            store.close(unlink=True)
        if self._shm_hold is not None:   # never inside a folder that was refused (squatted)
            sweep(self.cfg.job, self.cfg.node)
        if self.ctl is not None:
            self.ctl.close()
        if self.transport is not None:
            try:
                self.transport.close()
            except Exception:  # best effort at exit; segments are gone already
                log.debug("transport close failed", exc_info=True)
        if self.clients is not None:
            self.clients.close()
        if self._shm_hold is not None:
            shmdir.release(self._shm_hold)   # the folder too, when no other agent uses it
            self._shm_hold = None
