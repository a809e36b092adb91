"""The report's PNGs (matplotlib, Agg: no display needed).

- allocation.png (paper Figure 10): devices per role over time, shifts marked, and each
  role's throughput;
- low_throughput.png (Figure 3): per role, the fraction of its time below 20 % of its peak
  per-device throughput;
- steps.png: reward, validation accuracy and loss per RL step;
- shift_phases.png: mean seconds of each phase, per shift kind.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pivotrl_hpc.report.timeline import ROLES, group_of, role_series

COLORS = {"rollout": "#1f77b4", "reward": "#d62728", "training": "#2ca02c", "idle": "#bbbbbb"}


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def allocation(ts: dict, shifts: dict, path: Path, title: str) -> None:
    plt = _plt()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for role in ROLES:
        r = role_series(ts, role)
        if len(r["t"]):
            top.step(r["t"], r["devices"], where="post", color=COLORS[role], label=role)
            bottom.plot(r["t"], r["tokens_per_s"], color=COLORS[role], label=role)
    for t, role, direction in zip(shifts["t"], shifts["role"], shifts["direction"]):
        top.axvline(float(t), color=COLORS.get(str(role), "k"), alpha=0.3,
                    linestyle="-" if direction == "up" else ":", linewidth=0.8)
    top.set_ylabel("devices")
    top.set_title(f"{title}: devices per role (lines: shifts, solid up, dotted down)")
    top.legend(loc="upper right")
    bottom.set_ylabel("tokens/s")
    bottom.set_xlabel("seconds since start")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def low_throughput(fractions: dict[str, float | None], path: Path, title: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    roles = [r for r in ROLES if fractions.get(r) is not None]
    ax.bar(roles, [fractions[r] for r in roles], color=[COLORS[r] for r in roles])
    ax.set_ylim(0, 1)
    ax.set_ylabel("fraction of time")
    ax.set_title(f"{title}: below 20 % of peak per-device tokens/s", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def steps(table: dict, path: Path, title: str) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    x = table["step"]
    axes[0].errorbar(x, table["reward_mean"], yerr=table["reward_std"], marker="o")
    axes[0].set_title("reward (mean ± std)")
    val = ~np.isnan(table["val_accuracy"])
    axes[1].plot(x[val], table["val_accuracy"][val], marker="o", color="#9467bd")
    axes[1].set_title("validation accuracy")
    axes[2].plot(x, table["loss"], marker="o", color="#8c564b")
    axes[2].set_title("loss")
    for ax in axes:
        ax.set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def shift_phases(means: dict[str, dict], path: Path, title: str) -> None:
    plt = _plt()
    kinds = list(means)
    fig, ax = plt.subplots(figsize=(10, 1 + 0.5 * max(len(kinds), 1)))
    phases = sorted({p for m in means.values() for p in m["phases"]
                     if group_of(p, m["phases"]) is None})   # a group once, as its total
    cmap = plt.get_cmap("tab20")
    left = np.zeros(len(kinds))
    for j, p in enumerate(phases):
        vals = np.array([means[k]["phases"].get(p, 0.0) for k in kinds])
        ax.barh(kinds, vals, left=left, color=cmap(j % 20), label=p)
        left += vals
    ax.set_xlabel("mean seconds")
    ax.set_title(f"{title}: shift phases")
    if phases:
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

