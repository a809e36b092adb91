"""launch/slurm.py without a cluster: reading `scontrol show job -d`, the allocation checks and
the srun line (the real cluster runs them in test_slurm_job.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from pivotrl_hpc.config import load_config
from pivotrl_hpc.launch.layout import LaunchError, RankLayout
from pivotrl_hpc.launch.slurm import Allocation, check_allocation, parse_job_detail, srun_command

ROOT = Path(__file__).resolve().parents[1]

DETAIL = """JobId=17 JobName=pivotrl
   NodeList=gpu[07-08],gpu10
   NumNodes=3 NumCPUs=96 NumTasks=3 CPUs/Task=1 ReqB:S:C:T=0:0:*:*
     Nodes=gpu[07-08] CPU_IDs=0-15,32-47 Mem=0 GRES=gpu:a100:8(IDX:0-7)
     Nodes=gpu10 CPU_IDs=0-3 Mem=0 GRES=gpu:2(IDX:0-1),nic:1
   MinCPUsNode=1 MinMemoryNode=0
"""


def test_job_detail_gives_cpus_and_gpus_per_node():
    assert parse_job_detail(DETAIL) == {"gpu07": (32, 8), "gpu08": (32, 8), "gpu10": (4, 2)}
    assert parse_job_detail("     Nodes=n1 CPU_IDs=0 Mem=0\n") == {"n1": (1, 0)}


def _cfg(nodes=2, per_node=4):
    return load_config(ROOT / "configs" / "tiny-cpu.yaml",
                       [f"cluster.nodes={nodes}", f"cluster.devices_per_node={per_node}"],
                       check_files=False)


def _alloc(gpus, cpus=None):
    names = tuple(f"n{i + 1}" for i in range(len(gpus)))
    return Allocation("9", "pivotrl", names, tuple(gpus), tuple(cpus or [16] * len(gpus)), 1,
                      Path("/tmp"))


@pytest.mark.parametrize("gpus,cpus,message", [
    ((4,), None, "the config needs 2 node(s) (cluster.nodes) but job 9 has only 1 (n1): "
                 "submit with -N 2, or set cluster.nodes=1"),
    ((4, 4, 4), None, "the config needs 2 node(s) (cluster.nodes) but job 9 has 3"),
    ((4, 2), None, "GPUs are split unevenly across nodes (n1: 4, n2: 2)"),
    ((0, 0), None, "no GPUs allocated on n1; submit with --gres=gpu:4"),
    ((2, 2), None, "the config needs 4 GPUs per node (cluster.devices_per_node) but job 9 has "
                   "2 on each node: submit with --gres=gpu:4, or set cluster.devices_per_node=2"),
    ((4, 4), (16, 4), "need 5 CPUs but node n2 has 4"),
])
def test_a_wrong_allocation_is_refused_with_what_to_change(gpus, cpus, message):
    with pytest.raises(LaunchError) as e:
        check_allocation(_cfg(), _alloc(gpus, cpus))
    assert message in str(e.value)


def test_more_gpus_than_the_config_uses_is_a_warning():
    assert check_allocation(_cfg(), _alloc((4, 4))) == []
    assert check_allocation(_cfg(), _alloc((8, 8))) == [
        "4 of the 8 GPUs per node stay idle (cluster.devices_per_node=4)"]


def test_srun_line_is_the_layout():
    cmd = srun_command(RankLayout(2, 4, ("n1", "n2")), 8, 3, Path("/r/x.config.json"),
                       python="/venv/bin/python")
    assert cmd == ["srun", "--mpi=pmix", "--nodes=2", "--ntasks=10", "--ntasks-per-node=5",
                   "--distribution=block", "--gres=gpu:8", "--cpus-per-task=3",
                   "--kill-on-bad-exit=1", "/venv/bin/python", "-m", "pivotrl_hpc.launch.entry",
                   "/r/x.config.json"]


def test_placement_names_the_host_of_every_rank():
    layout = RankLayout(2, 1, ("n1", "n2"), hosts=("a", "a", "b", "b"))
    assert [(p["rank"], p["kind"], p["device"], p["host"]) for p in layout.placement()] == [
        (0, "agent", None, "a"), (1, "worker", 0, "a"), (2, "agent", None, "b"),
        (3, "worker", 1, "b")]
    assert RankLayout(1, 1, ("n1",)).placement()[0]["host"] is None
