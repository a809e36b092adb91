"""What a node agent moves between nodes: the replication of Writes and the remote part of
hybrid-layout Reads (the NodeAgent's transfer half; agent.py holds the loop and requests).

Write of version v: writers fill the new segment on their node and report the ranges (`have`,
with their attempt's nonce); once the union of all nodes' ranges covers the model, every agent
plans the same pipelined chains (plan.chain) and pulls what it lacks, piece by piece, from the
node before it in its line (relay.py), telling the node after it of every piece it now holds
(`holds`, tagged with the attempt, so that a failed attempt's messages never count for the next
one). A node publishes v only once it holds all of it, then tells the others; when every node
has, the writers' handles complete. A relay that fails is replaced by the writers (relay.py); a
transfer from a writer that keeps failing fails the Write on every node (`write_failed` to its
writers), or the one Read it served.

`Transfers` is a mixin of `NodeAgent`: it uses the agent's `cfg`, `comm`, `index`, `n_nodes`,
`stores`, `writes`, `seg_info`, `plans`, `ctl`, `transport`, `_fetches`, `_released`,
`replications`, `_broadcast`, `_expose`, `_retire` and `_reply`.
"""
from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field

from pivotrl_hpc.gps import control
from pivotrl_hpc.gps.conns import Conn
from pivotrl_hpc.gps.fetch import Pull, ReadFetch, TransferError, all_done, staging_file
from pivotrl_hpc.gps.plan import Range, Transfer, assign, chain, merge_ranges, refine
from pivotrl_hpc.gps.relay import Relay
from pivotrl_hpc.gps.segment import RawMap
from pivotrl_hpc.gps.store import ModelStore
from pivotrl_hpc.gps.transport import CTRL_TAG, PEER_WIRE
from pivotrl_hpc.protocol import mpi

log = logging.getLogger(__name__)


@dataclass
class _Write:
    model: str
    version: int
    holders: dict[int, list[Range]] = field(default_factory=dict)
    # this node's writers' attempt (a failed Write's number is written again), and every
    # writer node's: together they name the attempt the chain's `holds` messages belong to
    nonce: str = field(default_factory=lambda: secrets.token_hex(4))
    nonces: dict[int, str] = field(default_factory=dict)
    relay: Relay | None = None
    # attempt -> node -> pieces it announced (`holds`) / when it last did
    announced: dict[str, dict[int, set[Range]]] = field(default_factory=dict)
    heard: dict[str, dict[int, float]] = field(default_factory=dict)
    # node index -> bytes it pulled from each node (its `published` message)
    sources: dict[int, dict[str, int]] = field(default_factory=dict)
    # node index -> seconds from this agent's first sight of the Write to its publication
    published: dict[int, float] = field(default_factory=dict)
    waiters: list[Conn] = field(default_factory=list)
    deferred: bool = False
    t0: float = field(default_factory=time.monotonic)

    @property
    def attempt(self) -> str:
        return ",".join(f"{n}:{x}" for n, x in sorted(self.nonces.items()))


def _data_len(store: ModelStore) -> int:
    return store.header.total_bytes - store.header.data_start


class Transfers:
    def _write_for(self, model: str, version: int | None) -> _Write:
        store = self.stores[model]
        if version is None:  # the pending write of this model, or the next version
            pending = [w for (m, _), w in self.writes.items()
                       if m == model and self.index not in w.published]
            version = pending[0].version if pending else (store.current or 0) + 1
        w = self.writes.get((model, version))
        if w is None and store.current is not None and version <= store.current:
            raise ValueError(f"{model} v{version} is already published on {self.cfg.node}; "
                             f"one Write per model at a time, each after the previous completed")
        if w is None:
            store.new_version(version)   # first: a GPSMemoryError leaves no Write behind
            w = self.writes[(model, version)] = _Write(model, version)
            if self.comm is not None:
                info = self._expose(model, version)
                self._broadcast({"op": "segment", "model": model, "version": version,
                                 "info": info})
        return w

    # ---- replication of a Write --------------------------------------------------------------
    def _advance_writes(self) -> None:
        for key, w in list(self.writes.items()):
            store = self.stores[w.model]
            if w.relay is None and self._covered(w):
                w.relay = self._replicate(w)
            try:
                pulled = w.relay is not None and self._relay_step(w)
            except TransferError as e:
                self._fail_write(w, str(e), tell_peers=True)
                continue
            if pulled and self.index not in w.published and self._room(store, w):
                store.publish(self.ctl, w.version)
                w.published[self.index] = time.monotonic() - w.t0
                stats = self.replications[w.model] = {"version": w.version,
                                                      **w.relay.stats()}
                w.sources[self.index] = stats["bytes_from"]
                if self.comm is not None:
                    self._broadcast({"op": "published", "model": w.model, "version": w.version,
                                     "from": stats["bytes_from"]})
                log.info("GPS %s v%d published on %s: bytes from nodes %s in %d steps%s",
                         w.model, w.version, self.cfg.node, stats["bytes_from"],
                         stats["steps"], f", relays dropped {stats['dropped']}"
                         if stats["dropped"] else "")
            if len(w.published) == self.n_nodes:
                store.drop_unowned(w.version)
                done = {"op": "replicated", "model": w.model, "version": w.version,
                        "bytes": _data_len(store),
                        "published_s": {str(n): s for n, s in sorted(w.published.items())},
                        "sources": {str(n): s for n, s in sorted(w.sources.items())}}
                for conn in w.waiters:
                    self._reply(conn, done)
                del self.writes[key]

    def _fail_write(self, w: _Write, error: str, tell_peers: bool) -> None:
        """A Write that cannot be replicated: its writers' handles raise with `error`; a node
        that had not published it drops the version (its next Write reuses the number)."""
        log.error("GPS %s v%d failed on %s: %s", w.model, w.version, self.cfg.node, error)
        if tell_peers and self.comm is not None:
            self._broadcast({"op": "write_failed", "model": w.model, "version": w.version,
                             "error": error})
        store = self.stores[w.model]
        if self.index not in w.published and w.version in store.versions:
            self._retire(w.model, w.version)
            store.drop(w.version)
            if store.ownership.group_size > 1:  # nodes that published it may free it when done
                self._released.setdefault((w.model, w.version), set()).add(self.index)
                self._broadcast({"op": "released", "model": w.model, "versions": [w.version]})
        for conn in w.waiters:
            self._reply(conn, {"op": "write_failed", "model": w.model, "version": w.version,
                               "error": error})
        del self.writes[(w.model, w.version)]

    def _room(self, store: ModelStore, w: _Write) -> bool:
        """A free live slot in the control block; else wait until a reader releases a pin."""
        if len(store.live()) < control.MAX_LIVE:
            return True
        if not w.deferred:
            w.deferred = True
            log.warning("GPS %s v%d waits on %s: %d older versions are pinned by readers",
                        w.model, w.version, self.cfg.node, len(store.live()))
        return False

    def _covered(self, w: _Write) -> bool:
        data_len = _data_len(self.stores[w.model])
        union = merge_ranges([r for rs in w.holders.values() for r in rs])
        return union == [(0, data_len)]

    def _replicate(self, w: _Write) -> Relay:
        """Plan this version's chains (every node plans the same) and this node's part."""
        store = self.stores[w.model]
        holders = {n: list(rs) for n, rs in sorted(w.holders.items())}
        signature = ("write", w.model, tuple((n, tuple(rs)) for n, rs in holders.items()),
                     self.n_nodes, store.ownership.group_size, self.cfg.chunk_bytes)

        def build():
            targets = {n: store.owned_ranges(n) for n in range(self.n_nodes)}
            return chain(holders, targets, self.cfg.links, self.cfg.chunk_bytes)

        plan = self.plans.get(signature, build)
        seg = store.versions[w.version]

        def start(src: int, transfers: list[Transfer]) -> Pull:
            [pull] = self._pull(w.model, w.version, transfers,
                                lambda a, b: seg.bytes_view(a, b), seg.header.data_start)
            return pull
        return Relay(plan, self.index, holders, start, w.announced.setdefault(w.attempt, {}),
                     w.heard.setdefault(w.attempt, {}), self.cfg.relay_wait_s, time.monotonic())

    def _relay_step(self, w: _Write) -> bool:
        """Advance this node's pulls, tell the next nodes what it now holds; True when done."""
        got = w.relay.advance(time.monotonic())
        for node, ranges in w.relay.tell(got).items():
            mpi.send(self.comm, PEER_WIRE, {"op": "holds", "model": w.model,
                                            "version": w.version, "attempt": w.attempt,
                                            "ranges": ranges}, node, CTRL_TAG)
        return w.relay.done

    def _on_holds(self, src: int, msg: dict) -> None:
        """A node before this one in a chain holds more pieces of a version being written."""
        store = self.stores[msg["model"]]
        if (msg["model"], msg["version"]) not in self.writes and \
                msg["version"] <= (store.current if store.current is not None else -1):
            return   # this node has the version already (it had dropped that relay)
        w = self._write_for(msg["model"], msg["version"])
        w.announced.setdefault(msg["attempt"], {}).setdefault(src, set()).update(
            tuple(r) for r in msg["ranges"])
        w.heard.setdefault(msg["attempt"], {})[src] = time.monotonic()

    def _pull(self, model: str, version: int, transfers, local_view,
              data_start: int) -> list[Pull]:
        by_src: dict[int, list] = {}
        for t in transfers:
            by_src.setdefault(t.src, []).append((data_start + t.start, local_view(t.start, t.stop)))

        def start(src: int, pieces: list):
            return lambda: self.transport.fetch(src, (model, version),
                                                self.seg_info[(src, model, version)], pieces)
        return [Pull(src, sum(d.size for _, d in pieces), start(src, pieces),
                     f"{model} v{version} on {self.cfg.node}")
                for src, pieces in sorted(by_src.items())]

    # ---- remote part of a Read under the hybrid layout --------------------------------------
    def _start_fetch(self, conn: Conn, msg: dict) -> None:
        """Pull `items` (data byte ranges of `version`) into the client's staging segment."""
        model, version = msg["model"], msg["version"]
        store = self.stores[model]
        if version not in store.live():
            raise LookupError(f"{model} v{version} is not live on {self.cfg.node}: pin it "
                              f"before reading (live: {store.live()})")
        dest = RawMap(staging_file(msg["dest"], self.cfg.job, self.cfg.node))
        self._fetches.append(ReadFetch(conn, model, version, [tuple(r) for r in msg["items"]],
                                       dest))

    def _plan_fetch(self, f: ReadFetch) -> list[Pull]:
        store = self.stores[f.model]
        holders = {n: store.owned_ranges(n) for n in range(self.n_nodes)}
        signature = ("read", f.model, tuple(f.items), self.index)
        plan = self.plans.get(signature, lambda: assign(
            refine(holders, {self.index: f.items}), self.cfg.links))
        return self._pull(f.model, f.version, plan, f.view, store.header.data_start) \
            if plan else []

    def _advance_fetches(self) -> None:
        still = []
        for f in self._fetches:
            try:
                if f.pulls is None and (f.model, f.version) not in self.writes:
                    f.pulls = self._plan_fetch(f)  # the version is on its holders now
                if f.pulls is None or not all_done(f.pulls):
                    still.append(f)
                    continue
                reply = {"op": "fetched", "bytes": sum(p.nbytes for p in f.pulls)}
            except TransferError as e:
                log.error("GPS read of %s v%d on %s failed: %s", f.model, f.version,
                          self.cfg.node, e)
                reply = {"op": "error", "error": str(e)}
            f.close()
            self._reply(f.conn, reply)
        self._fetches = still
