"""`pivotrl gps clean` and `gps ls`, run in-process on a private shared-memory folder."""
from __future__ import annotations

import os

import pytest

from pivotrl_hpc.cli import main as cli
from pivotrl_hpc.gps import segment


@pytest.fixture
def gps(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(segment, "SHM_DIR", tmp_path)
    monkeypatch.setattr(cli, "_quiet_engines", lambda verbose: None)  # leave os.environ be

    def run(*args) -> str:
        capsys.readouterr()
        assert cli.main(["gps", *args]) == 0
        return capsys.readouterr().out
    return run


def _make(shm, names):
    for n in names:
        (shm / n).write_bytes(b"x" * 10)


def test_clean_removes_one_jobs_segments(gps, tmp_path):
    _make(tmp_path, ["pivotrl-cleantest-n1-policy-v0", "pivotrl-cleantest-n2-ctl",
                     "pivotrl-cleantestother-n1-policy-v0", "other-file"])
    assert gps("clean", "--job", "cleantest", "--node", "n1") == "removed 1 segment(s)\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "other-file", "pivotrl-cleantest-n2-ctl", "pivotrl-cleantestother-n1-policy-v0"]
    assert gps("clean", "--job", "cleantest") == "removed 1 segment(s)\n"
    assert gps("clean", "--all") == "removed 1 segment(s)\n"
    assert [p.name for p in tmp_path.iterdir()] == ["other-file"]


def test_ls_lists_names_sizes_and_memory_held(gps, tmp_path):
    sparse = tmp_path / "pivotrl-lsjob-n1-policy-v3"
    with open(sparse, "wb") as f:
        f.truncate(1 << 20)  # 1 MiB, no page written: holds nothing
        f.write(b"y" * 4096)  # one page held
    _make(tmp_path, ["pivotrl-lsjob-n1-ctl", "pivotrl-otherjob-n1-ctl"])
    rows = [line.split("\t") for line in gps("ls", "--job", "lsjob").splitlines()]
    assert [(name, int(size)) for name, size, _ in rows] == [
        ("pivotrl-lsjob-n1-ctl", 10), ("pivotrl-lsjob-n1-policy-v3", 1 << 20)]
    held = int(rows[1][2])
    assert held == os.stat(sparse).st_blocks * 512 and 4096 <= held < 1 << 20
    assert len(gps("ls").splitlines()) == 3  # every job
