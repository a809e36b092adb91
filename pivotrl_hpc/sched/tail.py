"""Tail isolation: a Dispatch lever beyond the paper (off by default, the paper's Dispatch).

Why. A step trains only once every sample of its batch is judged, and with staleness s the
batch b+s+1 is admitted only when step b has published, so the run is bounded below by
chains of single samples: the batch's longest response, then its judgement, each decoding
at the per-token latency of the replica it sits on (docs/design.md, "Calibration").
A batch's judgements arrive as its responses finish, the longest last; Dispatch (Algorithm
2) places them by the largest ΔT_i, beside a hundred others of their own and the next
batches. Every token those hold is read again at each iteration (A·N_tok), and an MoE judge
touches more experts the more sequences decode: on the calibrated 7B group the last
judgement of a batch decoded at 10-12 ms a token against ~5.3 ms alone (20,480 tokens,
~110 s of the chain).

What. The last `late` sequences of a batch to reach the role (the judgements of its longest
responses) are its tail. Each tail sequence gets a replica to itself (a lane), up to `lanes`
lanes while at least two replicas are left for the rest: Dispatch picks the replica holding
the fewest tokens and evicts the sequences running there back to the waiting queue (each
resumes elsewhere with its tokens, as a KV preemption: its prompt and tokens are prefilled
again, ~25 replica-seconds a lane on the 7B group against ~100 s of the chain); past the
lanes, a tail sequence joins the lane holding the fewest tokens. Every other sequence is
placed by ΔT_i off the lanes (onto them only when nowhere else has room), and Algorithm 4's
migration loop leaves the lanes alone. Sequence ids are given in admission order, `batch`
to a batch (controller/rl.py), so `seq_id // batch` is a sequence's batch; a role whose
batch arrives at once (rollout: every prompt of a batch is admitted together) has no late
sequences and is not given the lever.

Measured (issue 50; 5-step runs, seed 0, shiftable): it loses. 7B: 896 -> 936 s at n = 2,
1,037 s at n = 4; `pivotrl reproduce --only tail`: 1.5B 0.871x, 7B 0.901x, 32B 1.000x,
72B 0.980x. A batch's judgements run long together to the end (the 10th-last of batch 3
ended 41 s before its last), so reward is bound by its throughput over the batch, not by one
sample's latency, and the arrival order does not name the longest judgement. Kept, off, as
the measured ablation.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pivotrl_hpc.sched.state import Replica

KEEP_BATCHES = 8   # batches whose arrivals are remembered (staleness + a margin)


@dataclass(frozen=True)
class TailIsolation:
    batch: int       # sequences a batch (prompts x group size): ids [k*batch, (k+1)*batch)
    late: int        # a batch's last this many sequences to arrive are its tail
    lanes: int = 1   # replicas a tail sequence may have to itself, at most

    def __post_init__(self) -> None:
        if self.batch < 1 or not 1 <= self.late <= self.batch or self.lanes < 1:
            raise ValueError(f"tail isolation needs batch >= 1, 1 <= late <= batch and "
                             f"lanes >= 1, got batch {self.batch}, late {self.late}, "
                             f"lanes {self.lanes}")


@dataclass
class Tails:
    """Which sequences are tails: each batch's arrivals, in order (pure bookkeeping)."""
    spec: TailIsolation
    arrived: dict[int, set[int]] = field(default_factory=dict)   # batch -> ids seen
    tails: set[int] = field(default_factory=set)

    def arrive(self, seq_id: int) -> bool:
        """Record a sequence reaching Dispatch (a resumed one again: no change); whether it
        is a tail, i.e. at least batch - late of its batch arrived before it."""
        b = seq_id // self.spec.batch
        seen = self.arrived.get(b)
        if seen is None:
            seen = self.arrived[b] = set()
            for old in [k for k in self.arrived if k < b - KEEP_BATCHES]:
                done = self.arrived.pop(old)
                self.tails -= done
        if seq_id not in seen:
            if len(seen) >= self.spec.batch - self.spec.late:
                self.tails.add(seq_id)
            seen.add(seq_id)
        return seq_id in self.tails

    def copy(self) -> "Tails":
        return Tails(self.spec, {b: s.copy() for b, s in self.arrived.items()},
                     self.tails.copy())

    def lanes(self, replicas: list[Replica]) -> set[str]:
        """The replicas running a tail sequence."""
        tails = self.tails
        return {r.replica_id for r in replicas if r.seqs and not tails.isdisjoint(r.seqs)}


def fewest_tokens(replicas: list[Replica], length: int) -> int | None:
    """Position of the replica with room for `length` tokens holding the fewest tokens
    (ties: fewer sequences, then the lowest position), or None."""
    best, best_key = None, None
    for pos, r in enumerate(replicas):
        if r.capacity - r.n_tok >= length:
            key = (r.n_tok, r.n_seq, pos)
            if best_key is None or key < best_key:
                best, best_key = pos, key
    return best
