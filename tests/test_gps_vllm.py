"""Megatron -> GPS -> vLLM round trip: next-token logprobs equal transformers' (1e-4)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pivotrl_hpc.gps.local import local_agent

PROGRAM = str(Path(__file__).parent / "programs" / "gps_vllm_roundtrip.py")
ROOT = str(Path(__file__).resolve().parents[1])
TOL = 1e-4  # float32 on CPU: vLLM's and transformers' kernels differ in summation order


@pytest.mark.slow
def test_megatron_write_vllm_read_logprobs(tiny_models):
    pytest.importorskip("vllm")
    folder = tiny_models / "policy"
    with local_agent({"policy": str(folder)}) as agent:
        p = subprocess.run([sys.executable, PROGRAM, agent.job, agent.node, str(folder)],
                           capture_output=True, text=True, timeout=600,
                           env={**os.environ, "PYTHONPATH": ROOT})
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert p.returncode == 0 and lines, p.stdout[-2000:] + p.stderr[-4000:]
    r = json.loads(lines[-1])
    assert r["version"] == [1] and r["exact_read"]
    assert r["before_vs_old_hf"] < TOL
    assert r["new_vs_old_hf"] > 100 * TOL  # the update is visible, so the check means something
    assert r["after_vs_new_hf"] < TOL, r
