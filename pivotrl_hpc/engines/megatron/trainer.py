"""The training role: Megatron-Core GPTModel + DDP + Megatron optimizer, trained with GRPO.

One object per training rank. Every rank of the training group gets the same global batch
(`RolloutBatch`); the advantages and the token normaliser are computed from the whole batch,
and each data-parallel rank then trains on its contiguous share of the rows. TP ranks of a
group see the same rows and compute the same (vocab-parallel) logprobs.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist

from pivotrl_hpc.engines.megatron.batch import RolloutBatch
from pivotrl_hpc.engines.megatron.grpo import GRPOConfig, group_advantages, policy_loss
from pivotrl_hpc.engines.megatron.model import ModelBuildConfig, build_gpt_model
from pivotrl_hpc.engines.megatron.offload import HostOffloader, unique_storages
from pivotrl_hpc.engines.megatron.parallel import (
    device_scope, ensure_device_support, initialize_model_parallel, on_gpu)
from pivotrl_hpc.gps.convert import hf_to_megatron, megatron_shard_to_hf_slices, megatron_to_hf
from pivotrl_hpc.gps.shapes import ModelShape

log = logging.getLogger(__name__)


def preload_megatron() -> None:
    """Import the Megatron-Core modules a trainer build imports (2 CPU-s): a worker does it
    at job start-up, so that its first shift up to training is not spent importing under
    the device's CPU cap."""
    import megatron.core.distributed
    import megatron.core.models.gpt.gpt_layer_specs
    import megatron.core.optimizer
    import megatron.core.tensor_parallel
    import megatron.core.transformer.module  # noqa: F401 - loaded, not named


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # 0 disables clipping (the grad norm is still reported)
    use_distributed_optimizer: bool = False


@dataclass(frozen=True)
class TrainerConfig:
    model: ModelBuildConfig = field(default_factory=ModelBuildConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    micro_batch_size: int = 0  # sequences per forward/backward on a rank; 0 = all at once
    seed: int = 1234


class MegatronTrainer:
    def __init__(self, shape: ModelShape, cfg: TrainerConfig) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module

        if shape.vocab_size % cfg.model.tp_size:
            raise ValueError(f"vocab {shape.vocab_size} not divisible by TP={cfg.model.tp_size}")
        self.shape, self.cfg = shape, cfg
        # Process groups first: on GPU that binds this rank's device (LOCAL_RANK).
        self.layout = initialize_model_parallel(cfg.model.tp_size, cfg.seed)
        self.device = ensure_device_support()
        self.core = build_gpt_model(shape, cfg.model)
        config = self.core.config
        module = Float16Module(config, self.core) if config.bf16 else self.core
        o = cfg.optim
        with device_scope():
            self.model = DistributedDataParallel(
                config, DistributedDataParallelConfig(
                    grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                    use_distributed_optimizer=o.use_distributed_optimizer), module)
            self.optimizer = get_megatron_optimizer(OptimizerConfig(
                optimizer="adam", lr=o.lr, min_lr=o.lr, weight_decay=o.weight_decay,
                adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                clip_grad=o.clip_grad, bf16=config.bf16, params_dtype=config.params_dtype,
                use_distributed_optimizer=o.use_distributed_optimizer), [self.model])
        self._offloader = HostOffloader(pin_memory=on_gpu())
        self.steps_done = 0
        self.last_offload_bytes: dict[str, int] = {}       # device bytes freed per category
        self.last_offload_host_bytes: dict[str, int] = {}  # of those, kept in host memory
        self.last_reload_bytes: dict[str, int] = {}        # device bytes given back

    # --- weights -------------------------------------------------------------------------
    def load_hf(self, tensors: Mapping[str, torch.Tensor],
                refresh_main_params: bool = True) -> None:
        """Load full canonical HF tensors (GPS Read or a safetensors file) into this shard."""
        self._require_resident()
        shard = hf_to_megatron(tensors, self.shape, self.layout.tp_rank, self.layout.tp_size)
        self.load_shard(shard, refresh_main_params)

    def load_shard(self, shard: Mapping[str, torch.Tensor],
                   refresh_main_params: bool = True) -> None:
        """Load this TP rank's Megatron shard as is (a GPS Read with `layout="megatron"`:
        exactly the slices this rank needs, paper §5.1)."""
        self._require_resident()
        params = dict(self.core.named_parameters())
        if set(params) != set(shard):
            raise KeyError(f"shard/model names differ: {sorted(set(params) ^ set(shard))}")
        with torch.no_grad():
            for name, p in params.items():
                if tuple(p.shape) != tuple(shard[name].shape):
                    raise ValueError(f"{name}: model {tuple(p.shape)} vs shard "
                                     f"{tuple(shard[name].shape)}")
                p.copy_(shard[name])
        if refresh_main_params:
            # First load only: afterwards the fp32 main params (reloaded from host on shift
            # up) are the master copy, and refreshing them from bf16 params would round them.
            with device_scope():
                self.optimizer.reload_model_params()

    def load_hf_folder(self, folder: str | Path) -> None:
        from safetensors.torch import load_file

        tensors: dict[str, torch.Tensor] = {}
        for f in sorted(Path(folder).glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        self.load_hf(tensors)

    def shard_state(self) -> dict[str, torch.Tensor]:
        """This rank's Megatron-named parameter shard (detached views, on the device)."""
        return {n: p.detach() for n, p in self.core.named_parameters()}

    def export_hf(self) -> list[tuple[str, tuple[slice, ...], torch.Tensor]]:
        """This rank's shard as (HF name, index into the full tensor, values on the host).

        What a training rank hands to GPS Write; no TP communication. Replicated tensors
        (norms) come from every TP rank.
        """
        host = {n: t.to("cpu", copy=True) for n, t in self.shard_state().items()}
        return megatron_shard_to_hf_slices(host, self.shape, self.layout.tp_rank,
                                           self.layout.tp_size)

    def export_hf_full(self) -> dict[str, torch.Tensor]:
        """Full HF tensors on every rank of the TP group (all-gather of the shards)."""
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(self.layout.tp_size)]
        for name, t in self.shard_state().items():
            parts = [torch.empty_like(t) for _ in range(self.layout.tp_size)]
            dist.all_gather(parts, t.contiguous(), group=group)
            for rank, part in enumerate(parts):
                shards[rank][name] = part.cpu()
        return megatron_to_hf(shards, self.shape)

    # --- forward -------------------------------------------------------------------------
    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel logits [B, S, V/tp], float32."""
        tokens = tokens.to(self.device)
        pos = torch.arange(tokens.shape[1], device=self.device).unsqueeze(0).expand_as(tokens)
        # attention_mask=None: the causal mask is built inside attention; right padding
        # only follows real tokens, so it never leaks into them.
        return self.model(tokens, pos, None).float()

    def _token_logprobs(self, tokens: torch.Tensor) -> torch.Tensor:
        """log p(tokens[:, t] | tokens[:, :t]) for t >= 1, [B, S] with column 0 = 0."""
        from megatron.core import tensor_parallel

        logits = self._forward(tokens)[:, :-1] / self.cfg.grpo.temperature
        labels = tokens[:, 1:].to(self.device)
        # Megatron's vocab-parallel cross entropy: max/sum-exp/target logit are reduced over
        # the TP group, so no rank ever materialises full-vocab logits.
        nll = tensor_parallel.vocab_parallel_cross_entropy(logits.contiguous(), labels)
        return torch.nn.functional.pad(-nll, (1, 0))

    @torch.no_grad()
    def forward_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Full-vocab logits [B, S, V] (gathered over TP) on the host: for checks and export."""
        from megatron.core import tensor_parallel

        self._require_resident()
        self.model.eval()
        with device_scope():
            local = self._forward(tokens)
            full = tensor_parallel.gather_from_tensor_model_parallel_region(local)
        return full.cpu()

    @torch.no_grad()
    def compute_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """Current-policy logprobs of the batch's tokens [B, S] (0 at column 0), host tensor.

        Each DP rank scores its share; the shares are all-gathered so every rank returns all.
        """
        from megatron.core import parallel_state

        self._require_resident()
        self.model.eval()
        rows = self._dp_rows(batch.num_sequences)
        with device_scope():
            local = torch.cat([self._token_logprobs(batch.tokens[mb])
                               for mb in self._micro_slices(rows)])
            if self.layout.dp_size == 1:
                return local.cpu()
            parts = [torch.empty_like(local) for _ in range(self.layout.dp_size)]
            dist.all_gather(parts, local, group=parallel_state.get_data_parallel_group())
        return torch.cat(parts).cpu()

    # --- training ------------------------------------------------------------------------
    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """One GRPO optimizer step on the global batch. Returns metrics over the whole batch."""
        self._require_resident()
        t0 = time.perf_counter()
        g = self.cfg.grpo
        adv = group_advantages(batch.rewards, batch.group_ids, g.adv_eps, g.normalize_std)
        normaliser = float(batch.num_response_tokens)
        if normaliser == 0:
            raise ValueError("batch has no response tokens")
        rows = self._dp_rows(batch.num_sequences)
        gap = None
        if g.old_logprobs == "recompute":
            old = self.compute_logprobs(batch) * batch.response_mask
            gap = float(((old - batch.behaviour_logprobs) * batch.response_mask).sum()
                        / normaliser)  # mean log(pi_now / pi_behaviour): how stale
            batch = replace(batch, behaviour_logprobs=old.float())
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        totals = torch.zeros(5, dtype=torch.float64)  # loss, clipped, ratio, kl, tokens
        with device_scope():
            for mb in self._micro_slices(rows):
                part = batch.select(mb)
                ref = None if part.reference_logprobs is None else \
                    part.reference_logprobs.to(self.device)
                sums = policy_loss(self._token_logprobs(part.tokens),
                                   part.behaviour_logprobs.to(self.device),
                                   adv[mb].to(self.device), part.response_mask.to(self.device),
                                   g, normaliser, reference_logprobs=ref)
                sums.loss.backward()
                totals += torch.tensor([float(sums.loss.detach()), sums.clipped_tokens,
                                        sums.ratio_sum, sums.kl_sum, sums.tokens],
                                       dtype=torch.float64)
            self.model.finish_grad_sync()
            success, grad_norm, _ = self.optimizer.step()
            if self.cfg.optim.clip_grad <= 0:
                grad_norm = self.optimizer.get_grad_norm()
        totals = self._dp_sum(totals)
        self.steps_done += 1
        return {"loss": totals[0].item(), "clip_fraction": (totals[1] / totals[4]).item(),
                "mean_ratio": (totals[2] / totals[4]).item(), "kl": (totals[3] / totals[4]).item(),
                "grad_norm": float(grad_norm), "tokens": int(totals[4].item()),
                "update_applied": float(bool(success)), "seconds": time.perf_counter() - t0,
                **({} if gap is None else {"behaviour_log_ratio": gap})}

    def _dp_sum(self, values: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state

        if self.layout.dp_size == 1:
            return values
        # float64 on the host so the metric sum is exact; gloo groups reduce host tensors.
        group = parallel_state.get_data_parallel_group(with_context_parallel=False)
        buf = values.to(self.device)
        dist.all_reduce(buf, group=group)
        return buf.cpu()

    def _dp_rows(self, n: int) -> slice:
        dp, rank = self.layout.dp_size, self.layout.dp_rank
        if n % dp:
            raise ValueError(f"{n} sequences do not split evenly over DP={dp}")
        share = n // dp
        return slice(rank * share, (rank + 1) * share)

    def _micro_slices(self, rows: slice) -> list[slice]:
        size = self.cfg.micro_batch_size or (rows.stop - rows.start)
        return [slice(s, min(s + size, rows.stop)) for s in range(rows.start, rows.stop, size)]

    # --- role shifting -------------------------------------------------------------------
    def _param_tensors(self) -> list[torch.Tensor]:
        """Model params and, under the distributed optimizer, the flat buffers holding them."""
        bufs = list(self.model.buffers) + list(self.model.expert_parallel_buffers)
        return list(self.model.parameters()) + [b.param_data for b in bufs
                                                if b.param_data is not None]

    def _offload_groups(self) -> dict[str, list[torch.Tensor]]:
        opts = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        model_params = {id(p) for p in self.model.parameters()}
        groups: dict[str, list[torch.Tensor]] = {"optimizer_state": [], "main_params": [],
                                                 "grads": [], "params": []}
        for opt in opts:
            inner = opt.optimizer
            for state in inner.state.values():
                groups["optimizer_state"] += [v for v in state.values()
                                              if isinstance(v, torch.Tensor)]
            for pg in inner.param_groups:
                for p in pg["params"]:
                    if id(p) not in model_params:  # fp32 master copy of a bf16 param
                        groups["main_params"].append(p)
                    if p.grad is not None:
                        groups["grads"].append(p.grad)
        for buf in list(self.model.buffers) + list(self.model.expert_parallel_buffers):
            groups["grads"].append(buf.grad_data)
        groups["params"] = self._param_tensors()
        return groups

    def offload(self, include_params: bool = True,
                discard_params: bool = False) -> dict[str, float]:
        """Shift down: move optimizer state, grads, main params (and params) to host memory.

        With include_params=False the model params stay resident (e.g. when the next role on
        this device reads the same policy weights). With discard_params=True they are freed
        without a copy, as the paper treats parameters (stateless: GPS holds them); the
        caller must `load_hf(..., refresh_main_params=False)` after `reload()`. Returns
        seconds per phase.
        """
        t0 = time.perf_counter()
        groups = self._offload_groups()
        keep = [] if include_params else groups.pop("params")
        discard = ("params",) if include_params and discard_params else ()
        stats = self._offloader.offload(groups, keep_resident=keep, discard=discard)
        if on_gpu():
            torch.cuda.empty_cache()  # hand the freed blocks back for the next role
        self.last_offload_bytes, self.last_offload_host_bytes = stats.bytes, stats.host_bytes
        return dict(stats.seconds, total=time.perf_counter() - t0)

    def reload(self) -> dict[str, float]:
        """Shift up: bring back everything `offload` moved; returns seconds per phase."""
        t0 = time.perf_counter()
        stats = self._offloader.reload()
        self.last_reload_bytes = stats.bytes
        return dict(stats.seconds, total=time.perf_counter() - t0)

    def device_bytes(self) -> int:
        """Bytes of the role's state on the device (params, main params, optimizer state,
        grads; each storage once): what a shift down frees, 0 while offloaded."""
        seen: set[int] = set()
        return sum(s.nbytes() for tensors in self._offload_groups().values()
                   for s in unique_storages(tensors, seen))

    def _require_resident(self) -> None:
        if self._offloader.offloaded:
            raise RuntimeError("trainer state is offloaded; call reload() first")
