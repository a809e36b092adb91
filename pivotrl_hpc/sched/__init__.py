"""Shift-aware scheduling (paper §6, appendices A and C): pure, deterministic, no I/O."""
from pivotrl_hpc.sched.fit import FitResult, ThroughputSample, fit_throughput_model
from pivotrl_hpc.sched.index import DispatchIndex, OpCounter
from pivotrl_hpc.sched.model import BinaryThroughputModel, ReplicaThroughput, ThroughputModel
from pivotrl_hpc.sched.scheduler import AbortSpec, MigrationResult, Move, Scheduler
from pivotrl_hpc.sched.state import KVOverflow, Replica, SchedulerError, Sequence, WaitingQueue

__all__ = [
    "AbortSpec", "BinaryThroughputModel", "DispatchIndex", "FitResult", "KVOverflow",
    "MigrationResult", "Move", "OpCounter", "Replica", "ReplicaThroughput", "Scheduler",
    "SchedulerError", "Sequence", "ThroughputModel", "ThroughputSample", "WaitingQueue",
    "fit_throughput_model",
]
