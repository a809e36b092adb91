"""`pivotrl bench gps` end to end on a small model (the real figures use --size-mb 1024)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

KEYS = {"size_mb", "read_gbps", "write_gbps", "replicate_gbps", "memcpy_gbps", "read_vs_memcpy",
        "read_tensors_gbps", "memcpy_tensors_gbps", "read_tensors_vs_memcpy_tensors"}


@pytest.mark.slow
def test_bench_gps_prints_the_json_object():
    p = subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", "bench", "gps",
                        "--size-mb", "32", "--readers", "2", "--repeats", "2", "--no-tiny",
                        "--json"], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "UCX_MODULES": "^ib,rdmacm"})
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert KEYS <= res.keys() and res["size_mb"] == 32
    assert all(res[k] > 0 for k in KEYS - {"size_mb"})
    assert res["read_vs_memcpy"] == pytest.approx(res["read_gbps"] / res["memcpy_gbps"], rel=0.01)
    assert res["read_tensors_vs_memcpy_tensors"] == pytest.approx(
        res["read_tensors_gbps"] / res["memcpy_tensors_gbps"], rel=0.01)
