"""Two node agents over MPI on this host (mpirun, no Slurm): NIXL that cannot start falls back
to MPI, and MPI moves ranges larger than its message size in several messages."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import uuid
from pathlib import Path

from pivotrl_hpc.gps.segment import SHM_DIR, hf_header

PROGRAM = str(Path(__file__).parent / "programs" / "gps_mpi_pair.py")
ROOT = str(Path(__file__).resolve().parents[1])
CHUNK = 1_000_003  # odd on purpose: pieces end off any alignment


def _reports(text: str) -> list[dict]:
    """Every `{"rank": ...}` object in the output, wherever mpirun's forwarding put it."""
    dec, out, i = json.JSONDecoder(), [], text.find('{"rank"')
    while i >= 0:
        obj, end = dec.raw_decode(text, i)
        out.append(obj)
        i = text.find('{"rank"', end)
    return out


def _run(tiny_models, transport: str, **env) -> list[dict]:
    job = f"mpipair{uuid.uuid4().hex[:8]}"
    full = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **env}
    forward = [a for k in env for a in ("-x", k)]
    p = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "2",
                        *forward, sys.executable, PROGRAM, str(tiny_models / "policy"), job,
                        transport], capture_output=True, text=True, env=full, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert not list(SHM_DIR.glob(f"pivotrl-{job}-*"))  # each agent removed its own
    reports = sorted(_reports(p.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1], p.stdout
    assert all(r["equal"] and r["version"] == 1 for r in reports), reports
    return reports


def test_nixl_that_cannot_start_falls_back_to_mpi(tiny_models):
    # A real NIXL start failure: no backend plugins where NIXL is told to look for them.
    reports = _run(tiny_models, "nixl", NIXL_PLUGIN_DIR="/nonexistent")
    for r in reports:
        assert r["transport"] == "mpi", r
        assert "No plugins available" in r["fallback"], r
    assert reports[1]["chunks"] == 1  # n1 pulled v1 from n0 over MPI


def test_mpi_transfers_cross_the_message_size(tiny_models):
    header, _ = hf_header(tiny_models / "policy", {})
    data = header.total_bytes - header.data_start
    reports = _run(tiny_models, "mpi", PIVOTRL_GPS_MPI_CHUNK_BYTES=str(CHUNK))
    assert [(r["transport"], r["fallback"]) for r in reports] == [("mpi", None)] * 2
    assert data > 4 * CHUNK
    assert reports[1]["chunks"] == math.ceil(data / CHUNK)  # one range, in CHUNK pieces
    assert reports[0]["chunks"] == 0  # n0 held the Write: it pulled nothing
