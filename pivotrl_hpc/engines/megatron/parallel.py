"""Device support and process groups for the Megatron-Core training engine.

One helper decides between the GPU path (stock Megatron-Core, NCCL) and the CPU twin (gloo,
plus the CPU shim); everything else in the engine asks `device()` / `device_scope()` and
never looks at CUDA itself. Process groups are created once and kept across role shifts
(paper §5.2: communication groups are preserved context).
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
from dataclasses import dataclass
from typing import ContextManager

import torch
import torch.distributed as dist

from pivotrl_hpc import envs
from pivotrl_hpc.engines.megatron import cpu_shim

log = logging.getLogger(__name__)


def ensure_device_support() -> torch.device:
    """Return the device training runs on; install the CPU shim only when CUDA is absent."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    cpu_shim.apply_cpu_shim()
    return torch.device("cpu")


def on_gpu() -> bool:
    return torch.cuda.is_available()


def device_scope() -> ContextManager[None]:
    """The scope to open around Megatron calls: the shim's device scope on CPU, nothing on GPU."""
    if on_gpu():
        return contextlib.nullcontext()
    return cpu_shim.cpu_device_scope()


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    rank: int
    tp_size: int
    tp_rank: int
    dp_size: int
    dp_rank: int


def single_process_world() -> None:
    """The env vars of a one-rank torch world (benchmarks and checks that run a trainer in
    the calling process); variables already set are kept. It meets through an in-process
    store: no port is listened on."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)


def init_distributed(timeout_s: float = 300.0) -> None:
    """Join the default process group: rank and size from RANK and WORLD_SIZE; it meets
    through the job's FileStore (PIVOTRL_TRAIN_STORE, in a 0700 folder of the user's, made by
    the launcher), in process for a one-rank world, else through MASTER_ADDR/MASTER_PORT (a
    test's own world). A FileStore keeps another account from taking the rendezvous first,
    as a TCPStore on a known port would let it (bind it first, or connect and read or write
    the keys).

    NCCL on GPU (each rank binds LOCAL_RANK's device first), gloo on CPU. A group that the
    caller (e.g. the device worker) already created is reused.
    """
    ensure_device_support()
    if on_gpu():
        # Bind the device before any CUDA allocation, also when the group already exists.
        torch.cuda.set_device(envs.LOCAL_RANK.get())
    if dist.is_initialized():
        return
    backend = "nccl" if on_gpu() else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    store = job_store(envs.WORLD_SIZE.get())
    if store is None:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, store=store, rank=envs.RANK.get(),
                                world_size=envs.WORLD_SIZE.get(), timeout=timeout)
    log.info("process group up: backend=%s rank=%d world=%d", backend, dist.get_rank(),
             dist.get_world_size())


_STORE_DIR_FD: list[int] = []   # the store's checked folder, open while the process lives


def job_store(world_size: int):
    """The training world's store: the launcher's FileStore (opened through a descriptor of
    its folder, checked to be a 0700 folder of this user, so the folder cannot be swapped
    after the check), a HashStore for a one-rank world, else None (env://)."""
    path = envs.TRAIN_STORE.raw()
    if path is None:
        return dist.HashStore() if world_size == 1 and not envs.MASTER_PORT.is_set() else None
    folder = os.path.dirname(path)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        os.close(fd)
        raise PermissionError(f"{envs.TRAIN_STORE.name}: {folder} is a folder of uid "
                              f"{st.st_uid} with mode {st.st_mode & 0o7777:o}, not a 0700 "
                              f"folder of uid {os.getuid()}: the training world will not "
                              "meet there")
    _STORE_DIR_FD.append(fd)
    return dist.FileStore(f"/proc/self/fd/{fd}/{os.path.basename(path)}", world_size)


def initialize_model_parallel(tp_size: int, seed: int = 1234) -> ParallelLayout:
    """Create Megatron's TP/DP groups (idempotent for the same TP size) and seed its RNGs."""
    from megatron.core import parallel_state, tensor_parallel

    init_distributed()
    if parallel_state.model_parallel_is_initialized():
        current = parallel_state.get_tensor_model_parallel_world_size()
        if current != tp_size:
            raise RuntimeError(f"model parallel already initialised with TP={current}, "
                               f"asked for TP={tp_size}")
    else:
        world = dist.get_world_size()
        if world % tp_size:
            raise ValueError(f"world size {world} is not divisible by TP={tp_size}")
        with device_scope():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    with device_scope():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return current_layout()


def current_layout() -> ParallelLayout:
    from megatron.core import parallel_state as ps

    return ParallelLayout(
        world_size=dist.get_world_size(), rank=dist.get_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank(),
    )


def destroy_model_parallel() -> None:
    """Tear down Megatron's groups and the default group (end of job, not a role shift)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
