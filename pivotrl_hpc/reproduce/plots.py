"""PNGs of the reproduced figures, ours beside the paper's (matplotlib, Agg)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pivotrl_hpc.report.figures import COLORS, _plt

OURS, PAPER = "#1f77b4", "#bbbbbb"


def _pairs(ax, labels, ours, published, ylabel: str, title: str) -> None:
    """Bars of ours beside the paper's for each label (a missing paper value: no bar)."""
    x = np.arange(len(labels))
    ax.bar(x - 0.2, ours, 0.4, color=OURS, label="simulated")
    ax.bar(x + 0.2, [np.nan if v is None else v for v in published], 0.4, color=PAPER,
           label="paper")
    ax.set_xticks(x, labels, rotation=20, fontsize=7)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_title(title, fontsize=8)
    ax.axhline(1.0, color="black", lw=0.5)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _plt().close(fig)
    return path


def _per_group(result: dict, path: Path, key: str, paper_key: str, ylabel: str,
               title: str, width: float) -> Path:
    """One panel a group: ours beside the paper's for every entry of `key`."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(result), figsize=(width * len(result), 3.2), squeeze=False)
    for ax, g in zip(axes[0], result.values()):
        names = list(g[key])
        _pairs(ax, names, [g[key][p] for p in names], [g[paper_key].get(p) for p in names],
               ylabel, g["title"])
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def fig9(result: dict, path: Path) -> Path:
    """Top: each paradigm's tokens/s beside the paper's bar; bottom: the speed-ups."""
    plt = _plt()
    groups = list(result.values())
    fig, axes = plt.subplots(2, len(groups), figsize=(3.2 * len(groups), 6), squeeze=False)
    for top, bottom, g in zip(axes[0], axes[1], groups):
        names = list(g["ours"])
        _pairs(top, names, [g["ours"][p].get("processed_tokens_per_s", np.nan) for p in names],
               [g["paper_tokens_per_s"].get(p) for p in names], "tokens/s", g["title"])
        names = list(g["speedup_vs"])
        _pairs(bottom, names, [g["speedup_vs"][p] for p in names],
               [g["paper_speedup_vs"].get(p) for p in names], "shiftable / baseline",
               g["title"])
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Figure 9: throughput and PivotRL's speed-up over each baseline", fontsize=9)
    return _save(fig, path)


def fig10(result: dict, path: Path) -> Path:
    """Devices per role over time: our shiftable run's and the paper's labelled ones."""
    plt = _plt()
    panels = [("ours: shiftable (virtual s)", result["ours"].get("shiftable", {})
               .get("allocation", [])),
              ("paper: labelled allocations (in order)", result["paper"]["allocation"])]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, (name, rows) in zip(axes, panels):
        for i, role in enumerate(("rollout", "reward", "training")):
            ax.step([r[0] for r in rows], [r[1 + i] for r in rows], where="post",
                    color=COLORS[role], label=role)
        ax.set_title(name, fontsize=8)
        ax.set_ylabel("devices", fontsize=8)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Figure 10: {result['title']}", fontsize=9)
    return _save(fig, path)


def fig11(result: dict, path: Path) -> Path:
    return _per_group(result, path, "over_disaggregated", "paper_over_disaggregated",
                      "tokens/s over disaggregated",
                      "Figure 11: shift strategies and components", 4.2)


def fig3(result: dict, path: Path) -> Path:
    plt = _plt()
    fractions = result["fraction_below_low"]
    paradigms = list(fractions)
    roles = ("rollout", "reward", "training")
    fig, ax = plt.subplots(figsize=(6, 3.2))
    x = np.arange(len(paradigms))
    for i, role in enumerate(roles):
        vals = [np.nan if fractions[p].get(role) is None else fractions[p][role]
                for p in paradigms]
        ax.bar(x + (i - 1) * 0.27, vals, 0.27, color=COLORS[role], label=role)
    ax.set_xticks(x, paradigms, fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("fraction of time below 20 % of peak", fontsize=8)
    ax.set_title(f"Figure 3: {result['title']} (simulated)", fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, path)


def _two_panels(xlabel: str, base: float):
    """A figure of two panels side by side over one log x axis."""
    fig, axes = _plt().subplots(1, 2, figsize=(8, 3.2))
    for ax in axes:
        ax.set_xscale("log", base=base)
        ax.set_xlabel(xlabel, fontsize=8)
    return fig, axes


def fig14(result: dict, path: Path) -> Path:
    pts = result["points"]
    hs = [p["H"] for p in pts]
    fig, (left, right) = _two_panels("H (s)", 10)
    left.errorbar(hs, [p["tokens_per_s"] for p in pts], [p["std"] for p in pts],
                  marker="o", color=OURS)
    left.set_ylabel("tokens/s", fontsize=8)
    right.plot(hs, [p["shifts_per_step"] for p in pts], marker="o", color=OURS)
    right.set_ylabel("device shifts per step", fontsize=8)
    fig.suptitle(f"Figure 14: {result['title']} (simulated); paper: {result['paper']}",
                 fontsize=7)
    return _save(fig, path)


def fig13(result: dict, path: Path) -> Path:
    rows = result["rows"]
    gpus = [r["gpus"] for r in rows]
    fig, (up, down) = _two_panels("GPUs", 2)
    for role in ("rollout", "reward", "training"):
        up.plot(gpus, [r[role][0] for r in rows], "o-", color=COLORS[role], label=role)
        down.plot(gpus, [r[role][1] for r in rows], "o-", color=COLORS[role], label=role)
    up.plot(gpus, [r["write_replication_s"] for r in rows], "s--", color="black",
            label="GPS Write replication (chain)")
    up.plot(gpus, [r["write_replication_star_s"] for r in rows], "x:", color="black",
            label="GPS Write replication (star, before)")
    up.set_yscale("log")
    for (lo, hi), c in zip(result["paper"]["shift_up_s"].values(), ("#999999", "#555555")):
        up.axhspan(lo, hi, color=c, alpha=0.2)
    down.axhline(result["paper"]["shift_down_s_below"], color="#999999", ls=":")
    for ax, name in ((up, "shift up"), (down, "shift down")):
        ax.set_ylabel(f"{name} seconds", fontsize=8)
    up.legend(fontsize=6)
    fig.suptitle(f"Figure 13: {result['title']} (profile; bands and line: the paper's text)",
                 fontsize=8)
    return _save(fig, path)


def table2(result: dict, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    rows = result["rows"]
    ax.plot([r["gpus"] for r in rows], [r["total_s"] for r in rows], "o-", color=OURS,
            label="ours (synthetic snapshot)")
    for (name, vals), c in zip(result["paper_total_s"].items(), ("#999999", "#555555")):
        ax.plot(list(vals), list(vals.values()), "s--", color=c, label=f"paper {name}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs", fontsize=8)
    ax.set_ylabel("planner seconds per decision", fontsize=8)
    ax.legend(fontsize=6)
    ax.set_title("Table 2: planner wall time", fontsize=9)
    return _save(fig, path)


def beyond(result: dict, path: Path) -> Path:
    """Each planner variant's tokens/s (mean, and every seed's run)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    names = list(result["mean"])
    ax.bar(range(len(names)), [result["mean"][n] for n in names], color=OURS)
    for i, n in enumerate(names):
        ax.plot([i] * len(result["tokens_per_s"][n]), result["tokens_per_s"][n], "k.")
    ax.set_xticks(range(len(names)), names, fontsize=7)
    ax.set_ylabel("tokens/s", fontsize=8)
    ax.set_title(f"Beyond the paper: online fit vs fixed constants, {result['title']}",
                 fontsize=8)
    return _save(fig, path)


LEVERS = {"tail": "+ tail isolation", "partial": "+ partial rollout"}


def lever(result: dict, path: Path) -> Path:
    """Per group: PivotRL as the paper states it and with a lever beyond it (tail isolation,
    partial rollout; mean, and each seed's run), the ratio above each pair."""
    plt = _plt()
    groups = list(result["groups"].values())
    ours = result.get("name", "tail")
    fig, ax = plt.subplots(figsize=(1.6 * len(groups) + 1.5, 3.2))
    x = np.arange(len(groups))
    for dx, name, color in ((-0.2, "paper", PAPER), (0.2, ours, OURS)):
        ax.bar(x + dx, [g[f"{name}_mean"] for g in groups], 0.4, color=color,
               label="PivotRL (paper)" if name == "paper" else LEVERS[ours])
        for i, g in enumerate(groups):
            ax.plot([i + dx] * len(g[name]), g[name], "k.", ms=3)
    for i, g in enumerate(groups):
        ax.annotate(f"{g['ratio']:.3f}x", (i, max(g["paper_mean"], g[f"{ours}_mean"])),
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, [g["title"] for g in groups], rotation=15, fontsize=6)
    ax.set_ylabel("processed tokens/s", fontsize=8)
    ax.set_title(f"Beyond the paper: {result['lever']} (goal {result['goal']}x)", fontsize=8)
    ax.legend(fontsize=7)
    return _save(fig, path)


PLOTS = {"fig9": fig9, "fig10": fig10, "fig3": fig3, "fig11": fig11, "fig13": fig13,
         "fig14": fig14, "table2": table2, "beyond": beyond, "tail": lever,
         "partial": lever}
