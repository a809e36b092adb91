"""`pivotrl bench gpu`: the GPU path in one prepared command (`profiling/gpu_check.sh`).

One JSON object, each figure beside its baseline from the same run:
- `gps[SIZE]`: GPS Read of a synthetic model into preallocated CUDA tensors (the segment
  mapping registered for DMA, gps/device.py) against a pinned host -> device `copy_` of the
  same bytes (`read_vs_h2d`), the same Read through pageable memory, and a GPS Write from
  CUDA tensors against a pinned device -> host copy (`write_vs_d2h`). The Read is checked
  byte for byte against the segment.
- `train`: Megatron-Core (NCCL on a GPU) in the real device worker: GRPO steps of a random
  Qwen2-shaped model in bf16 with fp32 main params, shift down (params discarded, the rest
  offloaded to pinned host memory) and shift up (GPS Read + reload), phases, the device bytes
  freed, and the losses after a shift cycle against a run without one (bench_gpu_train.py).
- `nixl`: VRAM <-> DRAM bandwidth through NIXL's UCX backend, when NIXL is installed.
- `targets`: the paper's figures (read_vs_h2d >= 0.8, shift up <= 8.5 s, down <= 6 s, >= 90 %
  freed) and whether this run meets them.

`--device cpu` runs the same code at a tiny size (the CPU twin; the suite runs it): there
"device" tensors are host tensors and the baselines plain memcpys.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from pivotrl_hpc.gps.shmdir import ROOT as SHM_ROOT

TARGETS = {"read_vs_h2d": 0.8, "shift_up_s": 8.5, "shift_down_s": 6.0, "freed_fraction": 0.9}
SHM_FACTOR = 3.2   # a size needs v0, the Written version and a spare in /dev/shm


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--sizes-mb", default=None,
                   help="GPS model sizes (default 1024,8192 on cuda, 16 on cpu)")
    p.add_argument("--train", choices=["1b", "tiny", "none"], default=None,
                   help="trainer model (default 1b on cuda, tiny on cpu)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per figure (best)")
    p.add_argument("--no-nixl", action="store_true", help="skip the NIXL measurement")
    p.add_argument("--work-dir", type=Path, default=None, help="where models are written")
    p.add_argument("--json", action="store_true", help="print one JSON object (default)")


def _log(msg: str) -> None:
    print(f"bench gpu: {msg}", file=sys.stderr, flush=True)


def _timed(fn, repeats: int, sync) -> float:
    """Best seconds of `repeats` calls of fn (each ended by `sync`)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _rounded(figures: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}


@contextlib.contextmanager
def _unregistered():
    """GPS copies through pageable memory meanwhile (the baseline registration is held to);
    only mappings made inside are affected."""
    from pivotrl_hpc.gps import device as gps_device
    os.environ[gps_device.ENV_DISABLE] = "1"
    try:
        yield
    finally:
        del os.environ[gps_device.ENV_DISABLE]


def _sync(device: str):
    import torch
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def copy_baselines(nbytes: int, device: str, repeats: int) -> dict[str, float]:
    """Pinned host <-> device `copy_` of `nbytes` in GB/s (the PCIe figure GPS is held to)."""
    import torch
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host.fill_(1)
    sync = _sync(device)
    h2d = _timed(lambda: dev.copy_(host, non_blocking=True), repeats, sync)
    d2h = _timed(lambda: host.copy_(dev, non_blocking=True), repeats, sync)
    return {"h2d_gbps": nbytes / h2d / 1e9, "d2h_gbps": nbytes / d2h / 1e9}


def gps_size(size_mb: int, device: str, repeats: int, work: Path) -> dict:
    """GPS Read into / Write from `device` tensors for a synthetic model of `size_mb`."""
    import torch

    from pivotrl_hpc.cli.bench_gps import synthetic_model
    from pivotrl_hpc.gps.layout import ParallelPlace
    from pivotrl_hpc.gps.local import local_agent

    folder = work / f"gps-{size_mb}mb"
    nbytes = synthetic_model(folder, size_mb)
    free = shutil.disk_usage(SHM_ROOT).free
    if free < SHM_FACTOR * nbytes:
        return {"skipped": f"/dev/shm has {free / 2**30:.1f} GiB free, {size_mb} MB needs "
                           f"{SHM_FACTOR * nbytes / 2**30:.1f} GiB"}
    sync = _sync(device)
    out = {"bytes": nbytes}
    with local_agent({"m": str(folder)}, job=f"benchgpu{os.getpid()}") as agent:
        client = agent.client()
        with client.pin("m") as pin:
            infos = pin.segment.header.tensors
            dst = {n: torch.empty(i.shape, dtype=pin.segment.tensor(n).dtype, device=device)
                   for n, i in infos.items()}
        t0 = time.perf_counter()
        client.read("m", out=dst)   # maps, registers and copies: the cold Read
        sync()
        out["first_read_s"] = time.perf_counter() - t0
        with client.pin("m") as pin:
            out["read_bytes_equal"] = all(torch.equal(dst[n].cpu(), pin.segment.tensor(n))
                                          for n in infos)
        out["read_gbps"] = nbytes / _timed(lambda: client.read("m", out=dst), repeats, sync) / 1e9
        with _unregistered():   # a second client: its mappings are not registered
            plain = agent.client()
            out["read_pageable_gbps"] = nbytes / _timed(
                lambda: plain.read("m", out=dst), repeats, sync) / 1e9
            plain.close()
        last = {}

        def write() -> None:
            handle = client.write("m", dst, ParallelPlace(), layout="hf")
            last["version"] = handle.wait()
        out["write_gbps"] = nbytes / _timed(write, repeats, sync) / 1e9
        back = client.read("m", version=last["version"])
        out["write_bytes_equal"] = all(torch.equal(back[n], dst[n].cpu()) for n in infos)
        del back
        with _unregistered():   # each Write maps its segment anew
            out["write_pageable_gbps"] = nbytes / _timed(write, repeats, sync) / 1e9
        client.close()
    out.update(copy_baselines(nbytes, device, repeats))
    out["read_vs_h2d"] = out["read_gbps"] / out["h2d_gbps"]
    out["write_vs_d2h"] = out["write_gbps"] / out["d2h_gbps"]
    return _rounded(out)


def nixl_bandwidth(device: str, nbytes: int, repeats: int) -> dict:
    """NIXL WRITE and READ between a `device` buffer of one agent and a DRAM buffer of
    another in this process (UCX; "VRAM" on a GPU, "DRAM" on the CPU twin)."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:   # a carried nixl-cu13 wheel without its `nixl` meta package
            from nixl_cu13._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            return {"skipped": f"NIXL is not installed here ({e})"}
    import torch

    cfg = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    a, b = nixl_agent("bench-a", cfg), nixl_agent("bench-b", cfg)
    dev = torch.ones(nbytes, dtype=torch.uint8, device=device)
    host = torch.zeros(nbytes, dtype=torch.uint8)
    kind = "VRAM" if device == "cuda" else "DRAM"
    dev_id = (dev.device.index or 0) if device == "cuda" else 0
    regs = [a.register_memory([(dev.data_ptr(), nbytes, dev_id, "")], kind),
            b.register_memory([(host.data_ptr(), nbytes, 0, "")], "DRAM")]
    peer = a.add_remote_agent(b.get_agent_metadata())
    local = a.get_xfer_descs([(dev.data_ptr(), nbytes, dev_id)], kind)
    remote = a.get_xfer_descs([(host.data_ptr(), nbytes, 0)], "DRAM")

    def xfer(op: str) -> None:
        handle = a.initialize_xfer(op, local, remote, peer, b"")
        state = a.transfer(handle)
        while state not in ("DONE", "ERR"):
            b.get_new_notifs()   # no progress thread: both workers are progressed here
            state = a.check_xfer_state(handle)
        a.release_xfer_handle(handle)
        if state == "ERR":
            raise RuntimeError(f"NIXL {op} between {kind} and DRAM failed")
    try:
        out = {"bytes": nbytes, "kind": kind,
               "write_gbps": nbytes / _timed(lambda: xfer("WRITE"), repeats, lambda: None) / 1e9}
        out["write_bytes_equal"] = bool(torch.equal(host, dev.cpu()))
        host.fill_(2)
        out["read_gbps"] = nbytes / _timed(lambda: xfer("READ"), repeats, lambda: None) / 1e9
        out["read_bytes_equal"] = bool(torch.equal(host, dev.cpu()))
    finally:
        a.deregister_memory(regs[0])
        b.deregister_memory(regs[1])
    return _rounded(out)


def verdicts(result: dict) -> dict:
    """Each target with the figure it is checked against (None: not measured here)."""
    gps = [v for v in result["gps"].values() if "read_vs_h2d" in v]
    train = result.get("train", {})
    figures = {"read_vs_h2d": min((v["read_vs_h2d"] for v in gps), default=None),
               "shift_up_s": train.get("shift_up_s"), "shift_down_s": train.get("shift_down_s"),
               "freed_fraction": train.get("freed_fraction")}
    out = {}
    for key, target in TARGETS.items():
        value = figures[key]
        higher = key in ("read_vs_h2d", "freed_fraction")
        met = None if value is None else (value >= target if higher else value <= target)
        out[key] = {"target": target, "value": value, "met": met}
    out["loss_equal_after_shift_cycle"] = {"value": train.get("loss_equal"),
                                           "met": train.get("loss_equal")}
    if result["environment"]["device"] != "cuda" or train.get("model") != "1b":
        out["note"] = ("the seconds and bandwidth targets are the paper's for a GPU and the ~1B "
                       "model; this run checks the orchestration, not them")
    return out


def environment(device: str) -> dict:
    import torch
    env = {"device": device, "torch": torch.__version__, "python": sys.version.split()[0],
           "shm_free_gib": round(shutil.disk_usage(SHM_ROOT).free / 2**30, 1)}
    if device == "cuda":
        env.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    return env


@contextlib.contextmanager
def stdout_to_stderr():
    """Native libraries print to fd 1 (NIXL's log does); only the JSON may go there."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield os.fdopen(os.dup(saved), "w")
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(args: argparse.Namespace) -> int:
    with stdout_to_stderr() as stdout:
        code, result = run_check(args)
        if result is not None:
            json.dump(result, stdout, indent=1)
            print(file=stdout)
        stdout.close()
    return code


def run_check(args: argparse.Namespace) -> tuple[int, dict | None]:
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print("pivotrl bench gpu: no CUDA device here (use --device cpu for the CPU twin)",
              file=sys.stderr)
        return 2, None
    cuda = args.device == "cuda"
    if cuda:   # before cuBLAS starts: the train check compares losses bit for bit
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    sizes = [int(s) for s in (args.sizes_mb or ("1024,8192" if cuda else "16")).split(",")]
    train = args.train or ("1b" if cuda else "tiny")
    result: dict = {"environment": environment(args.device), "gps": {}}
    with tempfile.TemporaryDirectory(prefix="pivotrl-bench-gpu-", dir=args.work_dir) as tmp:
        work = Path(tmp)
        for size in sizes:
            _log(f"GPS Read/Write of a {size} MB model")
            result["gps"][f"{size}mb"] = gps_size(size, args.device, args.repeats, work)
        if train != "none":
            from pivotrl_hpc.cli.bench_gpu_train import train_check
            _log(f"Megatron-Core shift cycle of the {train} model")
            result["train"] = train_check(train, args.device, work)
    if not args.no_nixl:
        _log("NIXL transfer")
        result["nixl"] = nixl_bandwidth(args.device, min(max(sizes), 1024) * 2**20, args.repeats)
    result["targets"] = verdicts(result)
    return 0, result


if __name__ == "__main__":   # profiling/gpu_check.sh: no need for the whole CLI there
    _parser = argparse.ArgumentParser(prog="pivotrl bench gpu")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
