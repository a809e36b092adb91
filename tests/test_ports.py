"""Job ports lie outside the kernel's ephemeral range, where outgoing connections (gloo, vLLM,
MPI) cannot take them between the launcher's check and the world's bind (an EADDRINUSE seen in
CI when ports were picked from port 0 or from 20000-60000)."""
from __future__ import annotations

import socket

import pytest

from pivotrl_hpc.engines import ports
from pivotrl_hpc.launch.layout import PORTS_PER_JOB, job_ports, port_base
from pivotrl_hpc.launch.local import free_port_base


def _outside_ephemeral(first: int, count: int) -> bool:
    low, high = ports.ephemeral_range()
    return first + count <= low or first > high


def test_free_ranges_and_ports_avoid_the_ephemeral_range():
    for _ in range(30):
        base = free_port_base(job_ports(8))
        assert _outside_ephemeral(base, job_ports(8)), base
        assert _outside_ephemeral(ports.free_port(), 1)


def test_derived_port_base_avoids_the_ephemeral_range_for_every_job():
    bases = {port_base(str(job), {}) for job in range(500)}
    assert len(bases) > 10  # jobs spread over the window
    assert all(b % PORTS_PER_JOB == 0 and _outside_ephemeral(b, PORTS_PER_JOB) for b in bases)
    assert port_base("7", {"PIVOTRL_PORT_BASE": "41000"}) == 41000


def test_a_bound_range_is_not_offered():
    base = free_port_base(3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", base + 2))
        assert not ports.port_free(base + 2)
        assert ports.port_free(base)


def test_a_base_handed_out_is_not_handed_out_again(monkeypatch):
    """Two launches at the same moment: the launcher keeps base + 1 bound, so a second
    search over the same one-range window finds nothing (CI: two side-by-side jobs' trainers
    on one base, EADDRINUSE)."""
    base = free_port_base(3)
    monkeypatch.setattr(ports, "aligned_window", lambda step: (base, base + 3 + step))
    assert not ports.port_free(base + 1) and ports.port_free(base)
    with pytest.raises(OSError, match="no range of 3 free TCP ports"):
        ports.free_port_base(3, tries=5)


@pytest.mark.parametrize("rng, window", [("32768 60999", (10000, 32768)),
                                         ("1024 60999", (61000, 65536)),
                                         ("1024 65535", (1024, 65536))])
def test_window_follows_the_sites_ephemeral_range(tmp_path, monkeypatch, rng, window):
    f = tmp_path / "range"
    f.write_text(rng + "\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", str(f))
    assert ports.port_window() == window
