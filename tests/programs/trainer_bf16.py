"""A bf16 training worker: bf16 params, fp32 main params in Megatron's mixed-precision
optimizer, through published steps and a shift down / shift up; then a checkpoint, and a
fresh worker resuming from it as a restarted job's does (its first shift up loads the
checkpoint's policy and optimizer file) and shifting down and up again.

usage: trainer_bf16.py POLICY_DIR OUT.json
Writes a JSON report: dtypes, the bytes each shift moved, and whether the fp32 master
weights survived the re-shift-up bit for bit (a refresh from the bf16 params rounds them),
before and after the resume.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from megatron_scenarios import fixed_batch
from rendezvous import init_world_of_one

from pivotrl_hpc.engines.megatron.batch import RolloutBatch
from pivotrl_hpc.engines.megatron.model import ModelBuildConfig
from pivotrl_hpc.engines.megatron.trainer import OptimConfig, TrainerConfig
from pivotrl_hpc.runtime.local import local_worker
from pivotrl_hpc.protocol.messages import RoleKind, ShiftDown, ShiftUp, TrainStep, WaitWrite
from pivotrl_hpc.runtime.worker import WorkerSpec


def ok(reply):
    if not reply.ok:
        raise RuntimeError(f"{reply.command} failed: {reply.error}")
    return reply


def groups(trainer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(bf16 model params, their fp32 main params), in the optimizer's order."""
    params, mains = [], []
    for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        for pg, mg in zip(opt.float16_groups, opt.fp32_from_float16_groups):
            params += [p.detach().clone() for p in pg]
            mains += [m.detach().clone() for m in mg]
    return params, mains


def adam_state(trainer) -> list[torch.Tensor]:
    """Every optimizer state tensor (exp_avg, exp_avg_sq, step), in the optimizer's order."""
    out = []
    for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        for pg in opt.optimizer.param_groups:
            for p in pg["params"]:
                st = opt.optimizer.state.get(p, {})
                out += [st[k].detach().clone() for k in sorted(st)
                        if isinstance(st[k], torch.Tensor)]
    return out


def everything(trainer) -> list[torch.Tensor]:
    params, mains = groups(trainer)
    return [*params, *mains, *adam_state(trainer)]


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b))


def on_policy(trainer) -> RolloutBatch:
    base = fixed_batch()
    lp = trainer.compute_logprobs(base)
    return RolloutBatch(base.tokens, base.response_mask,
                        torch.where(base.response_mask, lp, torch.zeros_like(lp)),
                        base.rewards, base.group_ids)


def scenario(w) -> tuple[dict, RolloutBatch]:
    ok(w.handle(ShiftUp(RoleKind.TRAINING)))
    tr = w.trainer
    params, mains = groups(tr)
    r = {"param_dtypes": sorted({str(p.dtype) for p in params}),
         "main_dtypes": sorted({str(m.dtype) for m in mains}),
         # first load: the master weights are set from the loaded params
         "main_from_first_load": equal([p.float() for p in params], mains)}
    batch = on_policy(tr)
    r["steps"] = [ok(w.handle(TrainStep(batch))).result for _ in range(2)]
    r["version"] = ok(w.handle(WaitWrite())).result["version"]
    params, mains = groups(tr)
    r["params_are_rounded_main"] = equal([m.bfloat16() for m in mains], params)
    r["main_finer_than_bf16"] = any(not torch.equal(m, m.bfloat16().float()) for m in mains)
    ok(w.handle(ShiftDown()))
    r["freed"], r["host"] = tr.last_offload_bytes, tr.last_offload_host_bytes
    r["param_bytes"] = sum(p.numel() * p.element_size() for p in params)
    up = ok(w.handle(ShiftUp(RoleKind.TRAINING)))
    r["up_result"], r["up_phases"] = up.result, sorted(up.phases)
    params_up, mains_up = groups(tr)
    r["params_bitwise_after_up"] = equal(params, params_up)
    r["main_bitwise_after_up"] = equal(mains, mains_up)
    r["step_after_up"] = ok(w.handle(TrainStep(batch, publish=False))).result
    return r, batch


def checkpoint_round_trip(w, batch, root) -> tuple[dict, dict]:
    """Publish, checkpoint, take one more step (the reference); then restore as a resumed
    job does (params from the checkpoint's policy, refreshing the master weights from bf16,
    then the rank's optimizer file) and take the same step again."""
    from safetensors.torch import load_file

    from pivotrl_hpc.checkpoint.writer import staging
    from pivotrl_hpc.runtime.checkpoint import load_training
    from pivotrl_hpc.protocol.messages import SaveCheckpoint

    tr, folder = w.trainer, staging(root, 1)   # the worker writes only into such a folder
    ok(w.handle(TrainStep(batch)))
    version = ok(w.handle(WaitWrite())).result["version"]
    saved = ok(w.handle(SaveCheckpoint(str(folder), version))).result
    params, mains = groups(tr)
    saved_state = everything(tr)
    ref = ok(w.handle(TrainStep(batch, publish=False))).result
    ref_params, ref_mains = groups(tr)
    resumed = {"folder": folder, "state": saved_state, "batch": batch, "loss": ref["loss"],
               "next": everything(tr)}
    tr.load_hf(load_file(str(folder / "policy" / "model.safetensors")))
    rounded = equal(groups(tr)[1], [p.float() for p in params])
    load_training(tr, folder, 0)
    r = {"ckpt_version": version, "ckpt_result": saved,
         "ckpt_refresh_rounds_main": rounded and not equal(groups(tr)[1], [p.float() for p
                                                                           in params]),
         "ckpt_params_bitwise": equal(groups(tr)[0], params),
         "ckpt_main_bitwise": equal(groups(tr)[1], mains)}
    again = ok(w.handle(TrainStep(batch, publish=False))).result
    r["ckpt_next_step_bitwise"] = (equal(groups(tr)[0], ref_params)
                                   and equal(groups(tr)[1], ref_mains)
                                   and again["loss"] == ref["loss"])
    return r, resumed


def resume_then_shift(cfg, ref: dict) -> dict:
    """A fresh worker resuming from the checkpoint (spec.resume, GPS holding its policy) as a
    requeued job's does: its state after the first shift up is the checkpoint's; a shift down
    and up after it moves the restored state (parameters, fp32 master, Adam) and gives it
    back bit for bit; the next step equals the uninterrupted run's."""
    folder = ref["folder"]
    spec = WorkerSpec(model_dirs={"policy": str(folder / "policy")}, trainer_config=cfg,
                      resume=str(folder))
    r: dict = {}
    with local_worker(spec, job=f"bf16r{os.getpid()}") as w:
        ok(w.handle(ShiftUp(RoleKind.TRAINING)))
        restored = everything(w.trainer)
        r["resume_state_bitwise"] = equal(restored, ref["state"])
        down = w.handle(ShiftDown())
        r["resume_shift_down_error"] = down.error
        if not down.ok:
            return r
        r["resume_freed"] = w.trainer.last_offload_bytes
        ok(w.handle(ShiftUp(RoleKind.TRAINING)))
        r["resume_shift_bitwise"] = equal(everything(w.trainer), restored)
        again = ok(w.handle(TrainStep(ref["batch"], publish=False))).result
        r["resume_next_step_bitwise"] = (equal(everything(w.trainer), ref["next"])
                                         and again["loss"] == ref["loss"])
    return r


def main(policy: str, out: str) -> None:
    store = init_world_of_one()  # noqa: F841 - keeps the rendezvous port bound
    cfg = TrainerConfig(model=ModelBuildConfig(dtype="bfloat16"),
                        optim=OptimConfig(lr=1e-4, clip_grad=0), micro_batch_size=4)
    root = Path(tempfile.mkdtemp(prefix="ckpt")) / "run.checkpoints"
    with local_worker(WorkerSpec(model_dirs={"policy": policy}, trainer_config=cfg,
                                 checkpoints=str(root)), job=f"bf16{os.getpid()}") as w:
        report, batch = scenario(w)
        round_trip, resumed = checkpoint_round_trip(w, batch, root)
        report.update(round_trip)
    report.update(resume_then_shift(cfg, resumed))
    with open(out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
