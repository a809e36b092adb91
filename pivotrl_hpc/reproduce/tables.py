"""What `pivotrl reproduce` prints of Figure 9: per group, ours beside the paper's bar for
every paradigm and every ratio (shiftable over each baseline), as the issue-50 protocol
measures them (sim/measure.py)."""
from __future__ import annotations

from pivotrl_hpc.sim.measure import DRAIN_STEPS, FILL_STEPS, RUN_STEPS

PROCESSED = "processed_tokens_per_s"


def _num(v, fmt: str, suffix: str = "") -> str:
    """`v` formatted (`fmt` holds the width) or "-" in that width."""
    width = int(fmt.split(".")[0])
    return ("-" if v is None else format(v, fmt).strip() + suffix).rjust(width)


def fig9_lines(g: dict) -> list[str]:
    """One group's rows of the `fig9` result (reproduce/experiments.py `_fig9_group`):
    tokens/s ours | paper | ours/paper per paradigm, then shiftable over each baseline
    ours | paper | ours/paper."""
    lines = [f"  Figure 9, {g['title']}: tokens/s generated between the ends of steps "
             f"{FILL_STEPS} and {RUN_STEPS - DRAIN_STEPS} (sim/measure.py)",
             f"    {'':33} {'ours':>9} {'paper':>9} {'ours/paper':>10}"]
    for p, o in g["ours"].items():
        ours, bar = o.get(PROCESSED), g["paper_tokens_per_s"].get(p)
        lines.append(f"    {p:33} {_num(ours, '9.0f')} {_num(bar, '9.0f')} "
                     f"{_num(ours / bar if ours and bar else None, '10.2f')}"
                     + (f"  {o['error']}" if "error" in o else ""))
    for p, v in g["speedup_vs"].items():
        bar = g["paper_speedup_vs"].get(p)
        lines.append(f"    {'shiftable / ' + p:33} {_num(v, '9.2f', 'x')} "
                     f"{_num(bar, '9.2f', 'x')} {_num(v / bar if bar else None, '10.2f')}")
    return lines
