"""Running the policy's decision beside the loop, so that planning never blocks Dispatch.

`ThreadDecider` (live) decides on a worker thread over an immutable snapshot; the loop polls
for the result and re-checks the plan against the state of that moment before executing it.
`InlineDecider` (simulation, tests) decides at once, deterministically.
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

    def start(self, policy: AllocationPolicy, snap: WorkloadSnapshot) -> None: ...

    def poll(self) -> Decision | None: ...

    def close(self) -> None: ...


class InlineDecider:
    def __init__(self) -> None:
        self._result: Decision | None = None
        self.busy = False

    def start(self, policy: AllocationPolicy, snap: WorkloadSnapshot) -> None:
        self._result = decide(policy, snap)

    def poll(self) -> Decision | None:
        result, self._result = self._result, None
        return result

    def close(self) -> None:
        self._result = None


class ThreadDecider:
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
