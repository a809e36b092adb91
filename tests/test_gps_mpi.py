"""Node agents over MPI on this host (mpirun, no Slurm): NIXL that cannot start falls back to
MPI, MPI moves ranges larger than its message size in several messages, three agents replicate
a Write down a chain (the third node's bytes come from the second, and from the writer when the
second refuses to serve), and under the hybrid layout a version another node pins is kept and
transfer errors are reported."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from pivotrl_hpc.gps.hf import hf_header
from pivotrl_hpc.gps.plan import LinkModel, chunk_size
from pivotrl_hpc.gps.segment import SHM_DIR

PROGRAM = str(Path(__file__).parent / "programs" / "gps_mpi_pair.py")
HYBRID = str(Path(__file__).parent / "programs" / "gps_hybrid_pair.py")
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


def _mpirun(program: str, args: list[str], env: dict, n: int = 2) -> tuple[str, list[dict]]:
    full = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **env}
    forward = [a for k in env for a in ("-x", k)]
    p = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", str(n),
                        *forward, sys.executable, program, *args], capture_output=True,
                       text=True, env=full, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    reports = sorted(_reports(p.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == list(range(n)), p.stdout
    return p.stdout + p.stderr, reports


def _run(tiny_models, transport: str, *scenario: str, n: int = 2,
         **env) -> tuple[str, list[dict]]:
    job = f"mpipair{uuid.uuid4().hex[:8]}"
    out, reports = _mpirun(PROGRAM, [str(tiny_models / "policy"), job, transport, *scenario],
                           env, n)
    assert not list(SHM_DIR.glob(f"pivotrl-{job}-*"))  # each agent removed its own
    # every node's Read of v1 equals the tensors written on n0
    assert all(r["equal"] and r["version"] == 1 for r in reports), reports
    return out, reports


def _data_bytes(tiny_models) -> int:
    header, _ = hf_header(tiny_models / "policy", {})
    return header.total_bytes - header.data_start


def test_nixl_that_cannot_start_falls_back_to_mpi(tiny_models):
    # A real NIXL start failure: no backend plugins where NIXL is told to look for them.
    _, reports = _run(tiny_models, "nixl", NIXL_PLUGIN_DIR="/nonexistent")
    for r in reports:
        assert r["transport"] == "mpi", r
        assert "No plugins available" in r["fallback"], r
    assert reports[1]["chunks"] == 1  # n1 pulled v1 from n0 over MPI


def test_mpi_transfers_cross_the_message_size(tiny_models):
    data = _data_bytes(tiny_models)
    _, reports = _run(tiny_models, "mpi", PIVOTRL_GPS_MPI_CHUNK_BYTES=str(CHUNK))
    assert [(r["transport"], r["fallback"]) for r in reports] == [("mpi", None)] * 2
    assert data > 4 * CHUNK
    assert reports[1]["chunks"] == math.ceil(data / CHUNK)  # one range, in CHUNK pieces
    assert reports[0]["chunks"] == 0  # n0 held the Write: it pulled nothing


# ---- three agents: a Write's replication goes down a chain (plan.chain, relay.py) -------------
def test_the_second_node_serves_the_third_its_copy_of_a_write(tiny_models):
    """n0 writes; n1 pulls from n0 and n2 from n1, piece by piece (the agents' own
    accounting, and the writer's `replicated` notice that gathers every node's)."""
    data = _data_bytes(tiny_models)
    _, (n0, n1, n2) = _run(tiny_models, "nixl", n=3)
    assert [r["transport"] for r in (n0, n1, n2)] == ["nixl"] * 3
    pieces = -(-data // chunk_size(data, 2, LinkModel()))
    assert pieces >= 3   # so that n1 forwards a piece while it pulls the next
    assert n1["replication"] == {"version": 1, "bytes_from": {"0": data}, "steps": pieces,
                                 "dropped": {}}
    assert n2["replication"] == {"version": 1, "bytes_from": {"1": data}, "steps": pieces,
                                 "dropped": {}}
    assert n0["sources"] == {"0": {}, "1": {"0": data}, "2": {"1": data}}


def test_a_relay_that_refuses_to_serve_is_replaced_by_the_writer(tiny_models):
    """n1's MPI transport refuses every request (the injected fault): n1 still gets v1 from
    n0, n2 drops n1 after its first piece failed three times and pulls v1 from n0; the bytes
    each transport sent say so, and every node's v1 equals what n0 wrote."""
    data = _data_bytes(tiny_models)
    out, (n0, n1, n2) = _run(tiny_models, "mpi", "relay-refuses", n=3)
    assert n1["replication"]["bytes_from"] == {"0": data}
    assert n2["replication"]["bytes_from"] == {"0": data}
    assert list(n2["replication"]["dropped"]) == ["1"]
    assert "transfer from node 1 failed 3 times" in n2["replication"]["dropped"]["1"]
    assert n0["served"] == {"1": data, "2": data} and n1["served"] == {}
    assert "relay node 1 dropped" in out and "fault injected" in out


def test_a_relay_that_stalls_is_replaced_by_the_writer(tiny_models):
    """n1's process is stopped during the Write: n2 hears nothing from it for its 1 s and
    pulls v1 from n0, publishes it while n1 is still stopped; n1, let go on, catches up.
    (The MPI transport: the agents' control messages to a stopped agent must stay under
    MPI's eager limit, and NIXL's metadata in `segment` does not; see docs/design.md, GPS.)"""
    data = _data_bytes(tiny_models)
    _, (n0, n1, n2) = _run(tiny_models, "mpi", "relay-stalls", n=3)
    assert n2["replication"]["bytes_from"] == {"0": data}
    assert re.fullmatch(r"announced nothing for \d+\.\d s", n2["replication"]["dropped"]["1"])
    assert n1["replication"]["bytes_from"] == {"0": data}
    assert n0["sources"] == {"0": {}, "1": {"0": data}, "2": {"0": data}}
    assert n0["served"] == {"1": data, "2": data} and n1["served"] == {}


# ---- the hybrid layout (k = 2) under a slow reader and transfer faults (issue 11.9) ------------
def _hybrid(tiny_models, tmp_path, transport: str, scenario: str,
            **env) -> tuple[str, list[dict]]:
    job = f"hybrid{uuid.uuid4().hex[:8]}"
    out, reports = _mpirun(HYBRID, [str(tiny_models / "policy"), job, transport, scenario,
                                    str(tmp_path)], env)
    assert not list(SHM_DIR.glob(f"pivotrl-{job}-*"))
    assert [r["k"] for r in reports] == [2, 2], reports
    return out, reports


@pytest.mark.parametrize("transport", ["nixl", "mpi"])
def test_a_version_pinned_on_one_node_stays_on_the_node_that_holds_its_other_half(
        tiny_models, tmp_path, transport):
    _, (_, reader) = _hybrid(tiny_models, tmp_path, transport, "slow-reader")
    # v1..v3 were written meanwhile; v0 was kept on n0 only because n1's reader pinned it
    assert reader["v0_pinned_held_on"] == ["n0", "n1"], reader
    assert reader["v0_equal"] is True, reader       # the half fetched from n0 is v0's
    assert reader["v1_held_on"] == [], reader       # unpinned everywhere: freed
    assert reader["v0_released_held_on"] == [], reader
    assert reader["v3_equal"] is True, reader


def test_transfer_errors_fail_the_read_or_the_write_and_the_agents_go_on(tiny_models, tmp_path):
    out, (writer, reader) = _hybrid(tiny_models, tmp_path, "mpi", "faults")
    refused = "('policy', {}) refused by its holder: fault injected"
    assert reader["read_error"] == (
        "RuntimeError: GPS agent: policy v0 on n1: transfer from node 0 failed 3 times: "
        "RuntimeError: " + refused.format(0)), reader
    assert writer["write_error"].startswith(
        "GPSWriteError: Write of policy v1 failed: policy v1 on n1: transfer from node 0 "
        "failed 3 times"), writer
    assert writer["v_next"] == 2 and reader["current"] == 2
    assert reader["v2_equal"] is True, reader
    assert "policy v2 on n1: transfer from node 0 failed (attempt 1 of 3), retrying" in out
    assert out.count("fault injected") >= 7
    assert reader["old_held_on"] == [], reader


def test_closing_the_mpi_transport_does_not_wait_forever_for_a_peer_that_never_receives():
    program = str(Path(__file__).parent / "programs" / "gps_transport_close.py")
    out, (closer, _) = _mpirun(program, [], {})
    assert 4.9 < closer["close_s"] < 8, closer   # its 5 s limit, then the send is cancelled
    assert "GPS MPI transport: 1 sends not received within 5 s; cancelled" in out


@pytest.fixture
def two_small_shms(tmp_path):
    """One private 20 MiB tmpfs per node agent (the real /dev/shm is shared with the suite)."""
    roots = [tmp_path / f"shm{i}" for i in range(2)]
    for r in roots:
        r.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m,mode=1777", "tmpfs",
                           str(r)], capture_output=True).returncode != 0:
            pytest.skip("mounting a tmpfs needs root")
    yield roots
    for r in roots:
        subprocess.run(["umount", "-l", str(r)], check=False)


def test_a_hybrid_write_into_a_full_shm_fails_with_the_figure_not_a_sigbus(
        tiny_models, tmp_path, two_small_shms):
    # each node reserves its own half when the Write begins; the writer's other half is
    # reserved by the writer before it copies, and that is what does not fit on n0
    sync = tmp_path / "sync"
    sync.mkdir()
    _, (writer, other) = _hybrid(tiny_models, sync, "mpi", "full-shm",
                                 SHM_ROOTS=",".join(map(str, two_small_shms)))
    assert "wrote" not in writer, writer
    assert writer["write_error"].startswith("GPSMemoryError: pivotrl-hybrid"), writer
    assert "cannot hold" in writer["write_error"] and "missing" in writer["write_error"]
    assert writer["read_error"].startswith("GPSMemoryError: pivotrl-hybrid"), writer
    assert "-n0-stage-" in writer["read_error"], writer      # the staging file of the Read
    for r in (writer, other):
        assert r["state"] == [0, [0]] and r["v0_equal"] is True, r
    assert [list(r.iterdir()) for r in two_small_shms] == [[], []]   # the folders too
