"""`python engine_host_bench.py MODELS_DIR [CYCLES]`: engine host figures, one JSON line.

Policy host (TP=1): first start (process + imports + engine), warm shift down / up seconds
(medians), RSS and private memory of the host awake and idle after a shift down. GenRM: a
TP=1 host vs a TP=2 replica of two hosts (`external_launcher`): build seconds, greedy step
seconds (median, 8 sequences decoding), warm shift down / up. Weights from a GPS agent.
"""
import json
import logging
import statistics
import sys
import time
from pathlib import Path

from pivotrl_hpc.protocol.engine import EngineOptions, Sampling
from pivotrl_hpc.gps.local import local_agent
from pivotrl_hpc.runtime.engine_host import EngineHost, GPSRead, TPWorld, spmd

log = logging.getLogger("engine_host_bench")
MiB = 2**20
GREEDY = Sampling(temperature=0.0, ignore_eos=True)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def private_mb(pid: int) -> float:
    """Unique to the process (what a second host really costs): Private_Clean + _Dirty."""
    kb = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith(("Private_Clean:", "Private_Dirty:")):
            kb += int(line.split()[1])
    return round(kb / 1024, 1)


def timed(fn, *args):
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def shift_cycles(hosts, read, cycles: int) -> dict:
    down, up = [], []
    for _ in range(cycles):
        down.append(timed(spmd, hosts, "shift_down"))
        up.append(timed(spmd, hosts, "shift_up", read))
    return {"shift_down_s": round(statistics.median(down), 3),
            "shift_up_s": round(statistics.median(up), 3)}


def step_seconds(hosts, n_seqs: int = 8, n_new: int = 32) -> float:
    for host in hosts:
        for i in range(n_seqs):
            host.add(f"s{i}", [5 + i, 17, 99, 3, 250, 8, 41, 7], [], n_new, GREEDY)
    times = []
    while hosts[0].num_running:
        t0 = time.perf_counter()
        spmd(hosts, "step")
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times[1:]), 4)  # the first step is the prefill


def policy_figures(models: Path, read: GPSRead, cycles: int) -> dict:
    opts = EngineOptions(max_model_len=256, kv_cache_memory_bytes=64 * MiB)
    t0 = time.perf_counter()
    with EngineHost(models / "policy", opts, read, name="policy") as host:
        first = time.perf_counter() - t0
        out = {"first_start_s": round(first, 2),
               "first_start_phases": {k: round(v, 3) for k, v in host.start_phases.items()},
               "rss_awake_mb": rss_mb(host.pid), "private_awake_mb": private_mb(host.pid)}
        out.update(shift_cycles([host], read, cycles))
        host.shift_down()
        out["rss_idle_after_shift_down_mb"] = rss_mb(host.pid)
        out["private_idle_after_shift_down_mb"] = private_mb(host.pid)
        host.shift_up(read)
    return out


def genrm_figures(models: Path, read: GPSRead, tp: int, cycles: int, port: int) -> dict:
    opts = EngineOptions(max_model_len=256, kv_cache_memory_bytes=64 * MiB // tp,
                         tensor_parallel_size=tp)
    t0 = time.perf_counter()
    hosts = [EngineHost(models / "genrm", opts, read, wait=False, name=f"genrm tp{r}/{tp}",
                        world=TPWorld(r, tp, master_port=port) if tp > 1 else None)
             for r in range(tp)]
    try:
        for h in hosts:
            h.wait_started()
        out = {"build_s": round(time.perf_counter() - t0, 2),
               "engine_start_s": round(max(h.start_phases["engine_start"] for h in hosts), 2),
               "greedy_step_s": step_seconds(hosts)}
        out.update(shift_cycles(hosts, read, cycles))
        return out
    finally:
        for h in hosts:
            h.close()


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    models, cycles = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 3
    with local_agent({m: str(models / m) for m in ("policy", "genrm")}) as agent:
        result = {"policy": policy_figures(models, GPSRead(agent.job, agent.node, "policy"),
                                           cycles)}
        read = GPSRead(agent.job, agent.node, "genrm")
        result["genrm_tp1"] = genrm_figures(models, read, 1, cycles, 0)
        result["genrm_tp2"] = genrm_figures(models, read, 2, cycles, 29711)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
