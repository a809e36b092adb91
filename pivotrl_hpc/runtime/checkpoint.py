"""A training rank's part of a checkpoint (checkpoint/layout.py says the folder).

- The policy: GPS already holds it canonically (full HF tensors on every node), so the first
  training rank Reads the published version and writes one safetensors file beside the base
  model's config and tokenizer: no gather through rank 0, and the bytes are GPS's own.
- The optimizer: every rank saves its own Megatron optimizer state (fp32 main params of bf16
  params, Adam moments and steps) with its RNG states, all ranks in parallel. On resume the
  params come back from GPS (the checkpoint's policy) and this file refills the optimizer, so
  the fp32 master weights are the saved ones, never re-rounded from bf16. The file is
  safetensors with its structure as JSON (checkpoint.treefile): nothing in a checkpoint is
  unpickled, so one planted by another account cannot run code (issue 46).
- The restored state must shift like any other: the offloader frees a storage by resizing it
  to 0 bytes, and a storage a file loader made may not be resizable (its bytes belong to
  the reader). Every loaded tensor is copied into a fresh storage of this process's allocator
  before the optimizer takes it (Adam's state tensors are the loaded ones themselves; the fp32
  master weights are copied into the trainer's own), so a shift down after a restart frees it
  as before one.
"""
from __future__ import annotations

import logging
import os
import random
import time
from pathlib import Path
from typing import Any

from pivotrl_hpc.checkpoint import treefile
from pivotrl_hpc.checkpoint.folders import file_mode, open_folder, write_at, write_by_path
from pivotrl_hpc.checkpoint.layout import (OPTIM, POLICY, CheckpointError, optim_file,
                                           staging_in)
from pivotrl_hpc.checkpoint.manifest import entry_at
from pivotrl_hpc.gps.layout import ParallelPlace

log = logging.getLogger(__name__)

# Files of a model folder that are not weights: what a loader needs beside model.safetensors.
SKIP = (".safetensors", ".safetensors.index.json", ".bin", ".pt")
WEIGHTS = "model.safetensors"


def train_rank(place: ParallelPlace) -> int:
    return place.dp_rank * place.tp_size + place.tp_rank


def save_policy(store, version: int, folder: Path, base_model: str | Path,
                group_shared: bool = False) -> tuple[int, dict]:
    """The policy `version` (GPS Read, HF layout) as a HuggingFace folder; returns its bytes
    and the manifest entries of its files (checkpoint.manifest)."""
    from safetensors.torch import save_file

    mode = file_mode(group_shared)
    out = open_folder(Path(folder) / POLICY, own=3, create=True, group_shared=group_shared)
    try:
        names = []
        for f in sorted(Path(base_model).iterdir()):
            if f.is_file() and not f.name.endswith(SKIP):
                with open(f, "rb") as src:
                    write_at(out, f.name, src.read(), mode)
                names.append(f.name)
        tensors = store.read("policy", ParallelPlace(), version)
        tensors = {n: t.contiguous() for n, t in tensors.items()}
        write_by_path(out, WEIGHTS, mode, lambda path: save_file(tensors, path, metadata={
            "format": "pt", "pivotrl_version": str(version)}))
        files = {f"{POLICY}/{n}": entry_at(out, n) for n in (*names, WEIGHTS)}
    finally:
        os.close(out)
    return sum(t.numel() * t.element_size() for t in tensors.values()), files


def save_training(trainer, folder: Path, rank: int, group_shared: bool = False) -> dict:
    """This rank's optimizer state, steps done and RNG states; returns the file's manifest
    entry. A tree file (checkpoint.treefile: safetensors + JSON), never a pickle: loading
    one another account planted must not run code."""
    import torch

    path = optim_file(folder, rank)
    state = {"optimizer": trainer.optimizer.state_dict(), "steps_done": trainer.steps_done,
             "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}
    out = open_folder(path.parent, own=3, group_shared=group_shared)
    try:
        write_by_path(out, path.name, file_mode(group_shared),
                      lambda p: treefile.save(state, p))
        return {f"{OPTIM}/{path.name}": entry_at(out, path.name)}
    finally:
        os.close(out)


def load_training(trainer, folder: Path, rank: int) -> None:
    """Refill a freshly built trainer (params already loaded from GPS) from `folder`."""
    import torch

    path = optim_file(folder, rank)
    if not path.is_file():
        raise CheckpointError(f"{path} missing: the checkpoint was made with fewer training "
                              "ranks (roles.train_devices / train_tensor_parallel changed?), "
                              "or by a version that pickled it (rank-N.pt: not loaded, a "
                              "pickle runs code)")
    try:
        state = owned(treefile.load(path, trainer.device))
        python_rng = state["python_rng"]
        trainer.optimizer.load_state_dict(state["optimizer"])
        trainer.steps_done = int(state["steps_done"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(python_rng)
    except (treefile.TreeFileError, KeyError, TypeError, ValueError, IndexError,
            AttributeError, RuntimeError) as e:   # a tree of the wrong shape for this job
        raise CheckpointError(f"{path}: not this job's optimizer state ({e})") from None


def owned(obj: Any) -> Any:
    """`obj` (a loaded state dict) with every tensor copied into a fresh, resizable storage;
    tensors that shared a storage in the file share the copy."""
    import torch

    copies: dict[int, Any] = {}

    def own(t):
        if not isinstance(t, torch.Tensor):
            return t
        src = t.untyped_storage()
        key = src.data_ptr()
        if key not in copies:
            dst = torch.UntypedStorage(src.nbytes(), device=src.device)
            dst.copy_(src)
            copies[key] = dst
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(
            copies[key], t.storage_offset(), t.shape, t.stride()).requires_grad_(t.requires_grad)

    return _map(obj, own)


def _map(obj: Any, fn) -> Any:
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, fn) for v in obj)
    return fn(obj)


def save(worker, folder: str, version: int) -> tuple[dict, dict]:
    """The SaveCheckpoint command on a training worker (runtime.worker): into `folder` only
    when it is a staging folder of the run's checkpoints the worker was told at start."""
    trainer, place, spec = worker.trainer, worker.spec.training_place, worker.spec
    folder = staging_in(spec.checkpoints, folder)
    if trainer is None:
        raise RuntimeError("checkpoint before the trainer was built (training never shifted up)")
    t0 = time.perf_counter()
    rank = train_rank(place)
    files = save_training(trainer, folder, rank, spec.group_shared)
    result = {"rank": rank, "optim_bytes": next(iter(files.values()))["bytes"]}
    phases = {"checkpoint.optimizer": time.perf_counter() - t0}
    if rank == 0:
        t1 = time.perf_counter()
        result["policy_bytes"], policy = save_policy(
            worker.store, version, folder, spec.model_dirs["policy"], spec.group_shared)
        files.update(policy)
        phases["checkpoint.policy"] = time.perf_counter() - t1
    result["files"] = files
    log.info("checkpoint v%d rank %d written to %s", version, rank, folder)
    return result, phases
