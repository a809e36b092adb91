"""What the simulator charges beside decode, prefill, shifts and training steps (issue 49):
the GPS Write of each published policy, the rollout replicas' Reload of it, and the
planner's decision time. Each was charged as zero before.

- GPS Write (§5.1, Appendix B.1): the training GPUs of DP rank 0 copy their shards into
  their node's CPU memory over PCIe (in parallel: one shard's bytes per GPU), which ends
  the TrainStep as the live worker's `gps_write_submit` does; the replication to every node
  (replication-first GPS: every node holds a copy) is what WaitWrite waits on, the chain
  plan of the agents over the cluster's links (`sim.profile.replication`, the model Figure
  13 reports). The live controller publishes the version, and admits against it, only
  after WaitWrite.
- Reload: a rollout replica Reads the published version node-locally over PCIe (Appendix
  B.1: every Read is node-local), one TP shard per GPU: a shift up's Read without the
  engine's wake.
- Planning: the planner decides beside the loop (§8.5, "the planner runs concurrently
  with RL execution"), so its plan is executed that much later, on the state of then. The
  seconds are the paper's Table 2 (its planner on the paper's cluster), at the run's GPU
  count; a fixed policy's or a heuristic's decision is a few comparisons (microseconds)
  and costs nothing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pivotrl_hpc.gps.shapes import ModelShape, itemsize

if TYPE_CHECKING:
    from pivotrl_hpc.config.schema import Config
    from pivotrl_hpc.sim.profile import Hardware

# Table 2 of the paper: the planner's total seconds a decision by GPU count, per group
PAPER_TABLE2 = {"qwen2.5-1.5b_glm-z1-9b": {16: 0.31, 32: 0.74, 64: 1.71, 128: 2.95},
                "qwen2.5-7b_qwen3-30b-a3b": {32: 0.55, 64: 1.16, 128: 2.81}}


def gps_costs(cfg: Config, shape: ModelShape, hw: Hardware) -> dict[str, float]:
    """Seconds of the policy's GPS Write (its local part, its replication) and of one
    rollout replica's Reload, for the cluster and parallelism `cfg` describes."""
    from pivotrl_hpc.sim.profile import replication

    nbytes = shape.num_params() * itemsize(cfg.models.policy.dtype)
    tp, per_node = cfg.roles.train_tensor_parallel, cfg.cluster.devices_per_node
    writers = -(-tp // per_node)   # the nodes DP rank 0's TP group spans
    return {"write_local_s": nbytes / tp / hw.pcie_bps,
            "write_replication_s": replication(nbytes, cfg.cluster.nodes, writers,
                                               hw)["write_replication_s"],
            "reload_s": nbytes / cfg.models.policy.tensor_parallel / hw.pcie_bps}


def planning_seconds(gpus: int) -> float:
    """Table 2's seconds at `gpus`: the mean of the groups measured there, linear between
    the GPU counts it lists, its first and last figure outside them (nothing beyond what
    the paper measured)."""
    counts = sorted({g for row in PAPER_TABLE2.values() for g in row})
    mean = [sum(r[g] for r in PAPER_TABLE2.values() if g in r)
            / sum(g in r for r in PAPER_TABLE2.values()) for g in counts]
    if gpus <= counts[0]:
        return mean[0]
    for (lo, a), (hi, b) in zip(zip(counts, mean), zip(counts[1:], mean[1:])):
        if gpus <= hi:
            return a + (b - a) * (gpus - lo) / (hi - lo)
    return mean[-1]
