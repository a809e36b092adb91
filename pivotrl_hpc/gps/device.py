"""Reads into and Writes from accelerator memory: the CUDA path of GPS and its CPU twin.

A GPU worker Reads a version straight into its engine's CUDA parameters and Writes its
trainer's CUDA shard straight into the next version's segment. A copy between device memory
and *pageable* host memory is staged by the driver through its own small pinned buffers; the
segment mapping is instead registered with `cudaHostRegister` (page-locked in place), so each
tensor's copy is one DMA at PCIe rate, with no staging copy and no pinned buffer of the model's
size. A Read's mapping is kept by the client per version, so its registration is paid once
per mapping, not per Read. Copies are issued `non_blocking` and `synchronize` ends them before
the pin that guards the bytes is released.

On a CPU-only machine (and for CPU tensors) every function here is a no-op: the copies stay
glibc memmoves (tensors.copy_into).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from pivotrl_hpc import envs

log = logging.getLogger(__name__)

# cudaHostRegister flags (cuda_runtime_api.h)
REGISTER_DEFAULT = 0x00
REGISTER_READ_ONLY = 0x08   # a PROT_READ mapping: the device only reads it
ENV_DISABLE = envs.GPS_NO_REGISTER.name   # "1": copy through pageable memory (for comparison)


def on_device(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether any of `tensors` lives in accelerator memory."""
    return any(t.device.type == "cuda" for t in tensors)


def enabled() -> bool:
    return not envs.GPS_NO_REGISTER.get() and torch.cuda.is_available()


def _call(name: str, *args) -> int:
    """A CUDA runtime call through torch's bindings, or cuda-python's if torch has none."""
    cudart = torch.cuda.cudart()
    fn = getattr(cudart, name, None)
    if fn is not None:
        return int(fn(*args))
    from cuda.bindings import runtime   # cuda-python: the same runtime call
    err = getattr(runtime, name)(*args)
    return int(err[0] if isinstance(err, tuple) else err)


def register(address: int, nbytes: int, *, writable: bool) -> bool:
    """Page-lock [address, address + nbytes) for DMA. False (and a warning) when the driver
    refuses: the copies then go through pageable memory, slower but correct."""
    if not enabled() or nbytes == 0:
        return False
    flags = REGISTER_DEFAULT if writable else REGISTER_READ_ONLY
    err = _call("cudaHostRegister", address, nbytes, flags)
    if err != 0:
        log.warning("cudaHostRegister of %.1f MiB failed (cudaError %d): GPS copies to the "
                    "device go through pageable memory", nbytes / 2**20, err)
        return False
    return True


def unregister(address: int) -> None:
    err = _call("cudaHostUnregister", address)
    if err != 0:
        log.warning("cudaHostUnregister failed (cudaError %d)", err)


def synchronize(used: bool) -> None:
    """Wait for the `non_blocking` copies of one Read or Write (before its pin is released
    or its mapping is closed)."""
    if used:
        torch.cuda.synchronize()
