"""GPS on the local two-node Slurm cluster: replication across nodes, hybrid layout, scancel,
`gps serve --mpi` under srun."""
from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import load_file
from slurm_util import PROGRAMS, PYTHON, json_lines, wait_job

from pivotrl_hpc.gps.client import GPSClient
from pivotrl_hpc.gps.layout import ParallelPlace
from pivotrl_hpc.gps.segment import SHM_DIR

pytestmark = pytest.mark.slurm
PROGRAM = str(PROGRAMS / "gps_two_node.py")
SCENARIOS = ("read0_policy", "read0_genrm", "write1", "write1_full", "write2")


def _run(slurm_cluster, tmp_path, tiny_models, *extra):
    p = slurm_cluster.run("srun", "--mpi=pmix", "-N2", "--ntasks-per-node=3", "--time=2",
                          str(PYTHON), PROGRAM, str(tiny_models), *extra,
                          timeout=240, cwd=tmp_path, check=False)
    reports = [r for r in json_lines(p.stdout) if "tp_rank" in r]
    assert p.returncode == 0 and len(reports) == 4, p.stdout[-3000:] + p.stderr[-6000:]
    return reports


def _check(reports, k, transport="nixl"):
    assert sorted((r["node"], r["tp_rank"]) for r in reports) == [
        ("n1", 0), ("n1", 1), ("n2", 0), ("n2", 1)]
    for r in reports:
        assert r["k"] == k
        # the transport that ran, not the one asked for (NIXL falls back to MPI quietly)
        assert (r["transport"], r["transport_fallback"]) == (transport, None), r
        for s in SCENARIOS:
            got, want = r[s]
            assert got == want, (r["node"], r["tp_rank"], s)
        assert r["state"][-1] == 2  # versions only move forward; v2 current everywhere
    assert {r.get("write1_version") for r in reports if r["node"] == "n1"} == {1}


@pytest.mark.parametrize("transport", ["nixl", "mpi"])
def test_write_on_node1_read_on_node2(slurm_cluster, tmp_path, tiny_models, transport):
    _check(_run(slurm_cluster, tmp_path, tiny_models, "--transport", transport), 1, transport)


def test_hybrid_layout_k2(slurm_cluster, tmp_path, tiny_models):
    """A per-node budget below policy + GenRM forces k = 2: each node holds about half, and
    Reads fetch the rest from the other node through the plan."""
    total_mb = sum(f.stat().st_size for m in ("policy", "genrm")
                   for f in (tiny_models / m).glob("*.safetensors")) / 2**20
    reports = _run(slurm_cluster, tmp_path, tiny_models, "--budget-mb", f"{total_mb * 0.75:.3f}")
    _check(reports, k=2)
    for r in reports:  # each node holds about half of GenRM v0 (whole tensors, packed)
        held, size = r["resident_genrm"]
        assert held < 0.7 * size, r


def _job_segments(job: str) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"pivotrl-{job}-*"))


def test_scancel_leaves_no_segment(slurm_cluster, tmp_path, tiny_models):
    out = tmp_path / "hold.out"
    job = slurm_cluster.sbatch("-N2", "--ntasks-per-node=3", "--time=2", "-o", str(out),
                               "--wrap", f"srun --mpi=pmix -n6 {PYTHON} {PROGRAM} "
                                         f"{tiny_models} --hold", cwd=tmp_path)
    deadline = time.monotonic() + 120
    while out.read_text().count('"ready"') < 2 if out.exists() else True:
        assert time.monotonic() < deadline, out.read_text() if out.exists() else "no output"
        time.sleep(0.2)
    live = _job_segments(job)
    assert any("-n1-policy-v0" in n for n in live) and any("-n2-genrm-v0" in n for n in live)
    slurm_cluster.run("scancel", job)
    deadline = time.monotonic() + 30
    while _job_segments(job) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _job_segments(job) == []


def test_gps_serve_mpi_under_srun(slurm_cluster, tmp_path, tiny_models):
    """`pivotrl gps serve --mpi`, one agent per node: job id and node names from Slurm, a Write
    on n1 replicated to n2 over NIXL, and a clean exit of both agents on shutdown requests."""
    out = tmp_path / "serve.out"
    serve = f"{PYTHON} -m pivotrl_hpc.cli.main gps serve --mpi --model policy={tiny_models}/policy"
    job = slurm_cluster.sbatch("-N2", "--ntasks-per-node=1", "--time=2", "-o", str(out),
                               "--wrap", f"srun --mpi=pmix {serve}", cwd=tmp_path)
    try:
        clients = {n: GPSClient(job, n, wait_s=120) for n in ("n1", "n2")}
        infos = {n: c.info() for n, c in clients.items()}
        assert {n: (i["index"], i["n_nodes"], i["transport"]) for n, i in infos.items()} == {
            "n1": (0, 2, "nixl"), "n2": (1, 2, "nixl")}, infos
        hf = load_file(str(tiny_models / "policy" / "model.safetensors"))
        new = {k: t * 2 - 1 for k, t in hf.items()}
        h = clients["n1"].write("policy", new, ParallelPlace(), layout="hf")
        assert h.wait(60) == 1
        got = clients["n2"].read("policy")
        assert all(torch.equal(got[k], new[k]) for k in hf)
        for c in clients.values():
            c.shutdown_agent()
            c.close()
        res = wait_job(slurm_cluster, job, out, timeout=60)
    finally:
        slurm_cluster.run("scancel", job, check=False)
    assert (res.state, res.exit_code) == ("COMPLETED", 0), res.output[-3000:]
    assert _job_segments(job) == []  # removed by the agents themselves: no helper here
