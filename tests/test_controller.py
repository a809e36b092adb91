"""The controller loop on modeled workers (virtual time): every paradigm completes, nothing
is lost, staleness holds, failures surface, the executor keeps the paper's order."""
from __future__ import annotations

from collections import Counter

import pytest

from controller_util import make_controller, split_bootstrap
from live_util import assert_trace_ok
from pivotrl_hpc.controller.flow import ControllerError
from pivotrl_hpc.controller.rl import lag
from pivotrl_hpc.protocol.messages import Prepare, Step

FIXED = ("colocated", "disaggregated", "rr_colocated")


def run(paradigm, **kw):
    train = tuple(range(8)) if paradigm == "colocated" else (0, 1, 2, 3)
    if paradigm == "colocated":
        kw.setdefault("staleness", 0)
    if paradigm == "disaggregated":
        kw.setdefault("params", {"rollout_gpus": 2, "reward_gpus": 2})
    boot = None if paradigm in FIXED else split_bootstrap()
    ctl, workers = make_controller(paradigm, train=train, bootstrap=boot, **kw)
    return ctl, workers, ctl.run()


class Rows:
    """A trace stand-in that keeps rows in memory (the HDF5 trace is tested on its own)."""

    def __init__(self):
        self.rows = {}

    def append(self, table, **row):
        self.rows.setdefault(table, []).append(row)

    def flush(self):
        pass


@pytest.mark.parametrize("paradigm", ["colocated", "disaggregated", "rr_colocated",
                                      "shiftable", "static", "rule_based", "vanilla",
                                      "vanilla_tm"])
def test_every_paradigm_trains_every_admitted_sample(paradigm):
    ctl, workers, summary = run(paradigm)
    assert summary["steps"] == 3
    samples = [s for s in ctl.book.samples.values() if s.batch >= 0]
    assert len(samples) == 3 * 4 * 4
    assert Counter(s.state for s in samples) == {"trained": 48}
    k = 0 if paradigm == "colocated" else 2
    assert max(lag(s) for s in samples) <= k
    assert summary["max_lag"] <= k
    for w in workers:  # every worker got Shutdown, last
        assert w.log[-1] == "Shutdown"


@pytest.mark.parametrize("paradigm, migrates", [("shiftable", True), ("vanilla", False),
                                                ("vanilla_tm", False)])
def test_only_the_full_planner_migrates_on_shift_up(paradigm, migrates):
    """Figure 11's components: vanilla and vanilla + throughput model run without shift-up
    migration (the executor's, not only the planner's estimate of it)."""
    trace = Rows()
    _, workers, _ = run(paradigm, trace=trace, steps=6)
    # a shift-up migration aborts its sequences on their running source replica (a shift
    # down's sequences come back with its reply instead); no preemption on this workload
    assert not any(r["event"] == "preempt" for r in trace.rows["sequences"])
    aborts = sum(w.log.count("Abort") for w in workers)
    assert (aborts > 0) == migrates, aborts


def test_sequences_finish_exactly_once_and_resume_their_tokens():
    trace = Rows()
    ctl, _, _ = run("shiftable", trace=trace)
    events = Counter((r["role"], r["seq_id"]) for r in trace.rows["sequences"]
                     if r["event"] == "finish")
    assert set(events.values()) == {1}
    assert len(events) == 2 * 48  # each sample: one rollout, one judgement
    migrated = [r for r in trace.rows["sequences"] if r["event"] in ("migrate", "abort")]
    assert migrated, "the shiftable run should move sequences between replicas"
    # tokens after resume continue the tokens before abort: the modeled engine's tokens
    # are a function of (id, position), and the controller checks every finish against
    # its record (ControllerError otherwise) - so reaching here proves continuity.
    for s in ctl.book.samples.values():
        assert len(s.response) == s.budget


def test_shiftable_shifts_every_way_and_records_phases():
    trace = Rows()
    _, _, summary = run("shiftable", trace=trace, steps=6)   # 3 steps see no reward->rollout
    kinds = summary["shifts_by_kind"]
    assert kinds.get("rollout->reward", 0) > 0 and kinds.get("reward->training", 0) + \
        kinds.get("rollout->training", 0) > 0
    assert all(r["phases"]["total"] > 0 for r in trace.rows["shifts"])
    planner = trace.rows["planner"]
    assert any(r["executed"] and r["candidates"] for r in planner)
    chosen = [r for r in planner if r["executed"] and r["policy"] == "shiftable"]
    assert all("benefit" in r["candidates"][r["chosen"]] for r in chosen if r["chosen"] >= 0)


def test_kv_overflow_preempts_and_loses_nothing():
    ctl, workers = make_controller("shiftable", bootstrap=split_bootstrap())
    for role in ("rollout", "reward"):
        ctl.cfg.kv_capacity[role] = 60  # a few sequences fill a replica
    summary = ctl.run()
    assert summary["steps"] == 3
    samples = [s for s in ctl.book.samples.values() if s.batch >= 0]
    assert all(s.state == "trained" and len(s.response) == s.budget for s in samples)


def test_staleness_zero_is_synchronous_and_holds_admission():
    ctl, _, summary = run("shiftable", staleness=0)
    assert summary["max_lag"] == 0
    assert summary["staleness_held_s"] > 0


def test_worker_failure_names_the_device_and_shuts_everyone_down():
    ctl, workers = make_controller("shiftable", bootstrap=split_bootstrap(), fail_on=Step)
    with pytest.raises(ControllerError, match=r"Step failed on device [4-7]"):
        ctl.run()
    assert all(w.log[-1] == "Shutdown" for w in workers)


def test_the_stop_check_runs_every_iteration_and_its_stop_shuts_everyone_down():
    """The live loop's backstop for a lost stop signal (launch.stop.Stopper.check)."""
    ctl, workers = make_controller("shiftable", bootstrap=split_bootstrap())
    calls = []

    def check() -> None:
        calls.append(ctl.step)
        if ctl.step >= 1:
            raise KeyboardInterrupt("stopped by SIGTERM")

    ctl.stop_check = check
    with pytest.raises(KeyboardInterrupt):
        ctl.run()
    assert ctl.step == 1 and calls.count(0) > 10
    assert all(w.log[-1] == "Shutdown" for w in workers)


def test_ask_each_queues_behind_work_and_collects_every_devices_answer():
    from pivotrl_hpc.protocol.messages import QueryState

    ctl, workers = make_controller("shiftable", bootstrap=split_bootstrap(),
                                   prebuild=("policy", "genrm"))
    ctl.prebuild()                      # a Prepare in flight on every device first
    replies = ctl.devices.ask_each(QueryState(), ctl.clock, 30.0)
    assert sorted(replies) == sorted(ctl.devices.handles)
    assert all(r.ok and r.command == "QueryState" for r in replies.values())
    assert all(w.log[:2] == ["Prepare", "QueryState"] for w in workers)
    assert not any(ctl.devices.busy(d) for d in ctl.devices.handles)


def test_prebuild_prepares_every_device_before_anything_else():
    ctl, workers = make_controller("shiftable", bootstrap=split_bootstrap(),
                                   prebuild=("policy", "genrm"))
    summary = ctl.run()
    assert all(w.log[0] == "Prepare" for w in workers)
    assert summary["prebuilt_s"] == 0.0   # modeled engines build in no virtual time
    ctl, workers = make_controller("shiftable", bootstrap=split_bootstrap())
    assert ctl.run()["prebuilt_s"] is None and "Prepare" not in workers[0].log
    ctl, workers = make_controller("shiftable", bootstrap=split_bootstrap(),
                                   prebuild=("policy", "genrm"), fail_on=Prepare)
    with pytest.raises(ControllerError, match=r"Prepare failed on device \d"):
        ctl.run()
    assert all(w.log[-1] == "Shutdown" for w in workers)


def test_validation_accuracy_is_reported():
    ctl, _, summary = run("shiftable", eval_every=1)
    assert [v["step"] for v in summary["validation"]] == [1, 2, 3]
    assert all(0.0 <= v["accuracy"] <= 1.0 for v in summary["validation"])


def test_the_hdf5_trace_proves_nothing_was_lost(tmp_path):
    from pivotrl_hpc.trace import TraceWriter, open_trace

    path = tmp_path / "run.h5"
    with TraceWriter(str(path), {"paradigm": "shiftable"}) as w:
        ctl, _, summary = run("shiftable", trace=w)
        w.close(summary)
    t = open_trace(str(path))
    seqs = t.table("sequences")
    finish = [(r, s) for e, r, s in zip(seqs["event"], seqs["role"], seqs["seq_id"])
              if e == "finish"]
    assert len(finish) == len(set(finish)) == 2 * 48
    steps = t.table("steps")
    assert list(steps["step"]) == [0, 1, 2] and list(steps["samples"]) == [16, 16, 16]
    assert steps["max_lag"].max() <= 2
    assert steps["tokens"].sum() == summary["trained_tokens"]
    assert t.summary["steps"] == 3
    shifts = t.table("shifts")
    assert set(shifts["direction"]) == {"up", "down"}
    assert all("total" in p for p in shifts["phases"])
    planner = t.table("planner")
    assert planner["executed"].sum() >= 1
    assert_trace_ok(path)


def test_virtual_time_plans_on_an_event_at_once_not_at_the_next_tick():
    """The live loop plans within milliseconds of an event (a step done, a shift done); in
    virtual time the loop must not sleep to the next planner tick first. Colocated: training
    shifts down right after each step, so the shift ends its own seconds later."""
    trace = Rows()
    ctl, _, _ = run("colocated", trace=trace)
    steps = [r["t"] for r in trace.rows["steps"]]
    downs = [r for r in trace.rows["shifts"]
             if r["role"] == "training" and r["direction"] == "down"]
    assert len(downs) == len(steps) - 1 and ctl.cfg.planner_interval_s == 0.5
    for step_t, down in zip(steps, downs):
        assert down["t"] == pytest.approx(step_t + down["seconds"], abs=1e-6)


@pytest.mark.parametrize("overhead_s", [0.0, 0.02])
def test_throughput_constants_are_fitted_online_from_the_replicas(overhead_s):
    """The fit recovers the modeled engine's latency law plus, per iteration, what a Step
    costs beyond its iterations (a reply `overhead_s` late): the round trip is what a
    replica delivers, so the planner must see it."""
    from controller_util import POLICY
    from pivotrl_hpc.controller.monitor import RoleModel
    from pivotrl_hpc.sched.model import ThroughputModel

    trace = Rows()
    ctl, workers = make_controller("shiftable", bootstrap=split_bootstrap(), trace=trace,
                                   steps=4)
    for w in workers:
        w.step_overhead_s = {"rollout": overhead_s}
    start = ThroughputModel(1e-5, 0.05, 1e-3, 0.01)  # a poor guess
    # window 0: every Step a sample (the modeled Steps have no quota noise to pool away)
    ctl.models["rollout"] = RoleModel(start, fixed=False, min_samples=12, refit_every=12,
                                      window_s=0.0)
    ctl.flows["rollout"].sched.model = start
    ctl.run()
    fits = [r for r in trace.rows["fits"] if r["role"] == "rollout"]
    assert fits and fits[-1]["error"] < 0.02
    fitted = ctl.flows["rollout"].sched.model
    assert fitted is ctl.models["rollout"].model and fitted != start
    per_iteration = overhead_s / ctl.cfg.step_iterations
    for n, t in ((1, 20), (8, 200), (32, 900)):  # the modeled engine's own latency law
        assert fitted.latency(n, t) == pytest.approx(POLICY.latency(n, t) + per_iteration,
                                                     rel=0.05)


def test_tp2_replicas_under_kv_pressure_resume_exactly():
    """Reward replicas of 2 devices, KV caches that fill up: sequences are preempted and
    re-dispatched (often to the same replica) while Steps are in flight. Every finish must
    still continue its record token for token (the controller raises otherwise)."""
    from controller_util import ShiftPlan, ReplicaSpec

    boot = ShiftPlan((), (ReplicaSpec("rollout", (4,)), ReplicaSpec("rollout", (5,)),
                          ReplicaSpec("reward", (6, 7))), "initial allocation")
    ctl, workers = make_controller("shiftable", bootstrap=boot, reward_gpus=2)
    for w in workers:
        w.slowdown = 1.0 + 0.3 * (w.device % 2)  # a TP pair's devices answer at other times
    ctl.cfg.kv_capacity["reward"] = 30
    ctl.cfg.kv_capacity["rollout"] = 90
    summary = ctl.run()
    assert summary["steps"] == 3
    samples = [s for s in ctl.book.samples.values() if s.batch >= 0]
    assert all(s.state == "trained" for s in samples)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("paradigm", ["colocated", "shiftable", "rule_based"])
def test_a_finish_reported_a_step_late_is_not_lost_to_a_migration(paradigm):
    """Modeled engines that report a finish one Step after the last token (a named Abort
    in between drops it): a shift-up migration in that window must not lose the sequence.
    The record reaching its budget is the finish."""
    ctl, _, summary = run(paradigm, late_finish=True)
    assert summary["steps"] == 3 and summary["in_flight_at_end"] == 0
    samples = [s for s in ctl.book.samples.values() if s.batch >= 0]
    assert all(s.state == "trained" and len(s.response) == s.budget for s in samples)
    assert len(samples) == 48


def test_a_replica_that_lost_a_sequence_stops_the_run():
    """A worker that drops a placed sequence (injected: the modeled engine forgets it) is
    caught within STALL_STEPS Steps, naming the replica and the sequence, not a hang."""
    from pivotrl_hpc.controller.flow import ControllerError

    ctl, workers = make_controller("shiftable", bootstrap=split_bootstrap())
    original = workers[4]._run

    def forgetful(cmd):
        result, seconds = original(cmd)
        workers[4].seqs.clear()  # fault injection: the engine loses what it was given
        return result, seconds
    workers[4]._run = forgetful
    with pytest.raises(ControllerError, match="returned no token for sequence"):
        ctl.run()


def test_describe_says_what_the_loop_waits_on():
    ctl, _ = make_controller("shiftable")
    ctl.executor.execute(split_bootstrap(), 0)
    text = ctl.describe()
    assert "device 4: ShiftUp in flight" in text and "device 0: free" in text
    ctl.run()
    assert "step 3/3" in ctl.describe() and "open records []" in ctl.describe()


@pytest.mark.parametrize("shift_up_s,train_s", [(2.0, 0.8), (4.0, 0.8)])
def test_a_rollout_replica_that_read_before_a_publish_is_reloaded_before_it_serves(
        shift_up_s, train_s):
    """Seen live (learn-cpu shiftable: lag 3 at k=2) and here: a rollout replica shifting up
    Reads GPS v, step v+1 is published while its shift up runs, it misses that Reload, and
    samples admitted against v+1 are generated by v. It is now reloaded on arrival."""
    ctl, workers = make_controller("shiftable", bootstrap=split_bootstrap(), steps=6,
                                   train=(0,))
    for w in workers:
        w.shift_up_s, w.train_s = dict(w.shift_up_s, rollout=shift_up_s), train_s
    summary = ctl.run()
    samples = [s for s in ctl.book.samples.values() if s.batch >= 0]
    assert summary["steps"] == 6 and max(lag(s) for s in samples) <= 2
    assert summary["max_lag"] <= 2


def test_a_job_book_drops_what_it_trained():
    """Live and simulated jobs keep only samples not trained yet (the book would otherwise
    grow by a batch every step); the trace has the trained ones."""
    ctl, _ = make_controller("disaggregated", params={"rollout_gpus": 2, "reward_gpus": 2},
                             steps=4, eval_every=2)
    ctl.book.keep_trained = False
    summary = ctl.run()
    assert summary["steps"] == 4 and ctl.book.samples == {}
    assert ctl.book.next_sid == 4 * 4 * 4 + 2 * 4   # 4 steps of 16, 2 evaluations of 4


def test_kv_overflow_preempts_the_newest_sequence_on_the_replica_not_the_grower():
    """The controller's KV accounting preempts as vLLM does: the newest sequence leaves (a
    `preempt` row, its epoch bumped, an Abort due on the engine) while the older one that
    overflowed keeps its tokens and its place; the newest one's output in the same reply is
    stale and ignored (it resumes from its record)."""
    from pivotrl_hpc.controller.flow import RoleFlow, SeqRecord
    from pivotrl_hpc.protocol.engine import Sampling, SeqProgress, StepOutput
    from pivotrl_hpc.sched import Replica, Scheduler, ThroughputModel

    events = []
    flow = RoleFlow("reward", Scheduler(ThroughputModel(0.0, 0.01, 0.0, 0.0)),
                    lambda rec, now: None, lambda e, rec, rep, *a: events.append((e, rec.sid)))
    flow.sched.add_replica(Replica("r0", 25))   # 20 placed: 1 cannot grow by 8
    for sid in (1, 2):
        flow.submit(SeqRecord(sid, "reward", (7,) * 10, 50, Sampling()))
    flow.place_ids("r0", [m.seq_id for m in flow.sched.dispatch()])
    epochs = flow.placements("r0")
    out = StepOutput([SeqProgress("1", [5] * 8, [-1.0] * 8), SeqProgress("2", [5] * 8, [-1.0] * 8)],
                     [], 0.1, 8)
    assert flow.on_step("r0", [out], 1.0, epochs) == 8       # 2's tokens came too late
    assert flow.records[1].generated == [5] * 8 and flow.records[1].replica == "r0"
    assert flow.records[2].generated == [] and flow.records[2].replica is None
    assert flow.records[2].epoch == epochs[2] + 1
    assert flow.preempted == [("r0", 2)] and events[-1] == ("preempt", 2)
    assert [q.seq_id for q in flow.sched.queue] == [2]


def test_a_sequence_finished_in_the_same_reply_leaves_before_the_others_grow():
    """A reply that finishes the newest sequence and grows an older one past the KV
    capacity: the finished one leaves first (its KV freed, as vLLM frees a finished
    request's blocks), so the growth fits and nothing is preempted; the finished one is
    not thrown back to regenerate tokens it already has."""
    from pivotrl_hpc.controller.flow import RoleFlow, SeqRecord
    from pivotrl_hpc.protocol.engine import FinishedSequence, Sampling, SeqProgress, StepOutput
    from pivotrl_hpc.sched import Replica, Scheduler, ThroughputModel

    finished = []
    flow = RoleFlow("reward", Scheduler(ThroughputModel(0.0, 0.01, 0.0, 0.0)),
                    lambda rec, now: finished.append(rec.sid), lambda *a: None)
    flow.sched.add_replica(Replica("r0", 25))   # 20 placed: 1 cannot grow by 8 beside 2
    flow.submit(SeqRecord(1, "reward", (7,) * 10, 50, Sampling()))
    flow.submit(SeqRecord(2, "reward", (7,) * 10, 8, Sampling()))
    flow.place_ids("r0", [m.seq_id for m in flow.sched.dispatch()])
    out = StepOutput([SeqProgress("1", [5] * 8, [-1.0] * 8), SeqProgress("2", [6] * 8, [-1.0] * 8)],
                     [FinishedSequence("2", [7] * 10, [6] * 8, [-1.0] * 8, "length")], 0.1, 8)
    assert flow.on_step("r0", [out], 1.0, flow.placements("r0")) == 16
    assert finished == [2] and flow.records[2].generated == [6] * 8
    assert flow.preempted == [] and flow.records[1].replica == "r0"
    assert flow.sched.replicas["r0"].n_tok == 18 and not flow.sched.queue


def test_the_flow_tells_an_engines_first_step_on_its_devices():
    """Which Step is an engine's warm-up (kept out of the throughput fit) is the flow's to
    say, per role and devices: the reporter is only told (issue 51)."""
    from pivotrl_hpc.controller.flow import RoleFlow
    from pivotrl_hpc.sched import Scheduler, ThroughputModel

    flows = {role: RoleFlow(role, Scheduler(ThroughputModel(0.0, 0.01, 0.0, 0.0)),
                            lambda rec, now: None, lambda *a: None)
             for role in ("rollout", "reward")}
    assert [flows["rollout"].first_step(d) for d in ((0, 1), (0, 1), (2,), (0, 1))] == [
        True, False, True, False]
    assert flows["reward"].first_step((0, 1))   # another role's engine on those devices
