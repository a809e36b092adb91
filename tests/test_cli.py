"""The `pivotrl` CLI: every subcommand's help, exit codes, argument errors, `config` errors
naming the key, doctor's JSON shape, and a `bench shift --json` smoke run."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pivotrl_hpc.cli.bench import BENCHES
from pivotrl_hpc.cli import main as cli_main
from pivotrl_hpc.cli.main import COMMANDS, main

PAPER_CONFIG = "configs/qwen2.5-7b_qwen3-30b-a3b.yaml"

# landed command (and sub-command) -> what its --help must offer
HELP = {
    ("run",): ["config", "overrides", "--dry-run"],
    ("submit",): ["config", "overrides", "--nodes", "--gpus-per-node", "--partition", "--time",
                  "--account", "--constraint", "--runs-root", "--wait"],
    ("resume",): ["RUN_FOLDER", "overrides", "--partition", "--time", "--wait"],
    ("plan",): ["snapshot", "--json", "--policy", "--horizon", "--tau-shift", "--workers"],
    ("bench",): ["planner", "dispatch", "gps", "shift", "e2e", "sim", "codec"],
    ("bench", "planner"): ["--gpus", "--repeats", "--training", "--workers", "--json"],
    ("bench", "dispatch"): ["--replicas", "--sequences", "--repeats", "--json"],
    ("bench", "gps"): ["--size-mb", "--readers", "--transport", "--no-replicate", "--json"],
    ("bench", "shift"): ["--sizes", "--repeat", "--models-dir", "--json"],
    ("bench", "e2e"): ["--config", "--steps", "--paradigms", "--batch-size", "--no-search",
                      "overrides"],
    ("bench", "sim"): ["--gpus", "--steps", "--config", "--paradigm", "--json"],
    ("bench", "codec"): ["--seqs", "--finished", "--response", "--prompt", "--iterations"],
    ("bench", "migration"): ["--model", "--running", "--migrate", "--replicas", "--rounds"],
    ("bench", "soak"): ["--config", "--steps", "--early", "--tolerance", "--out", "--contention",
                       "--runs", "--paradigms", "--models", "--timeout", "overrides"],
    ("bench", "gpu"): ["--device", "--sizes-mb", "--train", "--repeats", "--no-nixl", "--json"],
    ("export",): ["RUN_OR_CHECKPOINT", "--out", "--force", "--json"],
    ("simulate",): ["config", "--paradigms", "--from-trace", "--train-seconds", "--out",
                    "--no-search"],
    ("reproduce",): ["--out", "--only", "--quick", "--steps", "--seeds", "--jobs"],
    ("report",): ["trace", "--out"],
    ("trace",): ["check", "samples"],
    ("trace", "check"): ["TRACE"],
    ("trace", "samples"): ["RUN", "--step", "--unparsed"],
    ("profile",): ["throughput", "links"],
    ("profile", "throughput"): ["--model", "--out", "--role", "--seqs", "--prompt-lens"],
    ("profile", "links"): ["--out", "--size-mb", "--repeats", "--transport", "--no-remote"],
    ("gps",): ["serve", "clean", "ls"],
    ("doctor",): ["--json", "--shm-min-gb"],
    ("init-models",): ["dir", "--seed", "--train", "--validation", "--with-100m",
                       "--genrm-arch"],
    ("config",): ["config", "overrides", "--json", "--no-check-files"],
}


def pivotrl(*args, check=False):
    return subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", *args],
                          capture_output=True, text=True, check=check)


def test_help_table_covers_every_landed_command():
    landed = {c.name for c in COMMANDS if c.pending is None}
    assert {k[0] for k in HELP} == landed
    assert {k[1] for k in HELP if k[0] == "bench" and len(k) == 2} == {
        kind for kind, (_, _, pending) in BENCHES.items() if pending is None}


@pytest.mark.parametrize("words", sorted(HELP), ids=" ".join)
def test_subcommand_help(words, capsys):
    with pytest.raises(SystemExit) as info:
        main([*words, "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    assert out.startswith(f"usage: pivotrl {' '.join(words)} ")
    described = {("bench", k): v[1] for k, v in BENCHES.items()}
    described.update({(c.name,): c.help for c in COMMANDS})
    if words in described:
        assert described[words] in out
    for option in HELP[words]:
        assert option in out, option


def test_pending_subcommands_exit_2_with_one_line():
    pending = [(c.name, "whatever") for c in COMMANDS if c.pending]
    pending += [("bench", k) for k, v in BENCHES.items() if v[2]]
    for args in pending:
        p = pivotrl(*args)
        assert p.returncode == 2 and "not available yet" in p.stderr, args
        assert len(p.stderr.strip().splitlines()) == 1, (args, p.stderr)


def test_pending_mechanism(monkeypatch, capsys):
    """A command whose issue has not landed says so and exits 2, whatever its arguments."""
    for var in ("VLLM_LOGGING_STREAM", "VLLM_LOGGING_LEVEL"):  # main sets these defaults
        monkeypatch.delenv(var, raising=False)
    fake = cli_main.Command("later", "pivotrl_hpc.cli.nowhere", "not yet", pending="issue 99")
    monkeypatch.setattr(cli_main, "COMMANDS", cli_main.COMMANDS + (fake,))
    assert main(["later", "thing", "--any"]) == 2
    assert capsys.readouterr().err == ("pivotrl later: not available yet (arrives with "
                                       "issue 99)\n")


def test_no_command_prints_help():
    p = pivotrl()
    assert p.returncode == 2 and p.stdout.startswith("usage: pivotrl")
    assert all(c.name in p.stdout for c in COMMANDS)


@pytest.mark.parametrize("args, message", [
    (["nope"], "argument COMMAND: invalid choice: 'nope'"),
    (["bench", "nope"], "argument KIND: invalid choice: 'nope'"),
    (["plan"], "the following arguments are required: snapshot"),
    (["doctor", "--bogus"], "unrecognized arguments: --bogus"),
    (["doctor", "stray"], "unrecognized arguments: stray"),
    (["config", PAPER_CONFIG, "--bogus"], "unrecognized arguments: --bogus"),
    (["bench", "dispatch", "--replicas", "many"], "argument --replicas: invalid int value"),
    (["profile", "throughput", "--model", "m", "--out", "o.yaml", "--seqs", "0"],
     "expected positive integers, got '0'"),
    (["plan", "x.json", "--policy", "best"], "argument --policy: invalid choice: 'best'"),
])
def test_bad_arguments_exit_2_naming_the_argument(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("usage: pivotrl")


def test_bad_values_checked_by_commands_exit_2():
    p = pivotrl("bench", "shift", "--sizes", "tiny,huge")
    assert p.returncode == 2 and "got ['huge']" in p.stderr and not p.stdout
    p = pivotrl("bench", "shift", "--sizes", "tiny", "--repeat", "0")
    assert p.returncode == 2 and "--repeat >= 1" in p.stderr and not p.stdout
    p = pivotrl("plan", "no/such/snapshot.json")
    assert p.returncode == 2 and p.stderr.startswith("pivotrl plan: no/such/snapshot.json: ")


@pytest.mark.parametrize("override, message", [
    ("rl.stpes=1", "config key 'rl.stpes': "),
    ("rl.steps=abc", "config key 'rl.steps': 'abc' is a str, expected int"),
    ("rl.steps=0", "config key 'rl.steps': 0 must be > 0"),
    ("rl.steps", "config key 'rl.steps': an override must look like section.key=value"),
])
def test_config_errors_name_the_key(override, message):
    p = pivotrl("config", PAPER_CONFIG, "--no-check-files", override)
    assert p.returncode == 2 and not p.stdout
    assert p.stderr.strip() == p.stderr.strip().splitlines()[0]   # one line, no traceback
    assert p.stderr.startswith("pivotrl config: " + message)


def test_config_command_reports_key_and_resolves():
    p = pivotrl("config", PAPER_CONFIG, "--no-check-files", "rl.stpes=1")
    assert p.returncode == 2 and "'rl.stpes'" in p.stderr and "steps" in p.stderr
    p = pivotrl("config", "no/such.yaml")
    assert p.returncode == 2 and "config file no/such.yaml does not exist" in p.stderr
    # overrides may follow the options
    p = pivotrl("config", PAPER_CONFIG, "--no-check-files", "--json", "rl.steps=7")
    data = json.loads(p.stdout)
    assert p.returncode == 0 and data["rl"]["steps"] == 7
    assert data["models"]["genrm"]["expert_parallel"] == 4
    # file checks on by default: the paper's model folders are not on this machine
    p = pivotrl("config", PAPER_CONFIG)
    assert p.returncode == 2 and "config key 'models.policy.path'" in p.stderr


def test_doctor_json_shape():
    p = pivotrl("doctor", "--json")
    report = json.loads(p.stdout)
    expected = {"torch", "vllm", "megatron-core", "nixl", "mpi4py", "mpirun", "slurm",
                "submitit", "h5py", "shm"}
    assert expected <= set(report)
    for name, r in report.items():
        assert set(r) == {"ok", "version", "detail"} and isinstance(r["ok"], bool), name
    assert report["shm"]["ok"] and "GiB free" in report["shm"]["detail"]
    # every Python component is installed by `make setup`
    for name in ("torch", "vllm", "megatron-core", "nixl", "mpi4py", "submitit", "h5py"):
        assert report[name]["ok"], (name, report[name]["detail"])
    assert p.returncode == (0 if all(r["ok"] for r in report.values()) else 1)


def _subtotals_consistent(phases: dict[str, float]) -> None:
    """Phases are disjoint intervals inside `total`, and the `X.*` parts inside `X.total`:
    each sum is at most its total (the rest is time no phase names, e.g. the trainer's log
    line after a reload: 1.1 ms on a loaded machine). Values are rounded to 0.1 ms: each
    may be off by 0.05 ms."""
    def at_most(parts: list[float], total: float) -> bool:
        return sum(parts) <= total + 5e-5 * (len(parts) + 1)

    groups = {k[:-len(".total")] for k in phases if k.endswith(".total")}
    for g in groups:
        parts = [v for k, v in phases.items() if k.startswith(g + ".") and k != g + ".total"]
        assert parts and at_most(parts, phases[g + ".total"]), (g, phases)
    top = [v for k, v in phases.items()
           if k != "total" and not any(k.startswith(g + ".") and k != g + ".total"
                                       for g in groups)]
    assert at_most(top, phases["total"]), phases


@pytest.mark.slow
def test_bench_shift_json_smoke(tiny_models):
    """One cold and one warm cycle of rollout -> reward -> training on the tiny models."""
    p = pivotrl("bench", "shift", "--json", "--sizes", "tiny", "--repeat", "1",
                "--models-dir", str(tiny_models))
    assert p.returncode == 0, p.stderr[-2000:]
    result = json.loads(p.stdout)
    assert (result["repeat"], result["device"], list(result["sizes"])) == (1, "cpu", ["tiny"])
    roles = result["sizes"]["tiny"]
    assert list(roles) == ["rollout", "reward", "training"]
    for role, r in roles.items():
        assert set(r) == {"shift_up_s", "shift_down_s", "first_shift_up_s", "up_phases",
                          "down_phases"}, role
        assert r["shift_up_s"] == r["up_phases"]["total"], role
        assert r["shift_down_s"] == r["down_phases"]["total"], role
        # every shift up reads the parameters from GPS and loads them
        assert {"parameters.read", "parameters.load"} <= set(r["up_phases"]), role
        _subtotals_consistent(r["up_phases"])
        _subtotals_consistent(r["down_phases"])
    for role in ("rollout", "reward"):   # engine hosts: sleep level 2 (CPU: cpu_sleep), wake
        assert set(roles[role]["up_phases"]) == {"parameters.read", "parameters.load",
                                                 "preserved.engine_wake",
                                                 "temporary.kv_alloc", "total"}
        assert set(roles[role]["down_phases"]) == {"temporary.abort", "preserved.engine_sleep",
                                                   "total"}
    train = roles["training"]
    assert {k.split(".")[1] for k in train["up_phases"] if k.count(".") == 2} == {"reload"}
    assert {k.split(".")[1] for k in train["down_phases"] if k.count(".") == 2} == {"offload"}


def test_bench_e2e_searches_each_paradigms_allocation_and_computes_speedups(tiny_models):
    """The search candidates (the training width, in whole TP groups whose DP splits the
    batch, for every paradigm but colocated; disaggregated also its
    rollout/reward split of the rest), --no-search's pick, and the speed-ups on the steady
    figure. The runs themselves are `pivotrl run` (test_learning)."""
    import argparse

    from pivotrl_hpc.cli import bench_e2e
    from pivotrl_hpc.reproduce import search

    overrides = [f"models.policy.path={tiny_models / 'policy'}",
                 f"models.genrm.path={tiny_models / 'genrm'}",
                 f"data.train={tiny_models / 'data' / 'train.parquet'}",
                 f"data.validation={tiny_models / 'data' / 'aime-style.parquet'}"]
    args = argparse.Namespace(config="configs/tiny-cpu.yaml", overrides=overrides,
                              no_search=False, steps=3, repeats=1)
    # widths 2 and 4 (8 leaves no room for a GenRM replica); reward replicas of 2 devices
    dis = bench_e2e.candidates(args, "disaggregated")
    assert [[x.rsplit("=", 1)[1] for x in c] for c in dis] == [
        ["2", "4", "2"], ["2", "2", "4"], ["4", "2", "2"]]
    rr = bench_e2e.candidates(args, "rr_colocated")
    assert rr == [["roles.train_devices=2"], ["roles.train_devices=4"]]
    assert bench_e2e.candidates(args, "shiftable") == rr
    assert bench_e2e.candidates(args, "rr_colocated_pooled") == rr
    assert bench_e2e.candidates(args, "colocated") == []
    # 16 devices, 6 samples a step: 8 training devices (DP 4) do not split the batch
    args.overrides = [*overrides, "cluster.nodes=4", "cluster.cpu_share=0.05",
                      "rl.batch_size=3", "rl.group_size=2"]
    assert bench_e2e.candidates(args, "rr_colocated") == rr
    # half of 6 is no whole TP group, and 12 leaves no room for a GenRM replica
    args.overrides = [*overrides, "roles.train_devices=6", "rl.batch_size=6"]
    assert bench_e2e.candidates(args, "shiftable") == [["roles.train_devices=6"]]
    args.overrides, args.no_search = overrides, True
    assert bench_e2e.best_split(args, "disaggregated") == (dis[2], None)   # config's width
    assert bench_e2e.best_split(args, "shiftable") == ([], None)
    assert search.spread(list(range(10)), 4) == [0, 3, 6, 9]
    assert search.spread([1, 2], 4) == [1, 2]
    result = {"colocated": {"steady_tokens_per_s": 10.0, "tokens_per_s": 5.0},
              "disaggregated": {"steady_tokens_per_s": 20.0, "tokens_per_s": 8.0},
              "shiftable": {"steady_tokens_per_s": 30.0, "tokens_per_s": 8.0}}
    assert bench_e2e.speedups(result, "steady_tokens_per_s") == {"colocated": 3.0,
                                                                 "disaggregated": 1.5}
    assert bench_e2e.speedups(result, "tokens_per_s") == {"colocated": 1.6,
                                                          "disaggregated": 1.0}
    w = bench_e2e.workload(args)
    assert w["cluster"]["cpu_share"] == 0.2 and w["rl"]["batch_size"] == 4


def test_bench_soak_compares_late_to_early_and_flags_growth():
    from pivotrl_hpc.cli.bench_soak import compare

    early = {"procs": {"rank-0": {"rss_kb": 1000, "fds": 10}}, "shm_bytes": 100}
    same = compare(early, {"procs": {"rank-0": {"rss_kb": 1040, "fds": 10}},
                           "shm_bytes": 100}, 0.05)
    assert same["within"] and same["worst_ratio"] == 1.04 and same["shm_ratio"] == 1.0
    grew = compare(early, {"procs": {"rank-0": {"rss_kb": 1000, "fds": 12}},
                           "shm_bytes": 100}, 0.05)
    assert not grew["within"] and grew["ratios"]["rank-0"]["fds"] == 1.2
    leak = compare(early, {"procs": {"rank-0": {"rss_kb": 1000, "fds": 10}},
                           "shm_bytes": 200}, 0.05)
    assert not leak["within"] and leak["shm_ratio"] == 2.0
