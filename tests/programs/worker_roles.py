"""One device worker through rollout -> reward -> training -> rollout, in one process.

usage: worker_roles.py MODELS_DIR OUT.json
Starts a GPS node agent in a thread (the node agent is local rank 0 in a job; here the same
process), drives the worker with the controller's commands, and writes a JSON report of the
numbers the test asserts on.
"""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))

import torch  # noqa: E402

from pivotrl_hpc.engines.host import rss_bytes  # noqa: E402
from pivotrl_hpc.engines.megatron.batch import RolloutBatch  # noqa: E402
from pivotrl_hpc.engines.megatron.trainer import OptimConfig, TrainerConfig  # noqa: E402
from pivotrl_hpc.engines.vllm.types import EngineOptions, Sampling  # noqa: E402
from pivotrl_hpc.runtime.local import local_worker  # noqa: E402
from pivotrl_hpc.runtime.messages import (  # noqa: E402
    AddSequences, QueryState, RoleKind, SeqRequest, ShiftDown, ShiftUp, Shutdown, Step,
    TrainStep, WaitWrite)
from pivotrl_hpc.runtime.worker import WorkerSpec  # noqa: E402

GREEDY = Sampling(temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 20, 21, 5, 6, 27], [1, 22, 9, 9, 26], [1, 30, 31, 32, 7, 8, 9]]


def rss_mib() -> float:
    return rss_bytes() / 2**20


def ok(reply):
    if not reply.ok:
        raise RuntimeError(f"{reply.command} failed: {reply.error}")
    return reply


def run_to_end(worker, seqs) -> dict[str, tuple[list[int], list[float]]]:
    ok(worker.handle(AddSequences(tuple(seqs))))
    done = {}
    while len(done) < len(seqs):
        for out in ok(worker.handle(Step())).result:
            for f in out.finished:
                done[f.seq_id] = (list(f.token_ids), list(f.logprobs))
    return done


def reqs(prefix, n_new, sampling=GREEDY, prompts=PROMPTS):
    return [SeqRequest(f"{prefix}{i}", tuple(p), max_new_tokens=n_new, sampling=sampling)
            for i, p in enumerate(prompts)]


def optimizer_state(worker) -> list[torch.Tensor]:
    opt = worker.trainer.optimizer
    out = []
    for o in getattr(opt, "chained_optimizers", [opt]):
        for st in o.optimizer.state.values():
            out += [v.detach().clone() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def main(models: str, out_path: str) -> None:
    opts = EngineOptions(max_model_len=128, kv_cache_memory_bytes=16 * 2**20)
    spec = WorkerSpec(model_dirs={"policy": f"{models}/policy", "genrm": f"{models}/genrm"},
                      engine_options={"policy": opts, "genrm": opts},
                      trainer_config=TrainerConfig(optim=OptimConfig(lr=1e-3, clip_grad=0)))
    job = f"wtest{os.getpid()}"
    with local_worker(spec, job=job) as w:
        report = scenario(w)
    report["job"] = job
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)


def scenario(w) -> dict:
    import vllm  # noqa: F401 - preserved context: the idle baseline has the engines imported

    report: dict = {"rss_idle_mib": rss_mib(), "phases": {}}

    # rollout: an uninterrupted greedy run, then one interrupted by a shift down
    report["phases"]["rollout_up"] = ok(w.handle(ShiftUp(RoleKind.ROLLOUT, 0))).phases
    full = run_to_end(w, reqs("a", 12))
    ok(w.handle(AddSequences(tuple(reqs("b", 12)))))
    for _ in range(4):
        ok(w.handle(Step()))
    held = ok(w.handle(QueryState())).result["engine"]
    down = ok(w.handle(ShiftDown()))
    report["phases"]["rollout_down"] = down.phases
    report["requeued"] = sorted(a.seq_id for a in down.result)
    report["held_before_down"] = len(held.running)
    report["rss_after_rollout_down_mib"] = rss_mib()

    # reward on the same device: the GenRM, a different model
    report["phases"]["reward_up"] = ok(w.handle(ShiftUp(RoleKind.REWARD, 1))).phases
    judged = run_to_end(w, reqs("r", 6))
    report["rss_after_reward_up_mib"] = rss_mib()
    report["reward_tokens"] = [judged[f"r{i}"][0] for i in range(len(PROMPTS))]
    report["phases"]["reward_down"] = ok(w.handle(ShiftDown())).phases
    report["rss_after_reward_down_mib"] = rss_mib()

    # rollout again: the re-queued sequences resume where they stopped
    ok(w.handle(ShiftUp(RoleKind.ROLLOUT, 2)))
    resumed = run_to_end(w, [SeqRequest.resume(a) for a in down.result])
    report["resumed_partial"] = [len(a.generated_ids) for a in down.result]
    report["resume_equal"] = all(resumed[f"b{i}"][0] == full[f"a{i}"][0]
                                 for i in range(len(PROMPTS)))
    sampled = run_to_end(w, reqs("s", 10, Sampling(temperature=1.0, seed=7, ignore_eos=True)))
    ok(w.handle(ShiftDown()))

    # training: logprobs agree with rollout's, a step, Write, shift down/up keeps Adam state
    report["phases"]["training_up_first"] = ok(w.handle(ShiftUp(RoleKind.TRAINING))).phases
    ids = [f"s{i}" for i in range(len(PROMPTS))]
    batch = RolloutBatch.from_sequences(PROMPTS, [sampled[i][0] for i in ids],
                                        [sampled[i][1] for i in ids], [1.0, 0.0, 0.5],
                                        [0, 0, 0])
    mlp = w.trainer.compute_logprobs(batch)
    vlp = batch.behaviour_logprobs
    report["logprob_max_abs_diff"] = float((mlp - vlp)[batch.response_mask].abs().max())
    step = ok(w.handle(TrainStep(batch)))
    report["train_loss"] = step.result["loss"]
    report["version_after_step"] = ok(w.handle(WaitWrite())).result
    before = optimizer_state(w)
    params_before = [p.detach().clone() for p in w.trainer.core.parameters()]
    report["phases"]["training_down"] = ok(w.handle(ShiftDown())).phases
    report["params_freed_on_down"] = all(p.untyped_storage().nbytes() == 0
                                         for p in w.trainer.core.parameters())
    report["phases"]["training_up"] = ok(w.handle(ShiftUp(RoleKind.TRAINING))).phases
    after = optimizer_state(w)
    report["optimizer_bitwise_equal"] = len(before) > 0 and all(
        torch.equal(a, b) for a, b in zip(before, after))
    report["params_bitwise_equal"] = all(
        torch.equal(a, b) for a, b in zip(params_before, w.trainer.core.parameters()))
    # an unpublished step is never dropped: its params go to host, not back to GPS's copy
    unpublished = ok(w.handle(TrainStep(batch, publish=False))).result["loss"]
    trained_params = [p.detach().clone() for p in w.trainer.core.parameters()]
    ok(w.handle(ShiftDown()))
    ok(w.handle(ShiftUp(RoleKind.TRAINING)))
    report["unpublished_step_kept"] = all(
        torch.equal(a, b) for a, b in zip(trained_params, w.trainer.core.parameters()))
    report["unpublished_loss"] = unpublished
    ok(w.handle(TrainStep(batch)))  # publish again: GPS v2 = the trainer's params
    report["version_after_second_publish"] = ok(w.handle(WaitWrite())).result
    ok(w.handle(ShiftDown()))

    # rollout with the trained policy: vLLM reads version 1 from GPS
    ok(w.handle(ShiftUp(RoleKind.ROLLOUT, 3)))
    report["rollout_version"] = w.version
    trained = run_to_end(w, reqs("t", 12))
    report["tokens_changed"] = any(trained[f"t{i}"][1] != full[f"a{i}"][1]
                                   for i in range(len(PROMPTS)))
    ok(w.handle(ShiftDown()))
    ok(w.handle(ShiftUp(RoleKind.TRAINING)))
    tb = RolloutBatch.from_sequences(PROMPTS, [trained[f"t{i}"][0] for i in range(3)],
                                     [trained[f"t{i}"][1] for i in range(3)], [0, 0, 0],
                                     [0, 0, 0])
    report["logprob_max_abs_diff_trained"] = float(
        (w.trainer.compute_logprobs(tb) - tb.behaviour_logprobs)[tb.response_mask].abs().max())
    ok(w.handle(ShiftDown()))

    # a command that fails mid-flight reports the sequences the worker held
    ok(w.handle(ShiftUp(RoleKind.ROLLOUT, 4)))
    ok(w.handle(AddSequences(tuple(reqs("h", 50)[:2]))))
    ok(w.handle(Step()))
    bad = w.handle(AddSequences((SeqRequest("long", tuple([5] * 400), max_new_tokens=4,
                                            sampling=GREEDY),)))
    report["failure"] = {"ok": bad.ok, "command": bad.command, "seq_ids": list(bad.seq_ids),
                         "error": (bad.error or "").splitlines()[0]}
    report["shutdown_requeued"] = sorted(a.seq_id for a in ok(w.handle(Shutdown())).result)
    return report


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
