"""GPS on the local two-node Slurm cluster: replication across nodes, hybrid layout, scancel."""
from __future__ import annotations

import subprocess
import time

import pytest
from slurm_util import PROGRAMS, PYTHON, json_lines

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


def _check(reports, k):
    assert sorted((r["node"], r["tp_rank"]) for r in reports) == [
        ("n1", 0), ("n1", 1), ("n2", 0), ("n2", 1)]
    for r in reports:
        assert r["k"] == k
        for s in SCENARIOS:
            got, want = r[s]
            assert got == want, (r["node"], r["tp_rank"], s)
        assert r["state"][-1] == 2  # versions only move forward; v2 current everywhere
    assert {r.get("write1_version") for r in reports if r["node"] == "n1"} == {1}


@pytest.mark.parametrize("transport", ["nixl", "mpi"])
def test_write_on_node1_read_on_node2(slurm_cluster, tmp_path, tiny_models, transport):
    _check(_run(slurm_cluster, tmp_path, tiny_models, "--transport", transport), k=1)


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


def test_scancel_leaves_no_segment(slurm_cluster, tmp_path, tiny_models):
    out = tmp_path / "hold.out"
    job = slurm_cluster.sbatch("-N2", "--ntasks-per-node=3", "--time=2", "-o", str(out),
                               "--wrap", f"srun --mpi=pmix -n6 {PYTHON} {PROGRAM} "
                                         f"{tiny_models} --hold", cwd=tmp_path)
    deadline = time.monotonic() + 120
    while out.read_text().count('"ready"') < 2 if out.exists() else True:
        assert time.monotonic() < deadline, out.read_text() if out.exists() else "no output"
        time.sleep(0.2)
    mine = lambda: sorted(p.name for p in SHM_DIR.glob(f"pivotrl-{job}-*"))  # noqa: E731
    live = mine()
    assert any("-n1-policy-v0" in n for n in live) and any("-n2-genrm-v0" in n for n in live)
    slurm_cluster.run("scancel", job)
    deadline = time.monotonic() + 30
    while mine() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert mine() == [], mine()


def test_clean_cli_removes_a_jobs_segments(tmp_path):
    seg = SHM_DIR / "pivotrl-cleantest-n1-policy-v0"
    seg.write_bytes(b"x")
    other = SHM_DIR / "pivotrl-cleantestother-n1-policy-v0"
    other.write_bytes(b"x")
    try:
        p = subprocess.run([str(PYTHON), "-m", "pivotrl_hpc.cli.main", "gps", "clean", "--job",
                            "cleantest"], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and "removed 1 segment" in p.stdout, p.stderr
        assert not seg.exists() and other.exists()
    finally:
        seg.unlink(missing_ok=True)
        other.unlink(missing_ok=True)


