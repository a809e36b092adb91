"""GPSClient: what device workers use. Read(M, G, P), Write(M, G, P), pins.

Read needs no message to the agent: the client takes a consistent snapshot of the model's
versions from the control block (seqlock), pins the current version with a shared `flock` on
its segment file, and slices the tensors its place needs straight out of the mapping (one
copy, or zero-copy views while the caller holds the pin); into `buffers()` the copy of a
whole model is one memmove (gps/tensors.py says why that matters). Under the hybrid layout
the tensors this node does not hold are pulled by the agent into a private staging segment
first.

Write sends `begin_write` (the agent answers with the new version's segment), copies this
rank's slices into it, sends `written` with the byte ranges it filled and returns a
`WriteHandle` at once; the handle completes when every node has published the version.

One client per process and thread (its handles: gps.handles); requests over the socket are
answered in order, and the `replicated` notices of writes are kept until their handle asks.

Whom a client trusts (issue 35, docs/security.md): the GPS folder is opened once (O_DIRECTORY |
O_NOFOLLOW, owner and mode checked on the descriptor) and every file is opened in it with
openat and O_NOFOLLOW, a path from a reply only if it is exactly the file the client expects.
The socket's peer must be the job's user (SO_PEERCRED) and the agent process the control file
names (pid and start time, watched through a pidfd). Every request has a deadline
(`request_s`, PIVOTRL_GPS_REQUEST_S); a dead, zombie or stopped agent, a lost connection or
a missed deadline is a GPSUnavailable that says which.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from pivotrl_hpc.gps import control, device, shmdir
from pivotrl_hpc.gps.control import GPSUnavailable
from pivotrl_hpc.gps.agent import control_path
from pivotrl_hpc.gps.channel import REQUEST_S, AgentChannel
from pivotrl_hpc.gps.convert import megatron_shard_to_hf_slices
from pivotrl_hpc.gps.handles import (  # noqa: F401 - GPSWriteError: imported from here too
    FollowWrite, GPSWriteError, Pin, WriteHandle)
from pivotrl_hpc.gps.arch import VOCAB, split_of
from pivotrl_hpc.gps.layout import (ParallelPlace, byte_ranges,
                                    covering_range, hybrid_owner, normalized, pieces, put, take,
                                    target_index)
from pivotrl_hpc.gps.plan import merge_ranges
from pivotrl_hpc.gps.segment import (DTYPES, SHM_DIR, Header, Segment, itemsize, segment_name,
                                     open_own, reserve_file, staging_prefix)
from pivotrl_hpc.gps.shapes import ModelShape
from pivotrl_hpc.gps.tensors import copy_into as _copy
from pivotrl_hpc.gps.tensors import copy_runs, packed, to_megatron

log = logging.getLogger(__name__)

FETCH_FACTOR = 10  # a hybrid Read's fetch moves bytes between nodes: a longer deadline


class GPSClient:
    def __init__(self, job: str, node: str, *, wait_s: float = 60.0,
                 request_s: float = REQUEST_S):
        self.job, self.node, self.request_s = job, node, request_s
        deadline = time.monotonic() + wait_s
        path = control_path(job, node)
        self._dir = -1
        while True:
            try:
                # never trust files in a folder others could write; every file of this
                # client is opened in it by descriptor (openat), never by a path again
                self._dir = shmdir.open_dir(path.parent)
                self.ctl = control.ControlBlock(path, dir_fd=self._dir)
                break
            except (FileNotFoundError, RuntimeError, ValueError):
                if self._dir >= 0:
                    os.close(self._dir)
                    self._dir = -1
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"no GPS node agent for job {job} on {node} ({path})") from None
                time.sleep(0.05)
            except BaseException:
                if self._dir >= 0:
                    os.close(self._dir)
                raise
        self._chan = AgentChannel(job, node, self.ctl, request_s)
        self._headers: dict[str, tuple[Header, ModelShape]] = {}
        self._node_index: int | None = None
        self._maps: dict[tuple[str, int, int], Segment] = {}
        # connected (and registered) from the start: a worker's connection is held before
        # any flood of other local connections can reach the agent's limit (gps/conns.py)
        try:
            self._chan.connect()
        except BaseException:
            self.close()
            raise

    # ---- versions and pins ------------------------------------------------------------------
    def state(self, model: str) -> control.ModelState:
        return self.ctl.state(model)

    def pin(self, model: str, version: int | None = None) -> Pin:
        """Pin `version` (default: the current one) so it is neither freed nor recycled."""
        deadline = time.monotonic() + control.STALL_S
        while True:
            self.ctl.check_agent()
            if time.monotonic() > deadline:
                raise GPSUnavailable(f"{model} v{version}: its segment kept vanishing for "
                                     f"{control.STALL_S:.0f} s on {self.node}")
            st = self.ctl.state(model)
            v = st.current if version is None else version
            if v is None or v not in st.live:
                raise LookupError(f"{model} v{version} is not live on {self.node} "
                                  f"(live: {st.live})")
            path = SHM_DIR / segment_name(self.job, self.node, model, v)
            try:
                fd = open_own(path, os.O_RDONLY, self._dir)   # no symlink, no other user's
            except FileNotFoundError:
                time.sleep(0.001)
                continue  # retired between the snapshot and the open: take a new snapshot
            try:
                control.lock_shared(fd)
                live = self.ctl.state(model).live
                if v in live:
                    return Pin(model, v, self._mapping(model, v, path, fd, live), fd)
            except BaseException:
                os.close(fd)   # drops the shared lock too: the version can be freed
                raise
            control.unlock(fd)
            os.close(fd)

    def _mapping(self, model: str, v: int, path: Path, fd: int, live) -> Segment:
        """Mappings are kept per (model, version, inode): a worker that Reads the same
        version again copies without re-mapping (page-table setup is a large part of a cold
        Read). Mappings of versions no longer live are dropped at this client's next pin of
        the model (or `close()`); until then a retired, unlinked version stays mapped here."""
        for key in [k for k in self._maps if k[0] == model and k[1] not in live]:
            self._maps.pop(key).close()
        key = (model, v, os.fstat(fd).st_ino)
        seg = self._maps.get(key)
        if seg is None:
            seg = self._maps[key] = Segment.attach(path, fd=fd,
                                                   populate=self.ctl.group_size == 1)
        return seg

    def wait_version(self, model: str, version: int, timeout: float = 60.0) -> int:
        deadline, check = time.monotonic() + timeout, 0.0
        while (cur := self.ctl.state(model).current) is None or cur < version:
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"{model} v{version} not published on {self.node}")
            if now - check > control.CHECK_EVERY_S:
                check = now
                self.ctl.check_agent()
            time.sleep(0.002)
        return cur

    def shape(self, model: str, seg: Segment | None = None) -> ModelShape:
        """The model's shape, from the HF config stored in its segments' metadata."""
        if model not in self._headers:
            if seg is None:
                with self.pin(model) as p:
                    return self.shape(model, p.segment)
            cfg = json.loads(seg.header.metadata["config"])
            self._headers[model] = (seg.header, ModelShape.from_hf_config(cfg))
        return self._headers[model][1]

    # ---- Read ------------------------------------------------------------------------------
    def read(self, model: str, place: ParallelPlace = ParallelPlace(), version: int | None = None,
             *, layout: str = "hf", copy: bool = True, out: Mapping[str, Tensor] | None = None,
             pin: Pin | None = None, padded_vocab_size: int | None = None) -> dict[str, Tensor]:
        """Read(M, G, P): exactly the slices `place` needs, HF names (`layout="hf"`, what vLLM
        loads) or this TP rank's Megatron shard (`layout="megatron"`).

        `copy=False` returns zero-copy views, valid while the caller holds `pin`; `out`
        receives the slices in preallocated tensors (e.g. an engine's own parameters).
        """
        if layout not in ("hf", "megatron"):
            raise ValueError(f"unknown layout {layout!r} (hf or megatron)")
        if not copy and pin is None:
            raise ValueError("zero-copy reads need a pin held by the caller")
        own_pin = pin is None
        pin = pin or self.pin(model, version)
        try:
            return self._read_pinned(model, pin, place, layout, copy, out, padded_vocab_size)
        finally:
            if own_pin:
                pin.release()

    def buffers(self, model: str, place: ParallelPlace = ParallelPlace(),
                version: int | None = None) -> dict[str, Tensor]:
        """Destinations for `read(model, place, out=...)` (HF layout) that make that Read one
        copy: views of one buffer laid out like the segment's tensors (tensors.packed), for a
        worker that keeps them; one shared storage, so not parameters freed by resizing it."""
        with self.pin(model, version) as pin:
            seg = pin.segment
            wanted = self._wanted(model, seg, place, "hf", None)
            infos = seg.header.tensors
            # meta tensors: no byte read (reading a hybrid segment's holes allocates them)
            like = {n: take(torch.empty(infos[n].shape, dtype=DTYPES[infos[n].dtype],
                                        device="meta"), idx) for n, idx in wanted.items()}
            at = {n: seg.tensor(n)[pieces(idx)[0]].data_ptr() for n, idx in wanted.items()}
            return packed(like, at)

    def _wanted(self, model, seg, place, layout, padded_vocab_size) -> dict:
        """name -> the index of that tensor `place` needs, in the segment's data order."""
        shape = self.shape(model, seg)
        wanted = {}
        for name, info in seg.header.tensors.items():
            idx = target_index(name, info.shape, shape, place)
            if layout == "megatron" and split_of(name, info.shape, shape).kind == VOCAB:
                # Megatron's split of its padded vocabulary, not vLLM's (padded to 64)
                padded = padded_vocab_size or -(-info.shape[0] // place.tp_size) * place.tp_size
                rows = padded // place.tp_size
                idx = (slice(min(place.tp_rank * rows, info.shape[0]),
                             min((place.tp_rank + 1) * rows, info.shape[0])), slice(None))
            if idx is not None:
                wanted[name] = idx
        return wanted

    def _read_pinned(self, model, pin, place, layout, copy, out, padded_vocab_size):
        seg = pin.segment
        shape = self.shape(model, seg)
        wanted = self._wanted(model, seg, place, layout, padded_vocab_size)
        sources = self._remote_sources(model, pin, wanted) if self.ctl.group_size > 1 else {}
        to_device = out is not None and device.on_device(out.values())
        if to_device:
            seg.register_device(writable=False)   # kept with the mapping: once per version
        res: dict[str, Tensor] = {}
        pairs = []   # (destination, source view): copied together, back-to-back runs joined
        for name, idx in wanted.items():
            src = sources.get(name)
            view = take(seg.tensor(name), idx) if src is None else src
            if out is not None and name in out:
                res[name] = out[name]
            elif copy or src is not None:
                # torch-allocated: consumers may free parameters by resizing storages to 0
                res[name] = torch.empty(view.shape, dtype=view.dtype)
            else:
                res[name] = view
                continue
            pairs.append((res[name], view))
        copy_runs(pairs)
        device.synchronize(to_device)   # the bytes are copied before the pin is released
        if layout == "megatron":
            return to_megatron(res, shape, place, padded_vocab_size)
        return res

    def _remote_sources(self, model: str, pin: Pin, wanted: dict) -> dict[str, Tensor]:
        """Hybrid layout: have the agent pull the tensors this node lacks into staging."""
        infos = pin.segment.header.tensors
        group_size = self.ctl.group_size
        mine = self._ping()["index"] % group_size
        owner = hybrid_owner(list(infos.values()), group_size)
        remote = {n: covering_range(infos[n], idx, itemsize(infos[n].dtype))
                  for n, idx in wanted.items() if owner[n] != mine}
        items = merge_ranges([r for r in remote.values() if r[1] > r[0]])
        if not items:
            return {}
        total = sum(b - a for a, b in items)
        # O_EXCL | O_NOFOLLOW and a random name: a planted file or symlink is never opened
        stage = SHM_DIR / (f"{staging_prefix(self.job, self.node)}{os.getpid()}-"
                           f"{secrets.token_hex(8)}")
        fd = os.open(stage.name, os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_RDWR, 0o600,
                     dir_fd=self._dir)
        try:
            reserve_file(fd, stage, 0, total)   # sizes it; a full shm: GPSMemoryError, no SIGBUS
            self._request({"op": "fetch", "model": model, "version": pin.version,
                           "items": items, "dest": str(stage)}, "fetched",
                          self.request_s * FETCH_FACTOR)
            raw = torch.frombuffer(bytearray(os.pread(fd, total, 0)), dtype=torch.uint8)
        finally:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stage.name, dir_fd=self._dir)
        starts, pos = [], 0
        for a, b in items:
            starts.append((a, pos))
            pos += b - a
        out = {}
        for name, (lo, hi) in remote.items():
            a, base = max((x for x in starts if x[0] <= lo), default=(lo, 0))
            info = infos[name]
            row_bytes = info.nbytes // info.shape[0]
            r0 = (lo - info.start) // row_bytes
            rows = raw[base + lo - a: base + hi - a].view(DTYPES[info.dtype])
            rows = rows.view(-1, *info.shape[1:])
            out[name] = take(rows, normalized(wanted[name], info.shape, r0))
        return out

    # ---- Write -----------------------------------------------------------------------------
    def write(self, model: str, shard: Mapping[str, Tensor], place: ParallelPlace,
              *, layout: str = "megatron", follow: int | None = None
              ) -> WriteHandle | FollowWrite:
        """Write(M, G, P): this rank's shard into the next version; returns at memory speed.

        `layout="megatron"`: a Megatron-Core state-dict shard of TP rank `place.tp_rank`;
        `layout="hf"`: HF-named tensors sliced as `read` returns them for `place`. Only DP
        rank 0 writes (DP replicas hold the same weights); another rank gets a done handle,
        or with `follow` (the version rank 0 writes) a handle that waits for it on this node.
        """
        if place.dp_rank != 0:
            if follow is not None:
                return FollowWrite(self, model, follow)
            return WriteHandle(None, model, -1, True)
        shape = self.shape(model)
        if layout == "megatron":
            slices = megatron_shard_to_hf_slices(shard, shape, place.tp_rank, place.tp_size)
        elif layout == "hf":
            dims = {n: i.shape for n, i in self._headers[model][0].tensors.items()}
            slices = [(n, target_index(n, dims[n], shape, place), t) for n, t in shard.items()]
        else:
            raise ValueError(f"unknown layout {layout!r} (hf or megatron)")
        reply = self._request({"op": "begin_write", "model": model}, "begin_write")
        version, path = reply["version"], self._expected(reply, model)
        fd = open_own(path, os.O_RDWR, self._dir)
        try:
            seg = Segment.attach(path, fd=fd, writable=True,
                                 populate=self.ctl.group_size == 1)
            try:
                infos = seg.header.tensors
                ranges = merge_ranges([r for name, index, _ in slices for r in byte_ranges(
                    infos[name], index, itemsize(infos[name].dtype))])
                if self.ctl.group_size > 1:
                    # The agent reserved only this node's own tensors (hybrid layout); the
                    # rest of this shard stays until every node has the version. Reserve it
                    # now: a full /dev/shm fails here with the figure, not with a SIGBUS.
                    seg.reserve(fd, ranges)
                to_device = device.on_device(t for _, _, t in slices)
                if to_device:
                    seg.register_device(writable=True)
                for name, index, values in slices:
                    put(seg.tensor(name), index, values, _copy)
                device.synchronize(to_device)   # landed before `written` is sent
            finally:
                seg.close()
        finally:
            os.close(fd)
        self._request({"op": "written", "model": model, "version": version,
                       "ranges": ranges}, "written")
        return WriteHandle(self._chan, model, version)

    def _expected(self, reply: dict, model: str) -> Path:
        """The segment a `begin_write` reply names, if it is exactly this model's next
        version in this job's folder; a reply naming any other file is refused."""
        version = reply.get("version")
        if type(version) is not int or version < 0:
            raise GPSUnavailable(f"GPS agent of {self.job} on {self.node}: bad version "
                                 f"{version!r} in its begin_write reply")
        path = SHM_DIR / segment_name(self.job, self.node, model, version)
        if reply.get("path") != str(path):
            raise GPSUnavailable(f"GPS agent of {self.job} on {self.node} named "
                                 f"{reply.get('path')!r} for {model} v{version}, not {path}: "
                                 "refused (a reply's file must be the job's own segment)")
        return path

    # ---- the agent ----------------------------------------------------------------------------
    def _request(self, msg: dict, expect: str, timeout: float | None = None) -> dict:
        return self._chan.request(msg, expect, timeout)

    def _ping(self) -> dict:
        if self._node_index is None:
            self._node_index = self.info()["index"]
        return {"index": self._node_index}

    def info(self) -> dict:
        """The agent's node, index, n_nodes, the transport that runs between agents (None on
        one node) and why NIXL was not used (`transport_fallback`), if it was asked for."""
        return self._request({"op": "ping"}, "ping")

    def sync(self) -> None:
        """Return once the agent has finished a whole loop turn (collection of unpinned
        versions included) begun after this call: two round trips."""
        self.info()
        self.info()

    def shutdown_agent(self) -> None:
        """Ask this node's agent to leave its loop once every agent has been asked."""
        self._request({"op": "shutdown"}, "shutdown")

    def close(self) -> None:
        for seg in self._maps.values():
            seg.close()
        self._maps.clear()
        self._chan.close()
        self.ctl.close()
        if self._dir >= 0:
            os.close(self._dir)
            self._dir = -1
