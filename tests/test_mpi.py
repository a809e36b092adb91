"""Open MPI + mpi4py, alone (mpirun) and under the local Slurm cluster (srun --mpi=pmix)."""
from __future__ import annotations

import os
import subprocess
from collections import defaultdict

import pytest

from slurm_util import PROGRAMS, PYTHON, json_lines

PROBE = str(PROGRAMS / "mpi_report.py")


def test_mpirun_four_ranks_allreduce():
    # default transports (shared memory on one host): what a plain local mpirun gets
    env = {k: v for k, v in os.environ.items() if k != "OMPI_MCA_btl"}
    p = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "4",
                        str(PYTHON), PROBE],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    reports = json_lines(p.stdout)
    assert sorted(r["rank"] for r in reports) == [0, 1, 2, 3], p.stdout
    assert {r["size"] for r in reports} == {4}
    assert [r["sum"] for r in reports] == [6] * 4  # 0+1+2+3 on every rank
    # one host: COMM_TYPE_SHARED puts all four ranks together
    assert {tuple(r["shared_group"]) for r in reports} == {(0, 1, 2, 3)}


@pytest.mark.slurm
def test_srun_pmix_two_nodes(slurm_cluster, tmp_path):
    p = slurm_cluster.run("srun", "--mpi=pmix", "-N2", "--ntasks-per-node=2", "--time=1",
                          str(PYTHON), PROBE, timeout=60, cwd=tmp_path)
    reports = json_lines(p.stdout)
    assert sorted(r["rank"] for r in reports) == [0, 1, 2, 3], p.stdout + p.stderr
    assert {r["size"] for r in reports} == {4}
    assert [r["sum"] for r in reports] == [6] * 4
    assert all(r["slurm_procid"] == str(r["rank"]) for r in reports)  # MPI rank == Slurm task id
    # COMM_TYPE_SHARED splits per (fake) node: two groups of two, each group on one node
    by_node = defaultdict(set)
    for r in reports:
        by_node[r["node"]].add(tuple(r["shared_group"]))
    assert set(by_node) == {"n1", "n2"}
    groups = {g for gs in by_node.values() for g in gs}
    assert len(groups) == 2 and all(len(g) == 2 for g in groups), by_node
    assert all(len(gs) == 1 for gs in by_node.values()), by_node  # one group per node
    assert sorted(groups) == [(0, 1), (2, 3)]  # block distribution: ranks 0,1 on n1
