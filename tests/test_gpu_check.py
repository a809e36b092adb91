"""The GPU check's CPU twin: `profiling/gpu_check.sh --device cpu`, the same entry and code the
lent GPU runs, at a tiny size, with vLLM and transformers made unimportable (the GPU machine
has no vLLM; the check must not need either)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

BLOCKER = '''import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("vllm", "transformers"):
            raise ImportError(f"{name} is not installed on the GPU machine")
sys.meta_path.insert(0, _Block())
'''


def test_gpu_check_cpu_twin(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(tmp_path / "site"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run([str(REPO / "profiling" / "gpu_check.sh"), "--device", "cpu",
                           "--repeats", "1", "--work-dir", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["environment"]["device"] == "cpu"

    gps = result["gps"]["16mb"]
    assert gps["read_bytes_equal"] and gps["write_bytes_equal"]
    for key in ("read_gbps", "read_pageable_gbps", "write_gbps", "h2d_gbps", "d2h_gbps"):
        assert gps[key] > 0, key
    assert abs(gps["read_vs_h2d"] - gps["read_gbps"] / gps["h2d_gbps"]) < 1e-3

    train = result["train"]
    # the shift cycle changed nothing: step 2 and 3 equal the unshifted run's, bit for bit
    assert train["loss_equal"]
    assert train["losses"]["shifted"] == train["losses"]["reference"]
    assert train["grad_norms"]["shifted"] == train["grad_norms"]["reference"]
    assert len(set(train["losses"]["reference"])) == 3   # the steps did train
    # shift up was a GPS Read of the version the shifted worker published, then a reload
    assert train["read_version"] == 1
    assert "parameters.read" in train["up"] and "offloadable.reload.total" in train["up"]
    assert "preserved.build" not in train["up"]
    assert train["device_bytes"]["role_held"] > 0 and train["device_bytes"]["after_down"] == 0
    assert train["freed_fraction"] == 1.0

    assert result["nixl"]["write_bytes_equal"] and result["nixl"]["read_bytes_equal"]
    targets = result["targets"]
    assert set(targets) >= {"read_vs_h2d", "shift_up_s", "shift_down_s", "freed_fraction",
                            "loss_equal_after_shift_cycle", "note"}
    assert targets["loss_equal_after_shift_cycle"]["met"] is True
    assert (tmp_path / "gpu_check.log").read_text().count("bench gpu:") >= 3
