"""Where a run's checkpoints live and when one counts: whole, or absent.

    out/x.h5                      the trace (segment 0); a resumed job writes x.seg1.h5, ...
    out/x.checkpoints/
        step-000004/              one checkpoint: the policy after 4 trained steps
            policy/               HuggingFace folder (config, tokenizer, model.safetensors),
                                  what `pivotrl export` copies and vLLM / transformers load
            optim/rank-000.safetensors  per training rank: Megatron optimizer state (fp32
                                  main params, Adam moments), RNG states, steps done
            state.json            the controller: data cursor, RNG, policy version, samples
                                  in flight, fitted throughput constants, tau_shift
            COMPLETE              written last, after every file above is fsynced: their
                                  manifest (sizes, SHA-256 per file and per tensor), checked
                                  before a resume (checkpoint.manifest)
        .step-000006.tmp/         being written (or left by a killed job: removed on commit)

A checkpoint is written under its `.tmp` name and renamed once COMPLETE is in it, so a
reader sees a whole one or none; only the newest `keep` whole ones stay. Its folders are
0700 and its files 0600 (0750 / 0640 with trace.group_shared) whatever the umask
(checkpoint.writer, runtime.checkpoint).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any

from pivotrl_hpc.config.schema import names_a_path

MARK = "COMPLETE"
STATE = "state.json"
POLICY = "policy"
OPTIM = "optim"
FORMAT = "pivotrl-checkpoint/1"
# In the run's logs folder: a checkpoint asked for from outside ("checkpoint" or "requeue"),
# and the controller's answer once a requeue's checkpoint is whole (controller.checkpointing)
REQUEST_FILE = "checkpoint.request"
REQUEUE_FILE = "requeue"


class CheckpointError(ValueError):
    """A checkpoint asked for that is not there, not whole, or not of this job."""


def root_for(trace: str | os.PathLike) -> Path:
    """The checkpoints of the run whose (first) trace is `trace`."""
    return base_trace(Path(trace)).with_suffix(".checkpoints")


def base_trace(trace: Path) -> Path:
    """x.seg3.h5 -> x.h5 (every segment of a run shares its run files)."""
    stem = trace.stem
    if ".seg" in stem and stem.rsplit(".seg", 1)[1].isdigit():
        return trace.with_name(stem.rsplit(".seg", 1)[0] + trace.suffix)
    return trace


def name(step: int) -> str:
    return f"step-{step:06d}"


_NAME = re.compile(r"step-([0-9]{6,12})")   # what `name` writes, ASCII digits only


def step_of(path: Path) -> int:
    m = _NAME.fullmatch(path.name)
    if m is None:
        raise CheckpointError(f"{path}: not a checkpoint name (step-NNNNNN)")
    return int(m.group(1))


def is_whole(path: Path) -> bool:
    return (path / MARK).is_file() and (path / STATE).is_file() and (path / POLICY).is_dir()


def _own_folder(path: Path) -> bool:
    """A real folder (not a link) of this user: what a job of this user wrote."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def whole(root: Path) -> list[Path]:
    """Whole checkpoints under `root`, oldest first: folders of this user named as `name`
    names them (a link, another account's folder or another name is not one: issue 46)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.fullmatch(p.name) and _own_folder(p)
             and is_whole(p)]
    return sorted(found, key=step_of)


def latest(root: Path) -> Path | None:
    found = whole(root)
    return found[-1] if found else None


def _run_of(folder: Path) -> str | None:
    try:
        return str(json.loads((folder / STATE).read_text()).get("run") or "") or None
    except (OSError, ValueError, AttributeError):
        return None


def prunable(final: Path, keep: int) -> list[Path]:
    """What committing `final` drops: the whole checkpoints of its own run (its state's
    "run" id; those without one count as one run) but the newest `keep`. Another run's are
    never dropped: pruning by step order alone once removed a new run's step 1 as the
    oldest beside an earlier run's steps 8 and 10."""
    run = _run_of(final)
    mine = [p for p in whole(final.parent) if _run_of(p) == run]
    return mine[:-keep] if keep > 0 else mine


_STAGING = re.compile(r"\.step-[0-9]{6,12}\.tmp")   # what `staging` makes


def staging_in(root: str | os.PathLike, folder: str | os.PathLike) -> Path:
    """`folder` when it is a staging folder (`staging`) right inside the checkpoints folder
    `root`: all a training rank writes into, whatever a SaveCheckpoint names."""
    path = Path(os.path.abspath(folder))
    if not root or path.parent != Path(os.path.abspath(root)) or \
            not _STAGING.fullmatch(path.name):
        raise CheckpointError(f"a checkpoint into {str(folder)[:200]!r} refused: not a "
                              f"staging folder (.step-N.tmp) of this run's checkpoints folder "
                              f"{str(root) or '(none given at start)'}")
    return path


def optim_file(folder: Path, train_rank: int) -> Path:
    return Path(folder) / OPTIM / f"rank-{train_rank:03d}.safetensors"


def read_state(folder: Path) -> dict[str, Any]:
    path = Path(folder) / STATE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable checkpoint state ({e})") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} state file")
    for key in ("step", "version"):   # they name files and folders later: numbers only
        if type(state.get(key)) is not int or state[key] < 0:
            raise CheckpointError(f"{path}: {key} is {state.get(key)!r}, not a count")
    if not isinstance(state.get("fixed", {}), dict):
        raise CheckpointError(f"{path}: 'fixed' is not a mapping")
    return state


def resolve(resume: bool | str, trace: str | os.PathLike) -> Path | None:
    """The checkpoint a job starts from: `resume` true/"auto" -> the newest whole one of the
    run (None if there is none), false -> None, a path -> that one (or the newest whole one
    inside it, when it is a checkpoints folder or a run's trace)."""
    if names_a_path(resume):
        return find(resume)
    if resume is True or resume == "auto":
        return latest(root_for(trace))
    return None


def find(where: str | os.PathLike) -> Path:
    """A checkpoint folder, a checkpoints folder, or a run's trace -> a whole checkpoint."""
    p = Path(where)
    if p.suffix == ".h5":
        p = root_for(p)
    elif p.is_dir() and not p.name.endswith(".checkpoints") and not is_whole(p):
        runs = sorted(p.glob("*.checkpoints"))   # a run folder (e.g. Slurm's runs/NAME-ID)
        if len(runs) == 1:
            p = runs[0]
        elif len(runs) > 1:
            raise CheckpointError(f"{p} holds the checkpoints of {len(runs)} runs "
                                  f"({', '.join(r.name for r in runs)}): name one")
        elif any(p.glob("*.h5")):                 # a run folder that wrote none
            raise CheckpointError(f"{p}: {no_checkpoint(sorted(p.glob('*.h5'))[0])}")
    if p.name.endswith(".checkpoints") and not p.is_dir() and \
            (trace := p.with_suffix(".h5")).exists():
        raise CheckpointError(f"{where}: {no_checkpoint(trace)}")
    if is_whole(p):
        return p.resolve()
    if p.is_dir() and (newest := latest(p)) is not None:
        return newest.resolve()
    if p.is_dir() and p.name.startswith(("step-", ".step-")):
        raise CheckpointError(f"{p} is not a whole checkpoint (no {MARK}: its job died while "
                              "writing it); name an older one or its run")
    raise CheckpointError(f"no whole checkpoint at {p} (expected a step-N folder, a "
                          "*.checkpoints folder or a run's trace .h5)")


def no_checkpoint(trace: Path) -> str:
    """Why the run of `trace` has no checkpoint, and which setting makes them."""
    every = None
    try:
        every = json.loads(trace.with_suffix(".config.json").read_text())["rl"][
            "checkpoint_every"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    ran = (f"it ran with rl.checkpoint_every={every}" if every is not None else
           "its config is not beside its trace")
    why = ("periodic checkpoints were off" if every == 0 else
           "it stopped before its first checkpoint")
    return (f"the run has no checkpoint ({ran}: {why}); set rl.checkpoint_every=N to "
            "checkpoint every N steps and after the last one")


def clean_partial(root: Path) -> list[Path]:
    """Remove the `.step-N.tmp` folders a killed or cancelled job left half written (a
    starting job's own, before it writes any); returns them."""
    stale = sorted(root.glob(".step-*.tmp")) if root.is_dir() else []
    for tmp in stale:
        shutil.rmtree(tmp, ignore_errors=True)
    return stale


def segment_trace(trace: str | os.PathLike) -> Path:
    """The trace file of a new segment of this run: x.h5 first, then x.seg1.h5, ..."""
    base = base_trace(Path(trace))
    if not base.exists():
        return base
    n = 1
    while base.with_name(f"{base.stem}.seg{n}{base.suffix}").exists():
        n += 1
    return base.with_name(f"{base.stem}.seg{n}{base.suffix}")


def segments(trace: str | os.PathLike) -> list[Path]:
    """Every trace segment of the run, in order."""
    base = base_trace(Path(trace))
    out = [base] if base.exists() else []
    n = 1
    while (p := base.with_name(f"{base.stem}.seg{n}{base.suffix}")).exists():
        out.append(p)
        n += 1
    return out
