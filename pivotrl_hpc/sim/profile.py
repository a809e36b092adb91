"""Device profiles from the hardware and the model's dimensions (issue 12: the paper's groups).

The simulator needs, per model group, the throughput constants A-D of each inference role
(paper appendix A), the seconds of a training step and the seconds of each shift. On the
paper's cluster they were profiled offline; here they are derived from the datasheet figures
of the hardware (`Hardware`) and the model's config (`gps.shapes.ModelShape`), so
`pivotrl simulate` on a paper group answers from that group's models, not from defaults.

Per GPU of a replica of tensor-parallel degree `tp` (EP spreads the experts the same way):
- A = KV bytes of one token read on this GPU / (eta_mem * HBM bandwidth). Every decode
  iteration reads each running sequence's whole KV cache; a GPU holds max(1/tp, 1/kv_heads)
  of it (KV heads are replicated once tp exceeds them).
- B = weight bytes read per iteration on this GPU / (eta_mem * HBM bandwidth): all
  parameters / tp for a dense model. For an MoE model B is the dense part (attention,
  embeddings, shared experts, dense layers) and `expert_B` the routed experts, of which an
  iteration of n sequences reads the expected distinct fraction 1 - (1 - k/E)^n per layer
  (top-k of E; `sched.model.MoEThroughputModel`): a tail of one Qwen3-30B-A3B judgement
  reads 8 of 128 experts a layer, a batch of 100 all but 0.2 %.
- C = 2 * active parameters / tp / (eta_flop * bf16 FLOP/s): the GEMM work of one more
  sequence once the FFN is compute bound.
- prefill, seconds per token = C: a prompt's tokens (and a migrated sequence's prompt +
  generated tokens where it lands) go through the same GEMMs, compute bound.
- D = `step_overhead_s` (scheduler, sampling, launches) + 2 all-reduces per layer at
  `allreduce_s` each when tp > 1.
- training step (`train_costs`), on `devices` GPUs at tensor parallel tp (within a node)
  and data parallel dp = devices / tp, as the Megatron-Core trainer runs it:
  compute 8 * active parameters * tokens / (devices * bf16 FLOP/s * mfu_train) (forward +
  backward 6 N a token, the recomputed old-policy log-probabilities 2 N); TP's activation
  all-reduces, 6 a layer a token (2 in each forward, 2 in the backward) of hidden * 2 bytes
  over NVLink, each DP rank its tokens / dp; once a step the fp32 gradient all-reduce
  (`grad_reduce_in_fp32=True, overlap_grad_reduce=False`: not hidden behind the backward)
  of 4 * parameters / tp bytes, a ring over dp ranks, on NVLink inside a node, else on the
  InfiniBand link (one per GPU: the ring's slowest hop); and each rank's Adam step over its
  whole shard (no distributed optimizer: fp32 master, m, v, grad read and master, m, v
  written, 28 bytes a parameter / tp at eta_mem of HBM). Wider training divides compute,
  not the gradient all-reduce or the optimizer step.
- shift up of an inference replica = `engine_wake_s` + its weight bytes per GPU over the
  GPS Read link (PCIe: replication-first GPS makes every Read node-local, appendix B.1);
  shift down = `engine_sleep_s` (weights and KV cache are discarded, nothing moves).
- training shift up = `train_wake_s` + bf16 weights per GPU (GPS Read) + fp32 master
  weights and Adam moments (12 bytes a parameter, sharded over the training GPUs) back from
  host memory; shift down = `train_sleep_s` + those 12 bytes a parameter out to the host.
The efficiency factors and fixed seconds are assumptions, named and set in `Hardware`;
`PAPER_SHIFTS` holds the paper's Figure 12 ranges the derived shift seconds are tested
against.
"""
from __future__ import annotations

from dataclasses import dataclass

from pivotrl_hpc.gps.memory import DEVICE_MEMORY_GIB
from pivotrl_hpc.gps.shapes import ModelShape, itemsize
from pivotrl_hpc.sched.model import MoEThroughputModel, ThroughputModel


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_gib: float        # device memory (gps/memory.py derives the KV cache from it)
    hbm_bps: float           # HBM bandwidth of one GPU, bytes/s
    bf16_flops: float        # dense bf16 tensor FLOP/s of one GPU
    pcie_bps: float          # host <-> GPU (a node-local GPS Read)
    nvlink_bps: float        # GPU <-> GPU inside a node
    ib_bps: float            # node <-> node
    eta_mem: float = 0.7     # achieved / peak HBM bandwidth in decode kernels
    eta_flop: float = 0.5    # achieved / peak FLOP/s of decode GEMMs once compute bound
    mfu_train: float = 0.35  # model FLOP utilisation of a Megatron training step
    step_overhead_s: float = 3e-3
    allreduce_s: float = 10e-6
    engine_wake_s: float = 1.0
    engine_sleep_s: float = 0.5
    train_wake_s: float = 1.5
    train_sleep_s: float = 1.0


# The paper's cluster (§8.1): NVIDIA H20 96 GB (4.0 TB/s HBM3, 148 TFLOP/s dense bf16),
# NVLink 900 GB/s, InfiniBand 50 GB/s, PCIe 63 GB/s (§5.1).
H20 = Hardware("H20-96GB", memory_gib=DEVICE_MEMORY_GIB["gpu"], hbm_bps=4.0e12,
               bf16_flops=148e12, pcie_bps=63e9, nvlink_bps=900e9, ib_bps=50e9)
HARDWARE = {"h20": H20}

# The paper's Figure 12 (read off the figure, seconds): shift up / down per model size.
PAPER_SHIFTS = {"inference_up": (1.0, 9.0), "inference_down_max": 2.0,
                "training_up": (2.0, 8.5), "training_down_max": 6.0}


def inference_model(shape: ModelShape, dtype: str, tp: int, hw: Hardware) -> ThroughputModel:
    b, mem = itemsize(dtype), hw.eta_mem * hw.hbm_bps
    kv_share = max(1.0 / tp, 1.0 / shape.num_kv_heads)
    A = shape.kv_bytes_per_token(b) * kv_share / mem
    C = prefill_seconds(shape, tp, hw)   # one sequence's GEMM work: a prefilled token's too
    D = hw.step_overhead_s + (2 * shape.num_layers * hw.allreduce_s if tp > 1 else 0.0)
    experts = shape.routed_expert_params()
    B = (shape.num_params() - experts) * b / tp / mem
    if not experts:
        return ThroughputModel(A, B, C, D)
    return MoEThroughputModel(A, B, C, D, expert_B=experts * b / tp / mem,
                              experts=shape.num_experts, top_k=shape.num_experts_per_tok)


def prefill_seconds(shape: ModelShape, tp: int, hw: Hardware) -> float:
    """Seconds one replica spends prefilling one token: the decode iteration's compute-bound
    GEMM work of one sequence (C), as prefill batches a prompt's tokens into large GEMMs.
    Attention over the prompt (2 * layers * q_size * L FLOPs a token at L tokens) is left
    out, an under-estimate that grows with L and with few active parameters: Qwen2.5-7B
    +3 % at 2K tokens; Qwen3-30B-A3B (3.3e9 active) +26 % at 4.5K, +100 % at 17K."""
    return 2.0 * shape.num_active_params() / tp / (hw.eta_flop * hw.bf16_flops)


def train_seconds(shape: ModelShape, tokens: float, devices: int, hw: Hardware) -> float:
    """Compute alone: perfect scaling with width (`train_costs` adds the communication)."""
    return 8.0 * shape.num_active_params() * tokens / (devices * hw.bf16_flops * hw.mfu_train)


TP_ALLREDUCES_PER_LAYER = 6   # 2 in each forward (old log-probabilities, loss), 2 backward
GRAD_BYTES = 4                # grad_reduce_in_fp32 (engines/megatron/trainer.py)
ADAM_BYTES = 28               # fp32 master, m, v, grad read; master, m, v written


def _ring(n: int) -> float:
    """Bytes each member of a ring all-reduce of n members sends per byte reduced."""
    return 2.0 * (n - 1) / n


def train_costs(shape: ModelShape, devices: int, tp: int, devices_per_node: int,
                hw: Hardware) -> tuple[float, float]:
    """(seconds a step, seconds a token) of a training step on `devices` GPUs at tensor
    parallel `tp` (module docstring): the step's gradient all-reduce and Adam, and per
    token the compute and the TP all-reduces."""
    dp = devices // tp
    per_token = train_seconds(shape, 1.0, devices, hw)
    if tp > 1:
        per_token += (TP_ALLREDUCES_PER_LAYER * shape.num_layers * shape.hidden_size * 2
                      * _ring(tp) / hw.nvlink_bps / dp)
    link = hw.nvlink_bps if devices <= devices_per_node else hw.ib_bps
    grads = GRAD_BYTES * shape.num_params() / tp * _ring(dp) / link if dp > 1 else 0.0
    adam = ADAM_BYTES * shape.num_params() / tp / (hw.eta_mem * hw.hbm_bps)
    return grads + adam, per_token


def inference_shift(shape: ModelShape, dtype: str, tp: int, hw: Hardware
                    ) -> tuple[float, float]:
    """(up, down) seconds of one inference replica."""
    return hw.engine_wake_s + shape.num_params() * itemsize(dtype) / tp / hw.pcie_bps, \
        hw.engine_sleep_s


def training_shift(shape: ModelShape, devices: int, tp: int, hw: Hardware
                   ) -> tuple[float, float]:
    """(up, down) seconds of the training role on `devices` GPUs at tensor parallel `tp`."""
    n = shape.num_params()
    states = 12.0 * n / devices / hw.pcie_bps       # fp32 master + Adam m, v: 12 B a param
    return hw.train_wake_s + 2.0 * n / tp / hw.pcie_bps + states, hw.train_sleep_s + states


def replication(nbytes: int, nodes: int, writer_nodes: int, hw: Hardware) -> dict:
    """One GPS Write replicated to every node as the agents plan it (gps.plan.chain: every
    receiver forwards to the next) and as they did before (`_star`: the writers send every
    node its copy), each run through plan.pipelined_seconds over the cluster's links: its
    seconds and the bytes it moves."""
    from pivotrl_hpc.gps.plan import LinkModel, assign, chain, pipelined_seconds, refine

    links = LinkModel(local_bps=hw.pcie_bps, remote_bps=hw.ib_bps)
    holders = {n: [(0, nbytes)] for n in range(min(writer_nodes, nodes))}
    targets = {n: [(0, nbytes)] for n in range(nodes)}
    plans = {"": chain(holders, targets, links).transfers,
             "_star": assign(refine(holders, targets), links)}
    out = {}
    for suffix, plan in plans.items():
        out[f"write_replication{suffix}_s"] = pipelined_seconds(plan, links)
        out[f"write_replication{suffix}_bytes"] = sum(t.nbytes for t in plan)
    return out


def calibrated(constants, cal):
    """`constants` (a `sim.run.SimConstants` from the datasheet) with a paper group's fit
    applied (`Config.calibration`, written by `pivotrl reproduce calibrate`): each model's
    A-D (and an MoE's expert_B) and prefill seconds times its scale, training seconds (a
    step's and a token's) times train_scale,
    and each shift's seconds where the calibration names them (the paper's Figure 12). The
    planner's own estimates follow, since it reads the same constants (sim/run.py)."""
    from dataclasses import replace

    scale = {"policy": cal.policy_scale, "genrm": cal.genrm_scale}
    models = {m: t.scaled(scale[m]) for m, t in constants.throughput.items()}
    up, down = dict(constants.shift_up_s), dict(constants.shift_down_s)
    for role in ("rollout", "reward", "training"):
        up[role] = getattr(cal, f"shift_up_s_{role}") or up[role]
        down[role] = getattr(cal, f"shift_down_s_{role}") or down[role]
    return replace(constants, throughput=models, shift_up_s=up, shift_down_s=down,
                   train_s=constants.train_s * cal.train_scale,
                   train_s_per_token=constants.train_s_per_token * cal.train_scale,
                   prefill_s_per_token={m: s * scale.get(m, 1.0) for m, s
                                        in constants.prefill_s_per_token.items()},
                   source=f"{constants.source}, calibrated" if cal != type(cal)() else
                   constants.source)
