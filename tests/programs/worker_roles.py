"""One device worker through rollout -> reward -> training -> rollout, in one process.

usage: worker_roles.py MODELS_DIR OUT.json
Starts a GPS node agent beside the worker (a child process here; local rank 0 in a job),
drives the worker with the controller's commands, and writes a JSON report of the numbers the
test asserts on. The worker's GPS client is wrapped to record every Read it serves.
"""
from __future__ import annotations

import json
import os
import sys

import torch

from rendezvous import init_world_of_one

from pivotrl_hpc.engines.host import rss_bytes
from pivotrl_hpc.engines.megatron.batch import RolloutBatch
from pivotrl_hpc.engines.megatron.trainer import OptimConfig, TrainerConfig
from pivotrl_hpc.protocol.engine import EngineOptions, Sampling
from pivotrl_hpc.runtime.local import local_worker
from pivotrl_hpc.protocol.messages import (Abort, AddSequences, QueryState, RoleKind, SeqRequest,
                                           ShiftDown, ShiftUp, Shutdown, Step, TrainStep,
                                           WaitWrite)
from pivotrl_hpc.runtime.worker import WorkerSpec

GREEDY = Sampling(temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 20, 21, 5, 6, 27], [1, 22, 9, 9, 26], [1, 30, 31, 32, 7, 8, 9]]
GENRM_KV_BYTES = 128 * 2**20  # the reward engine's KV cache: large next to the RSS margin


class RecordingStore:
    """The worker's GPS client, recording each Read it serves as (model, version)."""

    def __init__(self, client):
        self.client, self.reads = client, []

    def read(self, model, place, version=None, **kw):
        pin = kw.get("pin")   # the worker names the current version by pinning it
        self.reads.append((model, pin.version if pin is not None else version))
        return self.client.read(model, place, version, **kw)

    def __getattr__(self, name):
        return getattr(self.client, name)


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


def tokens(done, prefix) -> list[list[int]]:
    return [done[f"{prefix}{i}"][0] for i in range(len(PROMPTS))]


def hf_greedy(folder: str, n: int) -> list[list[int]]:
    """Greedy continuations by transformers itself (argmax at every step, EOS not special,
    as vLLM's ignore_eos): the reference an engine serving `folder` must reproduce."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = list(prompt)
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(prompt):])
    return out


def optimizer_state(worker) -> list[torch.Tensor]:
    opt = worker.trainer.optimizer
    out = []
    for o in getattr(opt, "chained_optimizers", [opt]):
        for st in o.optimizer.state.values():
            out += [v.detach().clone() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def params(worker) -> list[torch.Tensor]:
    return [p.detach().clone() for p in worker.trainer.core.parameters()]


def same(a: list[torch.Tensor], b) -> bool:
    b = list(b)
    return len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b))


def role_error(w, cmd) -> dict:
    r = w.handle(cmd)
    return {"ok": r.ok, "role": r.role.value, "error": (r.error or "").splitlines()[0]}


def main(models: str, out_path: str) -> None:
    store = init_world_of_one()  # noqa: F841 - keeps the rendezvous port bound
    opts = EngineOptions(max_model_len=128, kv_cache_memory_bytes=16 * 2**20)
    genrm_opts = EngineOptions(max_model_len=128, kv_cache_memory_bytes=GENRM_KV_BYTES)
    spec = WorkerSpec(model_dirs={"policy": f"{models}/policy", "genrm": f"{models}/genrm"},
                      engine_options={"policy": opts, "genrm": genrm_opts},
                      trainer_config=TrainerConfig(optim=OptimConfig(lr=1e-3, clip_grad=0)))
    job = f"wtest{os.getpid()}"
    with local_worker(spec, job=job) as w:
        w.store = RecordingStore(w.store)
        report = scenario(w, models)
    report["job"] = job
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)


def scenario(w, models: str) -> dict:
    import vllm  # noqa: F401 - preserved context: the idle baseline has the engines imported

    report: dict = {"rss_idle_mib": rss_mib(), "phases": {}, "role_errors": {}}
    errors = report["role_errors"]
    for name, cmd in [("step_idle", Step()), ("train_idle", TrainStep(None)),
                      ("wait_write_idle", WaitWrite()), ("up_to_idle", ShiftUp(RoleKind.IDLE)),
                      ("down_idle", ShiftDown()), ("abort_idle", Abort())]:
        errors[name] = role_error(w, cmd)
    full, requeued = rollout(w, report, models)
    reward(w, report, models)
    # rollout again: the re-queued sequences resume where they stopped
    ok(w.handle(ShiftUp(RoleKind.ROLLOUT, 2)))
    resumed = run_to_end(w, [SeqRequest.resume(a) for a in requeued])
    report["resumed_partial"] = [len(a.generated_ids) for a in requeued]
    report["resume_equal"] = tokens(resumed, "b") == tokens(full, "a")
    sampled = run_to_end(w, reqs("s", 10, Sampling(temperature=1.0, seed=7, ignore_eos=True)))
    ok(w.handle(ShiftDown()))
    training(w, report, sampled)
    trained_rollout(w, report, full)
    failure(w, report)
    return report


def rollout(w, report: dict, models: str) -> tuple[dict, list]:
    """Greedy runs (one whole, one aborted and resumed), RoleErrors, then a shift down that
    re-queues the running sequences."""
    up = ok(w.handle(ShiftUp(RoleKind.ROLLOUT, 0)))
    report["phases"]["rollout_up"], report["rollout_up_read"] = up.phases, up.result["read"]
    full = run_to_end(w, reqs("a", 12))
    report["rollout_tokens_match_hf"] = tokens(full, "a") == hf_greedy(f"{models}/policy", 12)
    abort_and_resume(w, report, full)
    ok(w.handle(AddSequences(tuple(reqs("b", 12)))))
    for _ in range(4):
        ok(w.handle(Step()))
    for name, cmd in [("up_while_rollout", ShiftUp(RoleKind.REWARD)),
                      ("train_while_rollout", TrainStep(None))]:
        report["role_errors"][name] = role_error(w, cmd)
    held = ok(w.handle(QueryState())).result["engine"]
    down = ok(w.handle(ShiftDown()))
    report["phases"]["rollout_down"] = down.phases
    report["requeued"] = sorted(a.seq_id for a in down.result)
    report["held_before_down"] = len(held.running)
    report["rss_after_rollout_down_mib"] = rss_mib()
    return full, down.result


def abort_and_resume(w, report: dict, full: dict) -> None:
    """Abort one sequence, then Abort(All); resumed, all three equal the whole run."""
    ok(w.handle(AddSequences(tuple(reqs("x", 12)))))
    for _ in range(3):
        ok(w.handle(Step()))
    one = ok(w.handle(Abort(("x1",)))).result
    ok(w.handle(Step()))
    rest = ok(w.handle(Abort())).result
    report["abort"] = {"one": [a.seq_id for a in one], "rest": sorted(a.seq_id for a in rest),
                       "partial": {a.seq_id: len(a.generated_ids) for a in one + rest},
                       "running_after": len(ok(w.handle(QueryState())).result["engine"].running)}
    resumed = run_to_end(w, [SeqRequest.resume(a) for a in one + rest])
    report["abort"]["resume_equal"] = tokens(resumed, "x") == tokens(full, "a")


def reward(w, report: dict, models: str) -> None:
    """The GenRM on the same device: its own greedy output, and its memory given back."""
    report["phases"]["reward_up"] = ok(w.handle(ShiftUp(RoleKind.REWARD, 1))).phases
    judged = run_to_end(w, reqs("r", 6))
    report["rss_after_reward_up_mib"] = rss_mib()
    report["reward_tokens"] = tokens(judged, "r")
    report["phases"]["reward_down"] = ok(w.handle(ShiftDown())).phases
    report["rss_after_reward_down_mib"] = rss_mib()
    report["genrm_hf_greedy"] = hf_greedy(f"{models}/genrm", 6)
    report["policy_hf_greedy"] = hf_greedy(f"{models}/policy", 6)


def training(w, report: dict, sampled: dict) -> None:
    up = ok(w.handle(ShiftUp(RoleKind.TRAINING)))
    report["phases"]["training_up_first"], report["training_first_read"] = \
        up.phases, up.result["read"]
    for name, cmd in [("add_while_training", AddSequences(())), ("step_while_training", Step())]:
        report["role_errors"][name] = role_error(w, cmd)
    ids = [f"s{i}" for i in range(len(PROMPTS))]
    batch = RolloutBatch.from_sequences(PROMPTS, [sampled[i][0] for i in ids],
                                        [sampled[i][1] for i in ids], [1.0, 0.0, 0.5],
                                        [0, 0, 0])
    mlp = w.trainer.compute_logprobs(batch)
    vlp = batch.behaviour_logprobs
    report["logprob_max_abs_diff"] = float((mlp - vlp)[batch.response_mask].abs().max())
    step = ok(w.handle(TrainStep(batch)))
    report["train_loss"] = step.result["loss"]
    report["version_after_step"] = ok(w.handle(WaitWrite())).result["version"]
    published_shift(w, report)
    unpublished_shift(w, report, batch)
    in_flight_shift(w, report, batch)


def offload_report(w, param_bytes: int) -> dict:
    tr = w.trainer
    return {"freed": tr.last_offload_bytes, "host": tr.last_offload_host_bytes,
            "param_bytes": param_bytes,
            "storage_left": sum(p.untyped_storage().nbytes() for p in tr.core.parameters())}


def published_shift(w, report: dict) -> None:
    """Params GPS holds are discarded on shift down and Read back on shift up."""
    before, params_before = optimizer_state(w), params(w)
    param_bytes = sum(p.numel() * p.element_size() for p in w.trainer.core.parameters())
    report["phases"]["training_down"] = ok(w.handle(ShiftDown())).phases
    report["offload_published"] = offload_report(w, param_bytes)
    n_reads = len(w.store.reads)
    up = ok(w.handle(ShiftUp(RoleKind.TRAINING)))
    report["phases"]["training_up"], report["training_up_result"] = up.phases, up.result
    report["training_up_reads"] = w.store.reads[n_reads:]
    report["reload_bytes"] = w.trainer.last_reload_bytes
    report["optimizer_bitwise_equal"] = same(before, optimizer_state(w))
    report["params_bitwise_equal"] = same(params_before, w.trainer.core.parameters())


def unpublished_shift(w, report: dict, batch) -> None:
    """An unpublished step is kept on host across the shift, never Read back from GPS."""
    before = params(w)
    report["unpublished_loss"] = ok(w.handle(TrainStep(batch, publish=False))).result["loss"]
    trained = params(w)
    report["unpublished_step_changed_params"] = not same(before, trained)
    param_bytes = sum(p.numel() * p.element_size() for p in w.trainer.core.parameters())
    ok(w.handle(ShiftDown()))
    report["offload_unpublished"] = offload_report(w, param_bytes)
    n_reads = len(w.store.reads)
    up = ok(w.handle(ShiftUp(RoleKind.TRAINING)))
    report["unpublished_up"] = {"result": up.result, "phases": sorted(up.phases),
                                "reads": w.store.reads[n_reads:]}
    report["unpublished_step_kept"] = same(trained, w.trainer.core.parameters())


def in_flight_shift(w, report: dict, batch) -> None:
    """Shift down right after a published step, its Write not waited for: the shift down
    waits for it, and shift up Reads exactly that version back."""
    step = ok(w.handle(TrainStep(batch)))
    trained = params(w)
    report["in_flight"] = {"gps_version": step.result["gps_version"],
                           "pending": w.pending_write is not None}
    report["in_flight"]["down_phases"] = sorted(ok(w.handle(ShiftDown())).phases)
    n_reads = len(w.store.reads)
    ok(w.handle(ShiftUp(RoleKind.TRAINING)))
    report["in_flight"]["reads"] = w.store.reads[n_reads:]
    report["in_flight"]["params_equal"] = same(trained, w.trainer.core.parameters())
    report["version_after_second_publish"] = w.version
    ok(w.handle(ShiftDown()))


def trained_rollout(w, report: dict, full: dict) -> None:
    """Rollout with the trained policy (GPS v2), and training's logprobs of its output."""
    n_reads = len(w.store.reads)
    ok(w.handle(ShiftUp(RoleKind.ROLLOUT, 3)))
    report["rollout_version"], report["rollout_reads"] = w.version, w.store.reads[n_reads:]
    trained = run_to_end(w, reqs("t", 12))
    report["tokens_changed"] = tokens(trained, "t") != tokens(full, "a")
    ok(w.handle(ShiftDown()))
    ok(w.handle(ShiftUp(RoleKind.TRAINING)))
    tb = RolloutBatch.from_sequences(PROMPTS, tokens(trained, "t"),
                                     [trained[f"t{i}"][1] for i in range(3)], [0, 0, 0],
                                     [0, 0, 0])
    report["logprob_max_abs_diff_trained"] = float(
        (w.trainer.compute_logprobs(tb) - tb.behaviour_logprobs)[tb.response_mask].abs().max())
    ok(w.handle(ShiftDown()))


def failure(w, report: dict) -> None:
    """A command that fails mid-flight reports the sequences the worker held."""
    ok(w.handle(ShiftUp(RoleKind.ROLLOUT, 4)))
    ok(w.handle(AddSequences(tuple(reqs("h", 50)[:2]))))
    ok(w.handle(Step()))
    bad = w.handle(AddSequences((SeqRequest("long", tuple([5] * 400), max_new_tokens=4,
                                            sampling=GREEDY),)))
    report["failure"] = {"ok": bad.ok, "command": bad.command, "seq_ids": list(bad.seq_ids),
                         "error": (bad.error or "").splitlines()[0]}
    report["shutdown_requeued"] = sorted(a.seq_id for a in ok(w.handle(Shutdown())).result)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
