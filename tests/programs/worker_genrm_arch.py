"""One device worker shifting rollout -> reward -> rollout with a GenRM of another
architecture (GLM-4, Qwen3-MoE), its weights Read from GPS at each shift up.

usage: worker_genrm_arch.py POLICY_DIR GENRM_DIR OUT.json
"""
from __future__ import annotations

import json
import os
import sys

from rendezvous import init_world_of_one
from worker_roles import RecordingStore, hf_greedy, ok, reqs, run_to_end, tokens

from pivotrl_hpc.protocol.engine import EngineOptions
from pivotrl_hpc.runtime.local import local_worker
from pivotrl_hpc.protocol.messages import RoleKind, ShiftDown, ShiftUp
from pivotrl_hpc.runtime.worker import WorkerSpec

N_NEW = 8


def main(policy: str, genrm: str, out_path: str) -> None:
    store = init_world_of_one()  # noqa: F841 - keeps the rendezvous port bound
    opts = EngineOptions(max_model_len=128, kv_cache_memory_bytes=16 * 2**20)
    spec = WorkerSpec(model_dirs={"policy": policy, "genrm": genrm},
                      engine_options={"policy": opts, "genrm": opts})
    report: dict = {"phases": {}}
    with local_worker(spec, job=f"warch{os.getpid()}") as w:
        w.store = RecordingStore(w.store)
        for step, (role, prefix) in enumerate([(RoleKind.ROLLOUT, "a"), (RoleKind.REWARD, "r"),
                                               (RoleKind.ROLLOUT, "b")]):
            up = ok(w.handle(ShiftUp(role, step)))
            report["phases"][f"{step}_{role.value}_up"] = up.phases
            report[prefix] = tokens(run_to_end(w, reqs(prefix, N_NEW)), prefix)
            ok(w.handle(ShiftDown()))
        report["reads"] = [list(r) for r in w.store.reads]
    report["policy_hf"] = hf_greedy(policy, N_NEW)
    report["genrm_hf"] = hf_greedy(genrm, N_NEW)
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
