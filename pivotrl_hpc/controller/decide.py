"""Running the policy's decision beside the loop, so that planning never blocks Dispatch.

`ThreadDecider` (live) decides on a worker thread over an immutable snapshot; the loop polls
for the result and re-checks the plan against the state of that moment before executing it.
`InlineDecider` (simulation, tests) decides at once, deterministically; given a clock and
`delay_s` (the simulator: the planner's decision time, sim/costs.py) it hands the plan over
that much later, as the thread would, and is busy meanwhile.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from pivotrl_hpc.plan.snapshot import WorkloadSnapshot
from pivotrl_hpc.plan.types import AllocationPolicy, ShiftPlan

Decision = tuple[WorkloadSnapshot, "ShiftPlan | None", Any, float]  # snap, plan, report, s


def decide(policy: AllocationPolicy, snap: WorkloadSnapshot) -> Decision:
    """The plan and, for the planner, its full report (candidates, penalties, benefits)."""
    t0 = time.perf_counter()
    explain = getattr(policy, "explain", None)
    if explain is not None:
        report = explain(snap)
        plan = report.plan
    else:
        report, plan = None, policy.decide(snap)
    return snap, plan, report, time.perf_counter() - t0


class Decider(Protocol):
    busy: bool
    ready_at: float | None   # when a pending decision is handed over (None: not known)

    def start(self, policy: AllocationPolicy, snap: WorkloadSnapshot) -> None: ...

    def poll(self) -> Decision | None: ...

    def close(self) -> None: ...


class InlineDecider:
    def __init__(self, clock: Any = None, delay_s: float = 0.0) -> None:
        if delay_s < 0 or (delay_s and clock is None):
            raise ValueError(f"a decision delay ({delay_s} s) needs a clock and >= 0 s")
        self.clock, self.delay_s = clock, delay_s
        self._result: Decision | None = None
        self.ready_at: float | None = None

    @property
    def busy(self) -> bool:
        return self.ready_at is not None and self.clock.now() < self.ready_at

    def start(self, policy: AllocationPolicy, snap: WorkloadSnapshot) -> None:
        self._result = decide(policy, snap)
        if self.delay_s:   # its seconds: the decision time charged, not this host's
            self._result = (*self._result[:3], self.delay_s)
            self.ready_at = self.clock.now() + self.delay_s

    def poll(self) -> Decision | None:
        if self.busy:
            return None
        result, self._result, self.ready_at = self._result, None, None
        return result

    def close(self) -> None:
        self._result, self.ready_at = None, None


class ThreadDecider:
    ready_at = None   # on the thread's own time

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="planner")
        self._future: Future | None = None

    @property
    def busy(self) -> bool:
        return self._future is not None and not self._future.done()

    def start(self, policy: AllocationPolicy, snap: WorkloadSnapshot) -> None:
        if self._future is not None:
            raise RuntimeError("a decision is already being made")
        self._future = self._pool.submit(decide, policy, snap)

    def poll(self) -> Decision | None:
        if self._future is None or not self._future.done():
            return None
        future, self._future = self._future, None
        return future.result()  # a planner exception surfaces in the loop

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
