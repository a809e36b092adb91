"""pivotrl-hpc: resource-shiftable RL post-training with GenRM."""
__version__ = "0.1.0"


def submit(config, overrides=(), **options):
    """Submit an RL job to Slurm from Python (submitit): `job = pivotrl_hpc.submit(
    "configs/x.yaml", ["rl.steps=10"], nodes=2, gpus_per_node=8, partition="gpu", time=60)`;
    `job.result()` is the run summary. See `pivotrl_hpc.launch.submit.submit`."""
    from pivotrl_hpc.launch.submit import submit as _submit

    return _submit(config, overrides, **options)
