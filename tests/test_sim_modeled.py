"""The modeled engine's Step: iterations taken in blocks that end where a sequence finishes
(sim/modeled.py), equal to one iteration at a time in tokens and in virtual seconds, and the
online fit fed the blocks' means (controller/flow.py)."""
from __future__ import annotations

import pytest

from pivotrl_hpc.controller.clock import VirtualClock
from pivotrl_hpc.protocol.engine import Sampling, StepOutput
from pivotrl_hpc.protocol.messages import AddSequences, RoleKind, SeqRequest, ShiftUp, Step
from pivotrl_hpc.sched.model import ThroughputModel
from pivotrl_hpc.sim.modeled import ModeledStore, ModeledWorker, tokens_at

MODEL = ThroughputModel(A=1e-3, B=0.01, C=0.004, D=0.002)


def worker(budgets: dict[str, int], late_finish: bool = False) -> ModeledWorker:
    clock = VirtualClock()
    w = ModeledWorker(0, clock, ModeledStore(), {"policy": MODEL, "genrm": MODEL},
                      {"rollout": 0.0}, {"rollout": 0.0}, late_finish=late_finish)
    w.submit(ShiftUp(RoleKind.ROLLOUT))
    w.submit(AddSequences(tuple(SeqRequest(sid, (1, 2, 3), (), (), n, Sampling())
                                for sid, n in budgets.items())))
    clock.wait_until(w.next_reply_time())
    w.poll()
    return w


def step(w: ModeledWorker, iterations: int) -> list[StepOutput]:
    w.submit(Step(iterations))
    w.clock.wait_until(w.next_reply_time())
    (reply,) = w.poll()
    return reply.result


def test_a_step_is_cut_into_blocks_at_each_finish_with_the_per_iteration_seconds():
    outs = step(worker({"a": 3, "b": 10}), 8)
    assert [o.iterations for o in outs] == [3, 5]
    assert [f.seq_id for f in outs[0].finished] == ["a"] and outs[1].finished == []
    # iteration i: both sequences (then b alone), 3 prompt tokens each + what they generated
    by_hand = [MODEL.latency(2, 6 + 2 * i) for i in range(3)] + \
              [MODEL.latency(1, 3 + 3 + i) for i in range(5)]
    assert sum(o.seconds for o in outs) == pytest.approx(sum(by_hand), rel=1e-12)
    assert outs[0].seconds == pytest.approx(sum(by_hand[:3]), rel=1e-12)
    b = [t for o in outs for p in o.progress if p.seq_id == "b" for t in p.token_ids]
    assert b == tokens_at("b", 0, 8, 64)
    assert outs[0].finished[0].token_ids == tokens_at("a", 0, 3, 64)


def test_blocks_equal_one_iteration_at_a_time():
    """A Step of 8 against eight Steps of 1: the same tokens and the same virtual time."""
    budgets = {"a": 3, "b": 10, "c": 5}
    w8, w1 = worker(budgets), worker(budgets)
    many = step(w8, 8)
    ones = [o for _ in range(8) for o in step(w1, 1)]
    assert all(o.iterations == 1 for o in ones)
    assert sum(o.seconds for o in many) == pytest.approx(sum(o.seconds for o in ones))
    assert w8.clock.now() == pytest.approx(w1.clock.now())
    for sid in budgets:
        assert [t for o in many for p in o.progress if p.seq_id == sid for t in p.token_ids] \
            == [t for o in ones for p in o.progress if p.seq_id == sid for t in p.token_ids]
    assert sorted(f.seq_id for o in many for f in o.finished) == \
        sorted(f.seq_id for o in ones for f in o.finished) == ["a", "c"]


def test_a_late_finish_engine_steps_one_iteration_at_a_time():
    w = worker({"a": 2, "b": 6}, late_finish=True)
    outs = step(w, 4)
    assert [o.iterations for o in outs] == [1, 1, 1, 1]
    assert all(o.finished == [] for o in outs)          # a's finish comes a Step late
    assert [f.seq_id for f in step(w, 1)[0].finished] == ["a"]


def test_the_fit_gets_each_windows_mean_at_its_middle_token_count():
    """Steps pool per replica until the window holds window_s seconds; the sample is the
    mean seconds per iteration at the mean load (sequences, middle-iteration tokens)."""
    from pivotrl_hpc.controller.monitor import RoleModel

    m = RoleModel(MODEL, fixed=False, min_samples=10**6, window_s=1.0)
    # 2 sequences of 3 tokens, 4 iterations at 6, 8, 10, 12 tokens: the middle is 9
    assert m.observe_step("r0", 2, 6, 4, 0.6) is None and m.samples == []
    m.observe_step("r1", 2, 6, 4, 0.9)          # another replica: its own window
    assert m.samples == []
    m.observe_step("r0", 4, 14, 2, 0.6)         # 2 iterations at 14, 18 tokens: middle 16
    # 6 iterations in 1.2 s; sequences (4 x 2 + 2 x 4) / 6 = 2.67 -> 3;
    # tokens (4 x 9 + 2 x 16) / 6 = 11.3 -> 11
    assert [(s.n_seq, s.n_tok, s.latency) for s in m.samples] == [(3, 11, pytest.approx(0.2))]
    m.observe_step("r0", 2, 6, 4, 0.6)          # the window starts again
    assert len(m.samples) == 1


def test_prefill_is_charged_per_token_when_a_sequence_first_runs_and_again_after_a_migration():
    """Qwen3-30B-A3B at TP=4 (the 7B group's GenRM) on the H20 profile: prefill costs
    2 x 3.35e9 active params / 4 GPUs / (0.5 x 148 TFLOP/s) = 22.6 us a token. A judge
    prompt of 4,000 tokens costs 90.6 ms in the first Step that runs it (adding it costs
    nothing: vLLM prefills a waiting request when it schedules it); aborted after 1,000
    judgement tokens and resumed on another replica, it is prefilled again there: 5,000
    tokens, 113 ms."""
    from pivotrl_hpc.assets.cards import CARDS
    from pivotrl_hpc.gps.shapes import ModelShape
    from pivotrl_hpc.protocol.messages import Abort
    from pivotrl_hpc.sim import profile as pf

    shape = ModelShape.from_hf_config(CARDS["Qwen3-30B-A3B"])
    p = pf.prefill_seconds(shape, 4, pf.H20)
    assert p == pytest.approx(2 * shape.num_active_params() / 4 / (0.5 * 148e12))
    assert p == pytest.approx(22.6e-6, rel=0.01)
    model = pf.inference_model(shape, "bfloat16", 4, pf.H20)
    assert p == model.C   # the same GEMM work a decode iteration charges a sequence

    def judge(clock, device):
        w = ModeledWorker(device, clock, ModeledStore(), {"policy": MODEL, "genrm": model},
                          {"reward": 0.0}, {"reward": 0.0}, prefill_s_per_token={"genrm": p})
        w.submit(ShiftUp(RoleKind.REWARD))
        w.poll()   # shift seconds 0: up at once
        return w

    def step_seconds(w, clock) -> float:
        t0 = clock.now()
        w.submit(Step(1))
        clock.wait_until(w.next_reply_time())
        w.poll()
        return clock.now() - t0

    clock = VirtualClock()
    first, second = judge(clock, 0), judge(clock, 1)
    first.submit(AddSequences((SeqRequest("j", tuple(range(4000)), (), (), 2000),)))
    assert first.next_reply_time() == clock.now()   # added, not prefilled yet
    first.poll()
    one = model.latency(1, 4000)
    assert step_seconds(first, clock) == pytest.approx(4000 * p + one)
    assert 4000 * p == pytest.approx(0.0906, rel=0.01)
    assert step_seconds(first, clock) == pytest.approx(model.latency(1, 4001))   # once
    first.seqs["j"].generated = list(range(1000))   # 1,000 judgement tokens so far
    first.seqs["j"].length = 5000
    first.submit(Abort(("j",)))
    clock.wait_until(first.next_reply_time())
    (aborted,) = first.poll()[0].result
    second.submit(AddSequences((SeqRequest.resume(aborted),)))
    second.poll()
    assert step_seconds(second, clock) == pytest.approx(5000 * p + model.latency(1, 5000))
    assert 5000 * p == pytest.approx(0.113, rel=0.01)


def test_sequences_migrated_away_before_they_run_cost_their_replica_no_prefill():
    """A whole batch handed to the first replica up and migrated off it at once (colocated's
    stage start: Dispatch gives the queue to the first replica, Algorithm 4 moves it as the
    others come up) costs that replica only the prefill of those it keeps. Charged at
    admission (before), the 1.5B group's GLM-Z1-9B replica paid 512 judge prompts of 1,600
    tokens (0.209 ms a token: 171 s) before the Abort of the 496 it had lost was served,
    and the 16 it kept waited for it."""
    p, glm = 0.209e-3, ThroughputModel(A=1e-8, B=5.5e-3, C=2.1e-4, D=2.5e-3)
    clock = VirtualClock()
    w = ModeledWorker(0, clock, ModeledStore(), {"policy": MODEL, "genrm": glm},
                      {"reward": 0.0}, {"reward": 0.0}, prefill_s_per_token={"genrm": p})
    w.submit(ShiftUp(RoleKind.REWARD))
    w.poll()
    from pivotrl_hpc.protocol.messages import Abort
    seqs = tuple(SeqRequest(f"s{i}", tuple(range(1600)), (), (), 10) for i in range(512))
    w.submit(AddSequences(seqs))
    w.submit(Abort(tuple(f"s{i}" for i in range(16, 512))))
    w.submit(Step(1))
    clock.wait_until(w._due[-1][0])
    replies = w.poll()
    assert [r.command for r in replies] == ["AddSequences", "Abort", "Step"]
    assert clock.now() == pytest.approx(16 * 1600 * p + glm.latency(16, 16 * 1600))
    assert clock.now() < 6.0 < 512 * 1600 * p   # 5.4 s, not 171 s


def test_only_max_num_seqs_sequences_decode_at_once_the_rest_wait_their_turn():
    """As vLLM's max_num_seqs: with a cap of 2, of a (3 tokens), b (10) and c (4) only a and
    b decode; c starts when a finishes. A Step of 8: blocks of 3 (a, b), 4 (b, c), 1 (b)."""
    clock = VirtualClock()
    w = ModeledWorker(0, clock, ModeledStore(), {"policy": MODEL, "genrm": MODEL},
                      {"rollout": 0.0}, {"rollout": 0.0}, max_num_seqs=2)
    w.submit(ShiftUp(RoleKind.ROLLOUT))
    w.submit(AddSequences(tuple(SeqRequest(sid, (1, 2, 3), (), (), n, Sampling())
                                for sid, n in {"a": 3, "b": 10, "c": 4}.items())))
    clock.wait_until(w.next_reply_time())
    w.poll()
    outs = step(w, 8)
    assert [o.iterations for o in outs] == [3, 4, 1]
    assert [[f.seq_id for f in o.finished] for o in outs] == [["a"], ["c"], []]
    by_hand = ([MODEL.latency(2, 6 + 2 * i) for i in range(3)]          # a, b
               + [MODEL.latency(2, (6 + 3) + 2 * i) for i in range(4)]  # b (3 done), c
               + [MODEL.latency(1, 3 + 7)])                             # b
    assert [o.seconds for o in outs] == pytest.approx(
        [sum(by_hand[:3]), sum(by_hand[3:7]), by_hand[7]], rel=1e-12)
    c = [t for o in outs for p in o.progress if p.seq_id == "c" for t in p.token_ids]
    assert c == tokens_at("c", 0, 4, 64)


def test_a_shift_down_while_idle_is_refused_as_the_live_worker_refuses_it():
    """DeviceWorker answers a ShiftDown of an idle device with RoleError; the modeled one
    answers with a failed reply that says why (it raised KeyError 'idle' before)."""
    from pivotrl_hpc.protocol.messages import ShiftDown

    w = worker({"a": 2})
    w.submit(ShiftDown())
    w.clock.wait_until(w.next_reply_time())
    (down,) = w.poll()
    assert down.ok and [s.seq_id for s in down.result] == ["a"]
    w.submit(ShiftDown())
    (again,) = w.poll()
    assert not again.ok and "shift down while idle" in again.error
