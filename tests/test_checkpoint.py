"""Checkpoints without engines: the folder layout (whole or absent, kept, found), the
controller's state round trip, and a resume on modeled workers whose data order equals an
uninterrupted run's. (The live kill-and-resume is tests/test_resume_live.py.)"""
from __future__ import annotations

import json
import os
import stat

import pytest
from controller_util import make_controller, split_bootstrap

from pivotrl_hpc.checkpoint import layout, writer
from pivotrl_hpc.checkpoint.layout import CheckpointError
from pivotrl_hpc.checkpoint.state import check_fixed
from pivotrl_hpc.controller.run_state import capture, restore
from pivotrl_hpc.config.errors import ConfigError
from pivotrl_hpc.config.load import load_config
from pivotrl_hpc.controller.checkpointing import Checkpointer, resume

FIXED = {"rl.batch_size": 4, "rl.steps": 6}


def _fake(root, step, whole=True, fixed=None):
    tmp = writer.staging(root, step)
    (tmp / layout.POLICY).mkdir()
    writer.write_state(tmp, {"step": step, "version": step, "fixed": fixed or {}})
    return writer.commit(tmp, keep=100) if whole else tmp


def test_commit_is_whole_or_absent_and_keeps_the_newest(tmp_path):
    root = tmp_path / "x.checkpoints"
    for step in (2, 4, 6):
        _fake(root, step)
    half = _fake(root, 8, whole=False)          # a job killed while writing step 8
    assert [p.name for p in layout.whole(root)] == ["step-000002", "step-000004",
                                                    "step-000006"]
    assert layout.latest(root).name == "step-000006" and half.exists()
    tmp = writer.staging(root, 10)
    (tmp / layout.POLICY).mkdir()
    writer.write_state(tmp, {"step": 10, "version": 10})
    assert not layout.is_whole(tmp)             # no COMPLETE yet: not found
    writer.commit(tmp, keep=2)
    assert [p.name for p in layout.whole(root)] == ["step-000006", "step-000010"]
    assert not half.exists() and not tmp.exists()   # stale .tmp folders go on commit
    assert (root / "step-000010" / layout.MARK).is_file()


def test_find_takes_a_checkpoint_its_folder_a_trace_or_a_run(tmp_path):
    run = tmp_path / "runs" / "pivotrl-17"
    root = layout.root_for(run / "job.h5")
    for step in (2, 4):
        _fake(root, step)
    newest = (root / "step-000004").resolve()
    for where in (root / "step-000004", root, run / "job.h5", run / "job.seg2.h5", run):
        assert layout.find(where) == newest, where
    assert layout.find(root / "step-000002") == (root / "step-000002").resolve()
    half = _fake(root, 6, whole=False)
    with pytest.raises(CheckpointError, match="not a whole checkpoint"):
        layout.find(half)
    with pytest.raises(CheckpointError, match="no whole checkpoint at"):
        layout.find(tmp_path / "nothing")
    assert layout.resolve(False, run / "job.h5") is None
    assert layout.resolve("auto", run / "job.h5") == root / "step-000004"
    assert layout.resolve("auto", tmp_path / "fresh.h5") is None


def test_trace_segments_are_numbered_after_the_first(tmp_path):
    trace = tmp_path / "job.h5"
    assert layout.segment_trace(trace) == trace
    trace.write_bytes(b"")
    assert layout.segment_trace(trace) == tmp_path / "job.seg1.h5"
    (tmp_path / "job.seg1.h5").write_bytes(b"")
    assert layout.segment_trace(tmp_path / "job.seg1.h5") == tmp_path / "job.seg2.h5"
    assert layout.segments(tmp_path / "job.seg1.h5") == [trace, tmp_path / "job.seg1.h5"]
    assert layout.root_for(tmp_path / "job.seg1.h5") == tmp_path / "job.checkpoints"


def test_state_file_must_be_ours(tmp_path):
    (tmp_path / layout.STATE).write_text("{}")
    with pytest.raises(CheckpointError, match="not a pivotrl-checkpoint/1"):
        layout.read_state(tmp_path)
    (tmp_path / layout.STATE).write_text("{")
    with pytest.raises(CheckpointError, match="unreadable"):
        layout.read_state(tmp_path)


def test_config_resume_values_and_errors(tmp_path):
    cfg = "configs/tiny-cpu.yaml"
    root = os.path.dirname(os.path.dirname(__file__))
    path = os.path.join(root, cfg)
    assert load_config(path, ["resume=false"], check_files=False).resume is False
    assert load_config(path, [], check_files=False).resume == "auto"
    with pytest.raises(ConfigError, match="'resume': 3 is a int, expected bool or str"):
        load_config(path, ["resume=3"], check_files=False)
    with pytest.raises(ConfigError, match="'rl.checkpoint_every': -1 must be >= 0"):
        load_config(path, ["rl.checkpoint_every=-1"], check_files=False)
    with pytest.raises(ConfigError, match="'rl.keep_checkpoints': 0 must be >= 1"):
        load_config(path, ["rl.keep_checkpoints=0"], check_files=False)
    with pytest.raises(ConfigError, match="'rl.preempt_grace_s': -5.0 must be >= 0"):
        load_config(path, ["rl.preempt_grace_s=-5"], check_files=False)
    with pytest.raises(ConfigError, match="'rl.preempt_grace_s': 'nan' is a str"):
        load_config(path, ["rl.preempt_grace_s=nan"], check_files=False)
    c = _fake(tmp_path / "r.checkpoints", 3)
    from pivotrl_hpc.launch.preflight import check_start
    cfg_obj = load_config(path, [f"resume={c}"], check_files=False)
    check_start(cfg_obj)                # a whole one passes
    cfg_obj.resume = str(tmp_path / "r.checkpoints" / "step-000009")
    with pytest.raises(ConfigError, match="'resume': no whole checkpoint"):
        check_start(cfg_obj)
    # resume=auto in a run whose checkpoint had another batch: refused before any rank starts
    _fake(tmp_path / "r.checkpoints", 4, fixed={"rl.batch_size": 99})
    cfg_obj.resume, cfg_obj.trace.path = "auto", str(tmp_path / "r.h5")
    with pytest.raises(ConfigError, match=r"'resume': .*step-000004 was made with "
                                          r"rl.batch_size=99, the config says 4"):
        check_start(cfg_obj)
    cfg_obj.resume = False
    check_start(cfg_obj)


def test_changed_batch_shape_is_refused_by_name():
    state = {"step": 4, "fixed": {"rl.batch_size": 4, "rl.steps": 8}}
    check_fixed(state, {"rl.batch_size": 4, "rl.steps": 12}, "ckpt")   # more steps: fine
    with pytest.raises(CheckpointError, match=r"made with rl.batch_size=4, the config says 8"):
        check_fixed(state, {"rl.batch_size": 8, "rl.steps": 8}, "ckpt")
    with pytest.raises(CheckpointError, match="holds 4 trained steps, more than rl.steps=3"):
        check_fixed(state, {"rl.batch_size": 4, "rl.steps": 3}, "ckpt")


def _batches(ctl) -> dict[int, list[tuple]]:
    """Per step: (sid, prompt, budget, seed, judge budget) of its samples: the data order."""
    out: dict[int, list[tuple]] = {}
    for s in sorted(ctl.book.samples.values(), key=lambda s: s.sid):
        if s.batch >= 0:
            out.setdefault(s.batch, []).append((s.sid, s.prompt.pid, s.budget,
                                                s.sampling.seed, s.judge_budget))
    return out


def _run(tmp_path, name, steps=6, resume_from=None, version=0):
    ctl, workers = make_controller("disaggregated", gpus=8, train=(0, 1, 2, 3), steps=steps,
                                   staleness=1, params={"rollout_gpus": 2, "reward_gpus": 2},
                                   bootstrap=split_bootstrap())
    workers[0].store.version = version        # GPS would be loaded at the checkpoint's
    ctl.checkpoints = Checkpointer(tmp_path / f"{name}.checkpoints", 2, 10, FIXED)
    state = resume(ctl, resume_from) if resume_from else None
    summary = ctl.run()
    return ctl, summary, state


def test_resume_on_modeled_workers_trains_the_same_data_in_the_same_order(tmp_path):
    full, _, _ = _run(tmp_path, "full")
    root = tmp_path / "full.checkpoints"
    assert [p.name for p in layout.whole(root)] == [f"step-{s:06d}" for s in (2, 4, 6)]
    ckpt = root / "step-000004"
    state = json.loads((ckpt / layout.STATE).read_text())
    assert state["step"] == 4 and state["version"] == 4
    assert (ckpt / "policy" / "version").read_text() == "4\n"
    assert sorted(p.name for p in (ckpt / "optim").iterdir()) == [
        f"rank-{r:03d}.safetensors" for r in range(4)]
    # samples of steps 4 and 5 (k = 1) that were not trained yet travel in the checkpoint
    assert state["samples"] and {s["batch"] for s in state["samples"]} <= {4, 5}
    resumed, summary, got = _run(tmp_path, "resumed", resume_from=ckpt, version=4)
    assert got["step"] == 4 and summary["steps"] == 6
    a, b = _batches(full), _batches(resumed)
    assert {k: v for k, v in a.items() if k >= 4} == {k: v for k, v in b.items() if k >= 4}
    assert all(s.state == "trained" for s in resumed.book.samples.values() if s.batch >= 0)
    # every resumed sample was generated by a policy within the staleness bound
    assert max(s.batch - s.version for s in resumed.book.samples.values()
               if s.batch >= 4) <= 1
    assert resumed.published == 6


def test_a_stop_request_checkpoints_the_next_step_and_ends_the_job(tmp_path):
    ctl, workers = make_controller("disaggregated", gpus=8, train=(0, 1, 2, 3), steps=6,
                                   staleness=1, params={"rollout_gpus": 2, "reward_gpus": 2},
                                   bootstrap=split_bootstrap())
    ctl.checkpoints = Checkpointer(tmp_path / "c.checkpoints", 0, 10, FIXED)   # none periodic
    ctl.checkpoints.request("stop")
    ctl.checkpoints.request("checkpoint")          # a later, weaker request keeps the stop
    summary = ctl.run()
    assert summary["stopped"] == "checkpointed at step 1 after a stop signal"
    assert summary["steps"] == 1 and ctl.step == 1, (summary["steps"], ctl.step, ctl.published)
    assert [p.name for p in layout.whole(tmp_path / "c.checkpoints")] == ["step-000001"]


def test_fits_needs_two_steps_and_a_step_plus_checkpoint_inside_the_grace():
    ck = Checkpointer("unused", 0, 2, FIXED)
    assert not ck.fits(0.0, 1e9)                   # no step interval known yet
    ck.due(1, 9, 100.0)
    ck.due(2, 9, 110.0)
    ck.due(3, 9, 130.0)                            # intervals 10 and 20: median 20
    ck._save_s = 2.0
    assert ck.fits(135.0, 22.0)                    # 15 s left + 2 s <= 0.8 x 22
    assert not ck.fits(135.0, 21.0)                # 17 s > 0.8 x 21
    assert ck.fits(200.0, 3.0)                     # overdue step: only the checkpoint
    ck.request("stop")
    ck.request("requeue")
    assert ck.mode == "requeue"


def test_sigterm_with_grace_defers_to_a_checkpoint_only_when_it_fits(tmp_path, monkeypatch):
    """Real SIGTERMs to this process: the Stopper's handler (here a recorder) gets the
    signal when no checkpoint fits, and a later signal after a deferred one; the same stop
    delivered twice at once (Slurm's and srun's) counts once."""
    import signal

    from pivotrl_hpc.controller import live
    from pivotrl_hpc.controller.live import _on_stop_signal

    ctl, _ = make_controller(steps=3, staleness=1)
    ctl.checkpoints = Checkpointer(tmp_path / "c", 0, 2, FIXED)
    seen: list[int] = []
    old = signal.signal(signal.SIGTERM, lambda signum, _frame: seen.append(signum))
    try:
        _on_stop_signal(ctl, 30.0)
        os.kill(os.getpid(), signal.SIGTERM)       # no step timings: stop at once
        assert seen == [signal.SIGTERM] and ctl.checkpoints.mode is None
        now = ctl.clock.now()
        ctl.checkpoints.due(1, 3, now - 20.0)
        ctl.checkpoints.due(2, 3, now - 10.0)
        os.kill(os.getpid(), signal.SIGTERM)       # the running step ends in time: deferred
        assert seen == [signal.SIGTERM] and ctl.checkpoints.mode == "stop"
        os.kill(os.getpid(), signal.SIGTERM)       # the same stop again at once: ignored
        assert seen == [signal.SIGTERM] and ctl.checkpoints.mode == "stop"
        monkeypatch.setattr(live, "SAME_SIGNAL_S", 0.0)
        os.kill(os.getpid(), signal.SIGTERM)       # a later one stops at once
        assert seen == [signal.SIGTERM] * 2
    finally:
        signal.signal(signal.SIGTERM, old)


def test_capture_keeps_finished_samples_and_restarts_the_rest(tmp_path):
    ctl, _ = make_controller(steps=3, staleness=2)
    book = ctl.book
    samples = book.admit(0, 0.0)
    s0, s1 = samples[0], samples[1]
    book.rolled(s0.sid, [5, 6], [-0.1, -0.2], 0, ctl.task)
    book.rolled(s1.sid, [7], [-0.3], 0, ctl.task)
    book.rewarded(s1.sid, [3], ctl.task)
    state = json.loads(json.dumps(capture(ctl, FIXED)))   # what goes through state.json
    fresh, _ = make_controller(steps=3, staleness=2)
    again = restore(fresh, state)
    roles = {s.sid: role for s, role in again}
    assert roles[s0.sid] == "reward" and s1.sid not in roles
    assert all(roles[s.sid] == "rollout" for s in samples[2:])
    got = fresh.book.samples
    assert got[s1.sid].score == book.samples[s1.sid].score
    assert got[s0.sid].response == [5, 6] and got[s0.sid].judge_prompt == s0.judge_prompt
    assert fresh.book.rng.random() == book.rng.random()      # the book's RNG goes on alike
    assert fresh.book.next_prompt == book.next_prompt and fresh.book.next_sid == book.next_sid


def _policy_checkpoint(root, models, tensors=None):
    """A whole checkpoint whose policy is the tiny policy (or `tensors` in its place)."""
    import shutil

    from safetensors.torch import load_file, save_file

    tmp = writer.staging(root, 2)
    shutil.copytree(models / "policy", tmp / layout.POLICY)
    if tensors is not None:
        weights = load_file(str(tmp / layout.POLICY / "model.safetensors"))
        tensors(weights)
        save_file(weights, str(tmp / layout.POLICY / "model.safetensors"))
    writer.write_state(tmp, {"step": 2, "version": 2})
    return writer.commit(tmp, keep=2)


def test_export_copies_a_checked_policy_and_refuses_broken_ones(tiny_models, tmp_path):
    import subprocess
    import sys

    from pivotrl_hpc.checkpoint.export import export

    ckpt = _policy_checkpoint(tmp_path / "a.checkpoints", tiny_models)
    info = export(tmp_path / "a.h5", tmp_path / "out")
    assert info["step"] == 2 and info["tensors"] > 0 and info["checkpoint"] == str(ckpt)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (
        ckpt / "policy" / "model.safetensors").read_bytes()
    assert json.loads((tmp_path / "out" / "pivotrl_export.json").read_text())["version"] == 2
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        export(ckpt, tmp_path / "out")
    name = "model.norm.weight"
    for breaks, message in (
            (lambda w: w[name].fill_(float("nan")), f"{name} holds non-finite values"),
            (lambda w: w.update({name: w[name][:-1].clone()}), f"{name} is"),
            (lambda w: w.pop(name), "tensors missing")):
        bad = _policy_checkpoint(tmp_path / f"b{len(message)}.checkpoints", tiny_models, breaks)
        with pytest.raises(CheckpointError, match=message):
            export(bad, tmp_path / "never")
        assert not (tmp_path / "never").exists()
    p = subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", "export",
                        str(tmp_path / "none.h5"), "--out", str(tmp_path / "x")],
                       capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.startswith("pivotrl export: no whole checkpoint")


def _weights_store(models):
    """GPS's Read as `save_policy` calls it, answered from the tiny policy's own file."""
    from types import SimpleNamespace

    from safetensors.torch import load_file

    weights = load_file(str(models / "policy" / "model.safetensors"))
    return SimpleNamespace(read=lambda model, place, version: weights)


def _modes(folder):
    return {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode) & 0o777
            for p in [folder, *folder.rglob("*")]}


@pytest.mark.parametrize("group_shared", [False, True])
def test_checkpoint_files_are_the_users_alone_whatever_the_umask(tiny_models, tmp_path,
                                                                 group_shared):
    """Under umask 002 (a shared project folder's) the checkpoint comes out 0700 / 0600
    (0750 / 0640 with trace.group_shared), never group-writable; an export is 0755 / 0644."""
    from pivotrl_hpc.checkpoint.export import export
    from pivotrl_hpc.runtime.checkpoint import save_policy

    old = os.umask(0o002)
    try:
        root = tmp_path / "run" / "x.checkpoints"
        tmp = writer.staging(root, 2, group_shared)
        nbytes, files = save_policy(_weights_store(tiny_models), 2, tmp, tiny_models / "policy",
                                    group_shared)
        writer.write_state(tmp, {"step": 2, "version": 2}, group_shared)
        ckpt = writer.commit(tmp, 2, files, group_shared)
        out = tmp_path / "export"
        export(ckpt, out)
    finally:
        os.umask(old)
    folder, file = (0o750, 0o640) if group_shared else (0o700, 0o600)
    modes = _modes(ckpt)
    assert nbytes > 0 and "policy/model.safetensors" in files and len(modes) == 11, modes
    assert {m for p, m in modes.items() if (ckpt / p).is_dir()} == {folder}
    assert {m for p, m in modes.items() if (ckpt / p).is_file()} == {file}
    assert stat.S_IMODE(root.stat().st_mode) & 0o777 == folder
    assert set(_modes(out).values()) == {0o755, 0o644}


def _zero(path, tensor):
    """Zero one tensor's bytes in place, as a group member with write access did."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    a, b = json.loads(raw[8:8 + n])[tensor]["data_offsets"]
    path.write_bytes(raw[:8 + n + a] + bytes(b - a) + raw[8 + n + b:])


def test_the_manifest_names_what_changed_and_refuses_what_others_could_write(tiny_models,
                                                                             tmp_path, caplog):
    from pivotrl_hpc.checkpoint.manifest import ManifestError, verify

    def fresh(name):
        return _policy_checkpoint(tmp_path / f"{name}.checkpoints", tiny_models)

    ckpt = fresh("ok")
    assert verify(ckpt) == sum(p.stat().st_size for p in ckpt.rglob("*")
                               if p.is_file() and p.name != layout.MARK)
    manifest = json.loads((ckpt / layout.MARK).read_text())
    assert len(manifest["files"]["policy/model.safetensors"]["tensors"]) == 27
    ckpt = fresh("tensor")
    _zero(ckpt / "policy" / "model.safetensors", "model.norm.weight")
    with pytest.raises(ManifestError, match=r"policy/model.safetensors changed since the "
                                            r"checkpoint was written: tensor model.norm.weight "
                                            r"differs; resume from another"):
        verify(ckpt)
    edits = {
        "state": (lambda c: (c / layout.STATE).write_text((c / layout.STATE).read_text()
                                                           .replace('"step": 2', '"step": 3')),
                  r"state.json changed since .*: its bytes differ"),
        "added": (lambda c: (c / "optim" / "rank-001.safetensors").write_bytes(b"x"),
                  r"optim/rank-001.safetensors is not in the manifest"),
        "gone": (lambda c: (c / "policy" / "config.json").unlink(),
                 r"policy/config.json is missing"),
        "header": (lambda c: (c / "policy" / "model.safetensors").write_bytes(b"\0" * 99),
                   r"model.safetensors changed .*: 99 bytes, the manifest says"),
        "link": (lambda c: [(c / layout.STATE).unlink(),
                            (c / layout.STATE).symlink_to(tmp_path / "elsewhere")],
                 r"state.json: a symlink"),
        "fifo": (lambda c: [(c / layout.STATE).unlink(), os.mkfifo(c / layout.STATE)],
                 r"state.json: not a regular file"),
        "mark": (lambda c: (c / layout.MARK).write_text('{"files": {"state.json": 1}}'),
                 r"COMPLETE: not a pivotrl-manifest/1 manifest"),
        "mode": (lambda c: os.chmod(c / "policy", 0o770),
                 r"policy: a folder with mode 770, writable by its group: .* chmod -R go-w"),
    }
    for name, (edit, message) in edits.items():
        ckpt = fresh(name)
        edit(ckpt)
        with pytest.raises(ManifestError, match=message):
            verify(ckpt)
    # a checkpoint of an older pivotrl (an empty COMPLETE): taken with a warning when no
    # other account can write any of it, refused (naming the file and the fix) when one can
    old = fresh("old")
    (old / layout.MARK).write_text("")
    assert verify(old) == 0 and "has no manifest" in caplog.text
    os.chmod(old / "policy" / "model.safetensors", 0o664)
    with pytest.raises(ManifestError, match=r"model.safetensors: a file with mode 664, "
                                            r"writable by its group"):
        verify(old)


def test_a_rank_writes_a_checkpoint_only_into_a_staging_folder_of_its_run(tmp_path):
    root = tmp_path / "x.checkpoints"
    assert layout.staging_in(root, writer.staging(root, 4)) == root / ".step-000004.tmp"
    for folder in ("/root/.ssh", root / "step-000004", root / ".." / ".step-000004.tmp",
                   root / ".step-000004.tmp" / ".." / ".." / "y", tmp_path / ".step-1.tmp"):
        with pytest.raises(CheckpointError, match="refused: not a staging folder"):
            layout.staging_in(root, folder)
    with pytest.raises(CheckpointError, match=r"\(none given at start\)"):
        layout.staging_in("", root / ".step-000004.tmp")
