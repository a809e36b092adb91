"""Functions that the tests submit with submitit. They live in an importable module (the job
imports it by name, with tests/programs on PYTHONPATH), not in the test file."""
import os


def add_and_report(a: int, b: int) -> dict:
    """a + b, plus where it ran, so the test can tell it ran as a Slurm job."""
    return {
        "sum": a + b,
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "node": os.environ.get("SLURMD_NODENAME"),
    }


def rank_report(x: int) -> dict:
    """x times (global rank + 1), with submitit's view of the task layout."""
    import submitit

    env = submitit.JobEnvironment()
    return {
        "value": x * (env.global_rank + 1),
        "global_rank": env.global_rank,
        "local_rank": env.local_rank,
        "num_tasks": env.num_tasks,
        "node": os.environ.get("SLURMD_NODENAME"),
    }


def fail(message: str) -> None:
    """Raises, so the test can check that the error comes back through submitit."""
    raise ValueError(message)
