"""Figure 9's measurement protocol, the same for every paradigm, simulated or live.

The paper (§8.1): "We evaluate system performance by end-to-end throughput, defined as the
total tokens processed over several steps divided by the total time." What is counted here:
the tokens the rollout and the reward generate (responses and judgements: the two roles
Equation 1 and Figure 10 measure, docs/calibration.md has why not trained tokens), between
the ends of two RL steps, over the seconds between them.

Which steps: a job that overlaps steps (disaggregated, rr_colocated, shiftable; staleness 2)
fills its pipeline first (batch 1 is generated with nothing to train beside it) and drains it
last (the last batches train after generation has stopped: no batch past `rl.steps` is ever
admitted). Colocated runs every step in turn, so every window of it is the same. The window
opens at the end of step FILL_STEPS and closes at the end of step steps - DRAIN_STEPS; the
run is RUN_STEPS long. docs/calibration.md has the simulated traces these were chosen from.
A run too short for the window (`pivotrl reproduce --quick`: 1 step) is measured from its
start to its last step's end, as before.
"""
from __future__ import annotations

from dataclasses import dataclass

RUN_STEPS = 8      # RL steps a run (the calibration's, Figure 9's, `pivotrl simulate`'s)
FILL_STEPS = 2     # steps that end before the window opens
DRAIN_STEPS = 2    # steps that end after the window closes


@dataclass(frozen=True)
class Window:
    first_step: int     # the window opens at this step's end (0: the run's start)
    last_step: int      # and closes at this step's end
    t0: float
    t1: float
    tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.t1 - self.t0) if self.t1 > self.t0 else 0.0

    def to_dict(self) -> dict:
        return {"first_step": self.first_step, "last_step": self.last_step,
                "t0": round(self.t0, 3), "t1": round(self.t1, 3), "tokens": self.tokens,
                "tokens_per_s": self.tokens_per_s}


def window(step_marks: list[list[float]], fill: int = FILL_STEPS,
           drain: int = DRAIN_STEPS) -> Window | None:
    """The steady window of a run's `step_marks` ([t, generated tokens so far] at each
    step's end, the summary's): from step `fill`'s end to step (n - drain)'s. Fewer than
    fill + drain + 1 steps: from the start (t 0, no tokens) to the last step's end. None
    without a step."""
    n = len(step_marks)
    if n == 0:
        return None
    if n <= fill + drain:
        t1, g1 = step_marks[-1]
        return Window(0, n, 0.0, float(t1), int(g1))
    (t0, g0), (t1, g1) = step_marks[fill - 1] if fill else (0.0, 0), step_marks[n - drain - 1]
    return Window(fill, n - drain, float(t0), float(t1), int(g1 - g0))


def processed_tokens_per_s(summary: dict, fill: int = FILL_STEPS,
                           drain: int = DRAIN_STEPS) -> float:
    """Figure 9's throughput of one run's summary under the protocol (module docstring);
    a summary without step marks (an older trace's): its whole run's generated tokens over
    its seconds."""
    w = window(summary.get("step_marks") or [], fill, drain)
    if w is None:
        return sum((summary.get("role_tokens_per_s") or {}).values())
    return w.tokens_per_s
