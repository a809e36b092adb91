"""Megatron-Core training engine (the training role).

- `parallel`: device support (GPU: NCCL; CPU: gloo + `cpu_shim`) and process groups
- `model`: GPTModel for a Qwen2-architecture `ModelShape`, tensor parallel
- `trainer`: `MegatronTrainer` (load from GPS/HF, GRPO `train_step`, `compute_logprobs`,
  `export_hf`, `offload`/`reload` for role shifts)
- `grpo`, `batch`, `offload`: the loss math, the batch layout, host offload of state

Submodules import Megatron-Core lazily, so importing this package stays cheap.
"""
