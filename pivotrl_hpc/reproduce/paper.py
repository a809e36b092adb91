"""The paper's published figures, as `pivotrl reproduce` sets ours beside them.

Read off the paper's text and figure labels (../shared/paper). Figure 9's bars carry the
throughput (tokens/s) and PivotRL's speed-up over each baseline; the labels come out of the
PDF unordered, so each value was placed by its ratio to PivotRL's bar and the ranges §8.2
gives (1.81-2.05x over colocated, 1.50-1.95x over disaggregated, 1.66-1.97x over
rollout-reward colocated). One placement does not fit those ranges: Qwen2.5-7B's
rollout-reward colocated bar (14189, 1.61x), the only one left for that group's rr ratio and
the group where the text says rr_colocated "achieves higher throughput". Figures 13 and 14
have no value labels: what the text says of them is kept as ranges.
"""
from __future__ import annotations

from pivotrl_hpc.sim.costs import PAPER_TABLE2

GROUPS = ("qwen2.5-1.5b_glm-z1-9b", "qwen2.5-7b_qwen3-30b-a3b", "qwen2.5-32b_qwen3-30b-a3b",
          "qwen2.5-72b_qwen3.5-122b-a10b")
TITLES = {"qwen2.5-1.5b_glm-z1-9b": "Qwen2.5-1.5B & GLM-Z1-9B",
          "qwen2.5-7b_qwen3-30b-a3b": "Qwen2.5-7B & Qwen3-30B-A3B",
          "qwen2.5-32b_qwen3-30b-a3b": "Qwen2.5-32B & Qwen3-30B-A3B",
          "qwen2.5-72b_qwen3.5-122b-a10b": "Qwen2.5-72B & Qwen3.5-122B-A10B"}

# Figure 9: end-to-end tokens/s of each paradigm (mean of 3 repeats)
FIG9 = {
    "qwen2.5-1.5b_glm-z1-9b": {"colocated": 27184, "disaggregated": 31176,
                               "rr_colocated": 25405, "shiftable": 50077},
    "qwen2.5-7b_qwen3-30b-a3b": {"colocated": 11545, "disaggregated": 11711,
                                 "rr_colocated": 14189, "shiftable": 22822},
    "qwen2.5-32b_qwen3-30b-a3b": {"colocated": 9998, "disaggregated": 13681,
                                  "rr_colocated": 11343, "shiftable": 20503},
    "qwen2.5-72b_qwen3.5-122b-a10b": {"colocated": 6915, "disaggregated": 7954,
                                      "rr_colocated": 7530, "shiftable": 12503},
}
FIG9_RANGES = {"colocated": (1.81, 2.05), "disaggregated": (1.50, 1.95),
               "rr_colocated": (1.66, 1.97)}

# Figure 10 (Qwen2.5-7B & Qwen3-30B-A3B, 32 GPUs): PivotRL's allocations as labelled, in
# order, [t, RO, RM, TR] with t the label's index (the figure's time axis is cut)
_RO = (32, 12, 8, 16, 12, 4, 0, 0, 4, 16, 12, 4, 0, 0, 4, 16, 8, 4, 0, 0)
_RM = (0, 20, 24, 16, 20, 28, 32, 24, 20, 16, 20, 28, 32, 24, 20, 16, 24, 28, 32, 24)
_TR = (0, 0, 0, 0, 0, 0, 0, 8, 0, 0, 0, 0, 0, 8, 0, 0, 0, 0, 0, 8)
FIG10_SHIFTABLE = [[i, ro, rm, tr] for i, (ro, rm, tr) in enumerate(zip(_RO, _RM, _TR))]

# Figure 3 (7B/30B, 32 GPUs): the text's findings (its bars carry no labels)
FIG3_TEXT = ("qualitative (§2): rollout has headroom under colocated and disaggregated, "
             "training idles under disaggregated, shiftable reduces every role's")

# Figure 11: throughput over disaggregated's, two groups (top: shift strategies, bottom:
# components; "shiftable" is PivotRL, which is also "vanilla + throughput model + migration")
FIG11 = {
    "qwen2.5-7b_qwen3-30b-a3b": {"static": 1.55, "rule_based": 1.31, "shiftable": 1.95,
                                 "vanilla": 1.79, "vanilla_tm": 1.87},
    "qwen2.5-1.5b_glm-z1-9b": {"static": 1.27, "rule_based": 1.05, "shiftable": 1.61,
                               "vanilla": 1.43, "vanilla_tm": 1.53},
}

# Figure 14 (Qwen2.5-7B & Qwen3-30B-A3B): H swept over these; §8.6 says throughput and
# shifts rise with H up to ~60, are steady for 60-120, and too many shifts cost at 600. The
# axes span ~21K-23K tokens/s and 4-6 shifts per step.
FIG14_H = (0.01, 5, 30, 60, 90, 120, 600)
FIG14_TEXT = ("small H: few shifts, lower throughput; H in 60-120 stable; 600: too many "
              "shifts. Axes: 21K-23K tokens/s, 4-6 shifts per step")

# Table 2: the planner's total seconds (mean) by GPU count; kept where the simulator
# charges them (sim/costs.py: a planner's decision is executed that much later)
TABLE2 = PAPER_TABLE2

# Figure 13 (Qwen2.5-7B policy, Qwen3-30B-A3B GenRM, 16-128 GPUs), from §8.5's text
FIG13_TEXT = {"shift_up_s": {"Qwen2.5-7B": (2.0, 3.0), "Qwen3-30B-A3B": (3.0, 4.0)},
              "shift_down_s_below": 2.0, "gpus": (16, 32, 64, 128)}

PAPER_SHIFT_RATIOS = {p: {g: FIG9[g]["shiftable"] / FIG9[g][p] for g in GROUPS}
                      for p in FIG9_RANGES}
