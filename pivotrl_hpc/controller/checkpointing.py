"""The loop's checkpoints: when one is due, who writes what, and the resume.

A checkpoint is taken right after a step's policy is replicated (`Controller._published`),
while the trainer is still resident: the training unit stays active until every training
rank has written its part, so no shift can move it meanwhile; rollout and reward go on. The
controller's state is captured at that moment and written last, then the folder is made
whole (checkpoint.writer.commit).

On request one is taken after the next step: `request()` (SIGUSR1 to rank 0), or a request
file the batch step writes (`<run>.logs/checkpoint.request`, polled once a second) when Slurm
signals the time limit (`--signal=B:USR1@...`, launch.slurm) or submitit its timeout. A
"requeue" request also ends the job once the checkpoint is whole (marker `<run>.logs/requeue`
for the batch step, which then runs `scontrol requeue`).

A stop signal (SIGTERM: a Slurm preemption with its grace time `rl.preempt_grace_s`) asks
for a "stop": a checkpoint after the running step, then the end of the job, but only when
`fits` says that step and its checkpoint end inside the grace time; otherwise the job stops
at once and resumes from its last periodic checkpoint.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping

from pivotrl_hpc.checkpoint import layout, writer
from pivotrl_hpc.checkpoint.folders import take_own, write_text
from pivotrl_hpc.controller.flow import check_replies
from pivotrl_hpc.controller.run_state import capture, restore
from pivotrl_hpc.protocol.messages import Reply, SaveCheckpoint

log = logging.getLogger(__name__)

REQUEST, REQUEUE = layout.REQUEST_FILE, layout.REQUEUE_FILE
STOP = "stop"
MODES = ("checkpoint", STOP, REQUEUE)   # a later request never weakens an earlier one
FIT_MARGIN = 0.8                        # of the grace time: the rest for the shutdown


class Checkpointer:
    def __init__(self, root: Path, every: int, keep: int, fixed: Mapping[str, Any],
                 logs: Path | None = None, group_shared: bool = False) -> None:
        self.root, self.every, self.keep, self.fixed = Path(root), every, keep, dict(fixed)
        self.logs, self.group_shared = logs, group_shared
        if every == 0:
            log.warning("no periodic checkpoints (rl.checkpoint_every=0): only a stop that "
                        "asks for one (time limit, preemption grace, SIGUSR1) writes one; "
                        "set rl.checkpoint_every=N for one every N steps")
        self.mode: str | None = None      # a request pending: one of MODES
        self._poll_at = 0.0
        self._published: list[float] = []  # when the last steps were replicated
        self._save_s = 0.0                 # how long the last checkpoint took

    def due(self, step: int, last: int, now: float | None = None) -> bool:
        if now is not None:
            self._published = [*self._published[-7:], now]
        return self.mode is not None or (
            self.every > 0 and (step % self.every == 0 or step == last))

    def request(self, mode: str = "checkpoint") -> None:
        """Take one after the next replicated step; "requeue" and "stop" also end the job
        then."""
        self.mode = max(mode, self.mode or mode, key=MODES.index)
        log.warning("%s requested: after the next step", self.mode)

    def fits(self, now: float, grace_s: float) -> bool:
        """Whether the running step and its checkpoint end within `grace_s` (less a margin
        for the shutdown): the median of the last step intervals, less the time the running
        step has had, plus the last checkpoint's time. Unknown before two steps: no."""
        if len(self._published) < 2:
            return False
        gaps = sorted(b - a for a, b in zip(self._published, self._published[1:]))
        left = max(0.0, gaps[len(gaps) // 2] - (now - self._published[-1]))
        return left + self._save_s <= FIT_MARGIN * grace_s

    def poll(self, now: float) -> None:
        """Take a request file the batch step wrote (at most once a second): only a regular
        file of this user, opened without blocking or following links, naming one of MODES
        (anything else is removed and ignored with a warning: folders.take_own)."""
        if self.logs is None or now < self._poll_at:
            return
        self._poll_at = now + 1.0
        text = take_own(self.logs, REQUEST)
        if text is None:
            return
        mode = text.strip() or "checkpoint"
        if mode not in MODES:
            log.warning("ignored %s: %r is not one of %s", self.logs / REQUEST, mode[:40],
                        ", ".join(MODES))
            return
        self.request(mode)

    def save(self, ctl) -> None:
        """Start checkpoint `ctl.step` (the trained steps); training stays busy until done."""
        mode, self.mode = self.mode, None
        state = capture(ctl, self.fixed)
        tmp = writer.staging(self.root, state["step"], self.group_shared)
        ctl.training.active = True
        t0 = ctl.clock.now()
        ctl.devices.send(ctl.training.devices, SaveCheckpoint(str(tmp), state["version"]),
                         lambda replies: self._saved(ctl, tmp, state, t0, replies, mode))

    def _saved(self, ctl, tmp: Path, state: dict, t0: float, replies: list[Reply],
               mode: str | None) -> None:
        check_replies(replies)
        writer.write_state(tmp, state, self.group_shared)
        # the ranks hashed what they wrote: the manifest's entries of their files
        digests = {k: v for r in replies for k, v in r.result.get("files", {}).items()}
        final = writer.commit(tmp, self.keep, digests, self.group_shared)
        ctl.training.active = False
        ctl._event()
        seconds = self._save_s = ctl.clock.now() - t0
        size = sum(r.result.get("optim_bytes", 0) + r.result.get("policy_bytes", 0)
                   for r in replies)
        ctl.trace.append("events", t=ctl.clock.now(), kind="checkpoint",
                         message=f"step {state['step']} v{state['version']} -> {final} "
                                 f"({size / 2**20:.1f} MiB, {seconds:.2f} s, "
                                 f"{len(state['samples'])} samples in flight kept)")
        log.info("checkpoint of step %d written to %s (%.2f s)", state["step"], final, seconds)
        if mode in (STOP, REQUEUE):
            why = "after a stop signal" if mode == STOP else "for a requeue"
            ctl.stop_reason = f"checkpointed at step {state['step']} {why}"
            if self.logs is not None:   # under Slurm the batch step requeues the job
                write_text(self.logs, REQUEUE, json.dumps(
                    {"step": state["step"], "checkpoint": str(final), "why": mode}) + "\n",
                    self.group_shared, own=2)


def resume(ctl, folder: str | Path) -> dict[str, Any]:
    """Load checkpoint `folder`'s controller state into a fresh controller and queue its
    samples again: unfinished rollouts from their prompts, rolled ones for their judgement."""
    state = layout.read_state(Path(folder))
    again = restore(ctl, state)
    for s, role in again:
        if role == "rollout":
            ctl._submit_rollout(s)
        else:
            ctl._submit_judge(s)
    ctl.trace.append("events", t=ctl.clock.now(), kind="resume",
                     message=f"from {folder}: step {state['step']} v{state['version']}, "
                             f"{len(state['samples'])} samples kept, {len(again)} requeued")
    log.info("resumed from %s: step %d, policy v%d, %d samples requeued", folder,
             state["step"], state["version"], len(again))
    return state
