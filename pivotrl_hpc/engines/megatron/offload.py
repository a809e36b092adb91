"""Offload / reload of the trainer's stateful context for shift down / shift up (paper §5.2).

Offloadable context of the training role: optimizer state (exp_avg, exp_avg_sq, step), the
gradient buffers, fp32 main params of a mixed-precision optimizer and (optionally) the model
params themselves. Each is moved at storage level:

- copy the storage's bytes to a host buffer (pinned on GPU, so the copy is a DMA and can run
  asynchronously; a plain separate host buffer on CPU),
- shrink the original storage to 0 bytes, which frees the device memory while every tensor,
  view and optimizer/DDP reference to it stays valid,
- on reload, grow the storage back to its size and copy the bytes in.

Working on storages (not tensors) handles views for free: DDP's `main_grad`s are views into one
flat grad buffer per dtype, so that buffer is moved once. Identity is preserved, so no
optimizer or DDP re-wiring is needed, and the round trip is bitwise exact.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterable

import torch

from pivotrl_hpc.engines.host import trim_host_heap

log = logging.getLogger(__name__)

# Order matters: a storage named by two categories is moved once, under the first. Params come
# before main params because a distributed optimizer's fp32 main shards can be views into the
# model's param buffer (then there is no separate main-param memory to report).
CATEGORIES = ("optimizer_state", "params", "main_params", "grads")


@dataclass
class _Parked:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # uint8 host buffer holding the bytes; None = discarded


@dataclass
class OffloadStats:
    seconds: dict[str, float] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)       # device bytes freed / restored
    host_bytes: dict[str, int] = field(default_factory=dict)  # of those, copied via host


def unique_storages(tensors: Iterable[torch.Tensor], seen: set[int]) -> list[torch.UntypedStorage]:
    out = []
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes() == 0 or s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        out.append(s)
    return out


class HostOffloader:
    """Parks storages of named categories in host memory and brings them back."""

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self._parked: dict[str, list[_Parked]] = {}

    @property
    def offloaded(self) -> bool:
        return bool(self._parked)

    def offload(self, groups: dict[str, list[torch.Tensor]],
                keep_resident: Iterable[torch.Tensor] = (),
                discard: Iterable[str] = ()) -> OffloadStats:
        """Move the storages of `groups`, except any shared with `keep_resident` tensors.

        Categories in `discard` are freed without a host copy (stateless context, e.g. params
        that GPS holds): reload() gives them back uninitialised and the caller refills them."""
        if self._parked:
            raise RuntimeError("already offloaded; reload() first")
        stats = OffloadStats()
        seen = {t.untyped_storage().data_ptr() for t in keep_resident}
        # Resolve every category's storages before freeing any, so a storage shared by two
        # categories is counted (and moved) once, in the first category that names it.
        plan = {name: unique_storages(groups.get(name, []), seen) for name in CATEGORIES}
        # Checked before any storage is freed: failing half way would leave the role with
        # part of its state gone and the rest resident.
        fixed = [name for name, storages in plan.items() if any(not s.resizable()
                                                                for s in storages)]
        if fixed:
            raise RuntimeError(f"cannot offload {', '.join(fixed)}: a storage is not "
                               "resizable (one torch.load or from_file made, not the "
                               "allocator); copy such tensors into owned storages first")
        discard = set(discard)
        for name, storages in plan.items():
            t0 = time.perf_counter()
            parked = [self._park(s, copy=name not in discard) for s in storages]
            self._sync()
            for p in parked:
                p.storage.resize_(0)  # the copy above has completed: free the original
            stats.seconds[name] = time.perf_counter() - t0
            stats.bytes[name] = sum(p.nbytes for p in parked)
            stats.host_bytes[name] = sum(p.nbytes for p in parked if p.host is not None)
            self._parked[name] = parked
        self._release_host_memory(stats)
        stats.seconds["total"] = sum(stats.seconds.values())
        log.info("offloaded %.1f MiB in %.3f s", sum(stats.bytes.values()) / 2**20,
                 stats.seconds["total"])
        return stats

    def reload(self) -> OffloadStats:
        if not self._parked:
            raise RuntimeError("nothing is offloaded")
        stats = OffloadStats()
        for name in CATEGORIES:
            parked = self._parked.get(name, [])
            t0 = time.perf_counter()
            for p in parked:
                p.storage.resize_(p.nbytes)
                if p.host is not None:
                    p.storage.copy_(p.host.untyped_storage(), non_blocking=self.pin_memory)
            self._sync()
            stats.seconds[name] = time.perf_counter() - t0
            stats.bytes[name] = sum(p.nbytes for p in parked)
            stats.host_bytes[name] = sum(p.nbytes for p in parked if p.host is not None)
        self._parked = {}  # drop the host buffers (pinned memory goes back to the allocator)
        self._release_host_memory(stats)
        stats.seconds["total"] = sum(stats.seconds.values())
        log.info("reloaded %.1f MiB in %.3f s", sum(stats.bytes.values()) / 2**20,
                 stats.seconds["total"])
        return stats

    def _park(self, storage: torch.UntypedStorage, copy: bool = True) -> _Parked:
        n = storage.nbytes()
        if not copy:
            return _Parked(storage=storage, nbytes=n, host=None)
        host = torch.empty(n, dtype=torch.uint8, device="cpu", pin_memory=self.pin_memory)
        host.untyped_storage().copy_(storage, non_blocking=self.pin_memory)
        return _Parked(storage=storage, nbytes=n, host=host)

    def _release_host_memory(self, stats: OffloadStats) -> None:
        # CPU twin only: the "device" memory just freed is host heap; trimming makes the
        # release visible to the OS (and to the other roles' processes) like a GPU free is.
        if not self.pin_memory:
            t0 = time.perf_counter()
            trim_host_heap()
            stats.seconds["trim"] = time.perf_counter() - t0

    def _sync(self) -> None:
        if self.pin_memory:
            torch.cuda.synchronize()  # non_blocking copies must land before storages change
