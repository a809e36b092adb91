"""`pivotrl bench gps`: GPS Read / Write / replicate bandwidth against a plain memcpy.

One JSON object: size_mb, read_gbps (all readers together, each Reading the whole model at
TP=1 into the buffers `GPSClient.buffers` lays out, as a worker that keeps its copy does: one
memmove; per reader the best of `--repeats` rounds, rounds interleaved with the baselines),
memcpy_gbps (the same readers doing `np.copyto` of the same size at the same time: this
machine's limit) and read_vs_memcpy; read_tensors_gbps (the Read into one torch tensor per
parameter, as an engine's own parameters are) against memcpy_tensors_gbps (plain per-tensor
memmoves of the same segment bytes into the same tensors) and their ratio: per tensor glibc
copies without streaming stores, hence lower (gps/tensors.py); write_gbps (one Write of the
whole model into a recycled version, until the handle completes), replicate_gbps (node 1 ->
node 2 through the real agents under mpirun, write time excluded); plus the Read latency of
the tiny policy and GenRM.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pivotrl_hpc import envs

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size-mb", type=int, default=1024, help="model size to move")
    parser.add_argument("--readers", type=int, default=2, help="concurrent reader processes")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed rounds (one Read + one memcpy) per reader")
    parser.add_argument("--transport", choices=["nixl", "mpi"], default="nixl")
    parser.add_argument("--no-replicate", action="store_true", help="skip the 2-agent part")
    parser.add_argument("--no-tiny", action="store_true", help="skip tiny-model Read latency")
    parser.add_argument("--json", action="store_true", help="JSON only (the default output)")


def synthetic_model(folder: Path, size_mb: int) -> int:
    """A Qwen2-shaped float32 model of about `size_mb` (hidden 1024, vocab <= 32768)."""
    import torch
    from safetensors.torch import save_file

    from pivotrl_hpc.gps.shapes import ModelShape
    h, inter = 1024, 4096
    # embedding + lm_head take at most a quarter of the size
    vocab = int(min(32768, max(1024, size_mb * 2**20 // 4 // (2 * 4 * h))) // 1024 * 1024)
    per_layer = 4 * (2 * h * h + 2 * 512 * h + 3 * h * inter)
    layers = max(1, (size_mb * 2**20 - 2 * 4 * vocab * h) // per_layer)
    cfg = {"model_type": "qwen2", "vocab_size": vocab, "hidden_size": h,
           "intermediate_size": inter, "num_hidden_layers": int(layers),
           "num_attention_heads": 16, "num_key_value_heads": 8, "rope_theta": 1e6,
           "tie_word_embeddings": False, "max_position_embeddings": 4096}
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    shapes = ModelShape.from_hf_config(cfg).hf_param_shapes()
    tensors = {n: torch.full(s, float(i % 97) / 7.0) for i, (n, s) in enumerate(shapes.items())}
    save_file(tensors, str(folder / "model.safetensors"))
    return sum(t.numel() * 4 for t in tensors.values())


def _spawn(mode: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pivotrl_hpc.cli.bench_gps", mode, *args],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


KINDS = ("read", "memcpy", "read_tensors", "memcpy_tensors")


def _concurrent(n: int, *args: str) -> dict[str, float]:
    """n workers start together and alternate each of KINDS, `repeats` times; each kind's
    aggregate is the sum over workers of their best round (bandwidth on a shared VM is noisy,
    and interleaving exposes every kind to the same noise)."""
    start_at = str(time.time() + 8.0)  # after imports and buffer warm-up
    procs = [_spawn("--worker-mixed", start_at, *args) for _ in range(n)]
    outs = []
    for p in procs:
        lines = p.communicate()[0].strip().splitlines()
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"bench reader failed with exit code {p.returncode}")
        outs.append(json.loads(lines[-1]))
    return {k: sum(o[k] for o in outs) for k in KINDS}


def _worker_mixed(start_at: str, job: str, node: str, repeats: str) -> None:
    import ctypes

    import numpy as np
    import torch

    from pivotrl_hpc.gps.client import GPSClient
    c = GPSClient(job, node)
    # read: into GPS-laid-out buffers (one memmove), against one np.copyto of the same size;
    # read_tensors: into one torch tensor each (an engine's parameters), against plain
    # per-tensor memmoves of the same segment bytes into the same tensors
    out = c.buffers("bench")
    params = {k: torch.empty_like(v) for k, v in out.items()}
    pin = c.pin("bench")
    views = c.read("bench", copy=False, pin=pin)
    plain = [(params[k].data_ptr(), v.data_ptr(), v.numel() * v.element_size())
             for k, v in views.items()]
    nbytes = sum(t.numel() * t.element_size() for t in out.values())
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    kinds = {"read": lambda: c.read("bench", out=out),
             "memcpy": lambda: np.copyto(dst, src),
             "read_tensors": lambda: c.read("bench", out=params),
             "memcpy_tensors": lambda: [ctypes.memmove(*a) for a in plain]}
    for fn in kinds.values():   # every destination touched before timing
        fn()
    time.sleep(max(0.0, float(start_at) - time.time()))
    best = dict.fromkeys(KINDS, 0.0)
    for _ in range(int(repeats)):
        for k, fn in kinds.items():
            t0 = time.perf_counter()
            fn()
            best[k] = max(best[k], nbytes / (time.perf_counter() - t0) / 1e9)
    del views
    pin.release()
    c.close()
    print(json.dumps(best))


def _bench_write(client, folder: Path) -> float:
    """GB/s of a whole-model Write (HF layout, TP=1) into a recycled version."""
    from safetensors.torch import load_file

    from pivotrl_hpc.gps.layout import ParallelPlace
    sd = load_file(str(folder / "model.safetensors"))
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    best = 0.0
    for _ in range(3):  # v1, v2 land on fresh pages; v3 reuses v1's retired segment
        t0 = time.perf_counter()
        client.write("bench", sd, ParallelPlace(), layout="hf").wait(600)
        best = nbytes / (time.perf_counter() - t0) / 1e9
        time.sleep(0.2)  # let the agent retire the previous version
    return best


def _bench_replicate(folder: Path, transport: str) -> float:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise RuntimeError("mpirun not found: replicate_gbps needs Open MPI")
    env = {**os.environ, "UCX_MODULES": envs.UCX_MODULES.get(),
           "OMPI_MCA_btl": envs.OMPI_MCA_BTL.get()}
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-n", "4", "-x", "UCX_MODULES",
           "-x", "OMPI_MCA_btl", sys.executable, "-m", "pivotrl_hpc.cli.bench_gps",
           "--worker-replicate", str(folder), transport, f"rep{os.getpid()}"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"replicate bench failed: {p.stdout[-1000:]}{p.stderr[-3000:]}")
    return json.loads(lines[-1])["replicate_gbps"]


def _worker_replicate(folder: str, transport: str, job: str) -> None:
    """Ranks 0, 1 on node r1 (agent, writer); 2, 3 on node r2 (agent, idle)."""
    from mpi4py import MPI
    from safetensors.torch import load_file

    from pivotrl_hpc.gps.agent import AgentConfig, NodeAgent
    from pivotrl_hpc.gps.client import GPSClient
    from pivotrl_hpc.gps.layout import ParallelPlace
    world = MPI.COMM_WORLD
    node = f"r{world.rank // 2}"
    agents = world.Split(world.rank % 2, world.rank)
    if world.rank % 2 == 0:
        agent = NodeAgent(AgentConfig(job, node, {"bench": folder}, transport=transport), agents)
        agent.start()
        world.Barrier()
        agent.serve_forever()
        return
    world.Barrier()
    if world.rank == 1:
        c = GPSClient(job, node)
        sd = load_file(os.path.join(folder, "model.safetensors"))
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        best = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            h = c.write("bench", sd, ParallelPlace(), layout="hf")
            t1 = time.perf_counter()
            h.wait(600)
            best = max(best, nbytes / (time.perf_counter() - t1) / 1e9)
            log.info("write %.2f s, replicate %.2f s", t1 - t0, time.perf_counter() - t1)
            time.sleep(0.2)
        print(json.dumps({"replicate_gbps": best}), flush=True)
    agents.Barrier()
    GPSClient(job, node).shutdown_agent()


def _tiny_read_ms() -> dict[str, float]:
    from pivotrl_hpc.assets.models import SPECS, create_model
    from pivotrl_hpc.gps.local import local_agent
    with tempfile.TemporaryDirectory() as d:
        for m in ("policy", "genrm"):
            create_model(Path(d) / m, SPECS[m])
        with local_agent({m: str(Path(d) / m) for m in ("policy", "genrm")}) as agent:
            c = agent.client()
            res = {}
            for m in ("policy", "genrm"):
                c.read(m)
                times = []
                for _ in range(20):
                    t0 = time.perf_counter()
                    c.read(m)
                    times.append(time.perf_counter() - t0)
                res[m] = round(sorted(times)[len(times) // 2] * 1e3, 3)
            c.close()
    return res


def main(args: argparse.Namespace) -> int:
    from pivotrl_hpc.gps.local import local_agent
    res: dict = {"size_mb": args.size_mb, "readers": args.readers}
    with tempfile.TemporaryDirectory(dir=envs.BENCH_DIR.raw()) as d:
        folder = Path(d) / "bench"
        nbytes = synthetic_model(folder, args.size_mb)
        res["model_bytes"] = nbytes
        with local_agent({"bench": str(folder)}) as agent:
            res.update({f"{k}_gbps": v for k, v in _concurrent(
                args.readers, agent.job, agent.node, str(args.repeats)).items()})
            c = agent.client()
            res["write_gbps"] = _bench_write(c, folder)
            c.close()
        res["read_vs_memcpy"] = res["read_gbps"] / res["memcpy_gbps"]
        res["read_tensors_vs_memcpy_tensors"] = (res["read_tensors_gbps"]
                                                 / res["memcpy_tensors_gbps"])
        res["replicate_gbps"] = None if args.no_replicate else _bench_replicate(folder,
                                                                                args.transport)
    if not args.no_tiny:
        res["tiny_read_ms"] = _tiny_read_ms()
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    mode, rest = sys.argv[1], sys.argv[2:]
    {"--worker-mixed": _worker_mixed, "--worker-replicate": _worker_replicate}[mode](*rest)
