"""Partial rollout within the staleness bound: a lever beyond the paper (off by default).

The paper's rule (controller/rl.py): prompt i trains in step i // batch_size, so step b waits
for batch b's slowest sample (its longest response, then that response's judgement) while
newer batches are held by the staleness bound. Partial rollout (Kimi k1.5, AReaL) instead
forms a step's batch from finished work and lets unfinished sequences run on into a later
step. Here the unit is a GRPO group (a prompt's `group_size` samples, whose advantages are
normalised together), and the staleness bound k stays exact:

- a group admitted while the oldest policy any rollout replica serves is v generates every
  token under v or newer, so it may train in any step up to v + k: its **deadline**;
- step s trains `size` complete groups chosen earliest deadline first (ties: admission
  order): every group whose deadline is s must be among them, so the step waits for those
  only, not for a batch fixed at admission;
- a choice is made only if it leaves every later step feasible: after step s, at most
  (d - s) x size untrained groups may have a deadline <= d, for every d > s. Admission
  keeps the same invariant by admitting group i only while i // size <= v + k (the paper's
  count), so a step never has more than `size` groups due.

A trained group's lag is its step minus the oldest version that generated its tokens, at
most its deadline minus its admission version: k. Pure: no I/O, no clocks.

Measured (issue 50; `pivotrl reproduce --only partial --seeds 1`, 8 steps, seed 0;
processed tokens/s over the protocol's window), over PivotRL as the paper: at ae11e6b's
calibration 1.5B 1.034x, 7B 0.979x, 32B 1.000x, 72B 0.992x (at b78959e's 1.034x, 1.020x,
1.017x, 1.007x): below the 1.05x goal. What it buys
is the fill: batches 0..k are admitted against v0 and share deadline k, so steps 0 and 1 no
longer wait for batch 0's and 1's slowest group, and every later step ends 40-50 s sooner by
the same constant. After the fill nothing changes, and nothing can by choosing groups: the
groups admitted when version v is published are all due by step v + k, so step v + k still
starts after the slowest of them (its longest judgement, at paper lengths the 20K cap) is
judged, in the paper's batches and here alike. Kept, off, as the measured ablation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Group:
    """A GRPO group as batch formation sees it."""
    gid: int           # admission order (the prompt's index in the run)
    deadline: int      # the last step it may train in (admission version + k)
    complete: bool     # every sample judged


def deadline(version: int, staleness: int) -> int:
    """The last step a group admitted against policy `version` may train in."""
    return version + staleness


def form_batch(groups: Sequence[Group], step: int, size: int) -> list[int] | None:
    """The groups (ids, in admission order) step `step` trains, or None while it must wait:
    a group due now is not complete, fewer than `size` are complete, or the choice would
    leave a later step more than `size` groups due (it waits for one of them instead)."""
    late = [g.gid for g in groups if g.deadline < step]
    if late:
        raise ValueError(f"groups {late[:8]} are past their deadline at step {step}: "
                         "a step before did not train them")
    if sum(g.deadline == step for g in groups) > size:
        raise ValueError(f"step {step} has more than {size} groups due: admission broke "
                         "the staleness bound's count")
    ready = sorted((g for g in groups if g.complete), key=lambda g: (g.deadline, g.gid))
    if len(ready) < size:
        return None
    chosen = {g.gid for g in ready[:size]}
    # a group due now left out (not complete) leaves step `step` itself infeasible
    if not feasible([g for g in groups if g.gid not in chosen], step, size):
        return None
    return sorted(chosen)


def feasible(left: Sequence[Group], step: int, size: int) -> bool:
    """After step `step` trains, the groups `left` fit the steps up to their deadlines:
    for each deadline d, at most (d - step) x size of them are due by d."""
    due = 0
    for d in sorted({g.deadline for g in left}):
        due += sum(g.deadline == d for g in left)
        if due > (d - step) * size:
            return False
    return True
