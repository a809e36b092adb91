"""One rank of a Megatron trainer scenario run, launched by tests/test_megatron_engine.py.

Env: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (one process per rank; the
launcher owns the rendezvous store, TORCHELASTIC_USE_AGENT_STORE=True).
Args: MODEL_DIR OUT_DIR TP [distopt] (distopt: Megatron's DistributedOptimizer). Writes
OUT_DIR/rank<R>.json with measured numbers; the test asserts on them. Every check runs in one
process group so that the expensive start-up (imports, group, model build) is paid once per
layout.
"""
from __future__ import annotations

import dataclasses

import json
import os
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from pivotrl_hpc.engines.megatron import cpu_shim  # noqa: E402
from pivotrl_hpc.engines.megatron.batch import RolloutBatch  # noqa: E402
from pivotrl_hpc.engines.megatron.model import ModelBuildConfig  # noqa: E402
from pivotrl_hpc.engines.megatron.parallel import destroy_model_parallel  # noqa: E402
from pivotrl_hpc.engines.megatron.trainer import (  # noqa: E402
    MegatronTrainer, OptimConfig, TrainerConfig)
from pivotrl_hpc.gps.shapes import ModelShape  # noqa: E402

STEPS = 4


def fixed_batch() -> RolloutBatch:
    """Two groups of four sequences of different lengths, rewards with spread in each group."""
    g = torch.Generator().manual_seed(7)
    prompts, responses = [], []
    for _ in range(8):
        prompts.append(torch.randint(3, 512, (5,), generator=g).tolist())
        n = int(torch.randint(3, 9, (1,), generator=g))
        responses.append(torch.randint(3, 512, (n,), generator=g).tolist())
    rewards = [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.25]
    return RolloutBatch.from_sequences(prompts, responses, [[0.0] * len(r) for r in responses],
                                       rewards, [0, 0, 0, 0, 1, 1, 1, 1])


def optimizer_snapshot(tr: MegatronTrainer) -> list[dict[str, torch.Tensor]]:
    inner = tr.optimizer.optimizer
    return [{k: v.clone() for k, v in inner.state[p].items()}
            for pg in inner.param_groups for p in pg["params"]]


def all_params(tr: MegatronTrainer) -> list[torch.Tensor]:
    """Model params, then the optimizer's own params (fp32 main shards under distopt)."""
    inner = tr.optimizer.optimizer
    return [p.detach() for p in tr.model.parameters()] + \
        [p.detach() for pg in inner.param_groups for p in pg["params"]]


def restore(tr: MegatronTrainer, params: list[torch.Tensor], state: list[dict]) -> None:
    inner = tr.optimizer.optimizer
    with torch.no_grad():
        for p, saved in zip(all_params(tr), params):
            p.copy_(saved)
        for live, saved in zip([inner.state[p] for pg in inner.param_groups
                                for p in pg["params"]], state):
            for k, v in saved.items():
                live[k].copy_(v)


def bitwise_equal(a: list, b: list) -> bool:
    if isinstance(a[0], dict):
        return all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)
    return all(torch.equal(x, y) for x, y in zip(a, b))


def hf_checks(res: dict, tr: MegatronTrainer, model_dir: Path, tokens: torch.Tensor) -> None:
    from transformers import Qwen2ForCausalLM

    hf = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(tokens).logits
    res["hf_logits_maxdiff"] = (tr.forward_logits(tokens) - ref).abs().max().item()
    res["hf_logits_absmax"] = ref.abs().max().item()
    batch = fixed_batch()
    with torch.no_grad():
        ref_lp = torch.log_softmax(hf(batch.tokens).logits[:, :-1], -1).gather(
            -1, batch.tokens[:, 1:, None]).squeeze(-1)
    lp = tr.compute_logprobs(batch)
    res["hf_logprobs_maxdiff"] = (lp[:, 1:] - ref_lp).abs().max().item()


def shift_checks(res: dict, tr: MegatronTrainer, batch: RolloutBatch) -> None:
    """Step k+1 with and without offload/reload in between must be bitwise identical."""
    params0 = [p.clone() for p in all_params(tr)]
    state0 = optimizer_snapshot(tr)
    plain = tr.train_step(batch)
    params_plain = [p.clone() for p in all_params(tr)]
    restore(tr, params0, state0)
    exp_avg = tr.optimizer.optimizer.state[tr.optimizer.optimizer.param_groups[0]["params"][0]]
    res["offload_seconds"] = tr.offload()
    res["offload_bytes"] = tr.last_offload_bytes
    res["freed_storage_bytes_while_offloaded"] = (
        exp_avg["exp_avg"].untyped_storage().nbytes()
        + sum(p.untyped_storage().nbytes() for p in tr.model.parameters()))
    try:
        tr.train_step(batch)
        res["step_while_offloaded_error"] = None
    except RuntimeError as e:  # torch raises one of its own on a freed param: keep the text
        res["step_while_offloaded_error"] = str(e)
    res["reload_seconds"] = tr.reload()
    res["state_bitwise_after_reload"] = bitwise_equal(optimizer_snapshot(tr), state0)
    res["params_bitwise_after_reload"] = bitwise_equal(all_params(tr), params0)
    shifted = tr.train_step(batch)
    res["loss_plain"], res["loss_shifted"] = plain["loss"], shifted["loss"]
    res["params_after_step_bitwise"] = bitwise_equal(all_params(tr), params_plain)
    # Shift down that keeps the weights resident: only optimizer state and grads move.
    tr.offload(include_params=False)
    res["partial_offload_bytes"] = tr.last_offload_bytes
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in tr.model.parameters()}  # distopt: params are views of one buffer
    res["params_resident_bytes"] = sum(storages.values())
    tr.reload()


def export_checks(res: dict, tr: MegatronTrainer, model_dir: Path, tokens: torch.Tensor) -> None:
    from transformers import Qwen2ForCausalLM

    full = tr.export_hf_full()
    hf = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    missing, unexpected = hf.load_state_dict(full, strict=False)
    res["export_missing"], res["export_unexpected"] = list(missing), list(unexpected)
    initial = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    res["export_max_weight_change"] = max((full[n] - initial[n]).abs().max().item() for n in full)
    with torch.no_grad():
        ref = hf(tokens).logits
    res["export_logits_maxdiff"] = (tr.forward_logits(tokens) - ref).abs().max().item()
    slices = tr.export_hf()
    res["export_slices_match_full"] = all(torch.equal(full[n][idx], v) for n, idx, v in slices)
    res["export_slice_names"] = len({n for n, _, _ in slices})


def stale_checks(res: dict, tr: MegatronTrainer, batch: RolloutBatch) -> None:
    """A stale batch (behaviour logprobs 1 nat below the policy's): "behaviour" clips it,
    "recompute" starts the step on-policy (ratio exactly 1) and reports the gap."""
    stale = dataclasses.replace(batch, behaviour_logprobs=torch.where(
        batch.response_mask, tr.compute_logprobs(batch) - 1.0, torch.zeros(())))
    grpo = tr.cfg.grpo
    for mode in ("behaviour", "recompute"):
        tr.cfg = dataclasses.replace(tr.cfg, grpo=dataclasses.replace(grpo, old_logprobs=mode))
        res[f"stale_{mode}"] = tr.train_step(stale)
    tr.cfg = dataclasses.replace(tr.cfg, grpo=grpo)


def main() -> None:
    model_dir, out_dir, tp = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    distopt = sys.argv[4:] == ["distopt"]
    rank = int(os.environ["RANK"])
    t0 = time.perf_counter()
    shape = ModelShape.from_hf_config(model_dir)
    cfg = TrainerConfig(model=ModelBuildConfig(tp_size=tp),
                        optim=OptimConfig(lr=5e-5, clip_grad=1.0,
                                          use_distributed_optimizer=distopt),
                        micro_batch_size=2)
    tr = MegatronTrainer(shape, cfg)
    res: dict = {"rank": rank, "tp": tp, "layout": vars(tr.layout), "distopt": distopt,
                 "optimizer_class": type(tr.optimizer).__name__,
                 "shim_applied": cpu_shim.is_applied(),
                 "cuda_available": torch.cuda.is_available()}
    tr.load_hf_folder(model_dir)
    res["setup_seconds"] = time.perf_counter() - t0
    tokens = torch.randint(0, shape.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    hf_checks(res, tr, model_dir, tokens)

    base = fixed_batch()
    lp = tr.compute_logprobs(base)  # on-policy start: behaviour = current policy
    batch = RolloutBatch(base.tokens, base.response_mask,
                         torch.where(base.response_mask, lp, torch.zeros_like(lp)),
                         base.rewards, base.group_ids)
    res["metrics"] = [tr.train_step(batch) for _ in range(STEPS)]
    shift_checks(res, tr, batch)
    export_checks(res, tr, model_dir, tokens)
    stale_checks(res, tr, batch)
    res["total_seconds"] = time.perf_counter() - t0
    (out_dir / f"rank{rank}.json").write_text(json.dumps(res, indent=1))
    destroy_model_parallel()


if __name__ == "__main__":
    main()
