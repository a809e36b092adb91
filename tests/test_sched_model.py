"""Throughput model (§6.1, appendix A) and the A, B, C, D fitter."""
from __future__ import annotations

import random

import pytest

from pivotrl_hpc.sched import (BinaryThroughputModel, ThroughputModel, ThroughputSample,
                               fit_throughput_model)

M = ThroughputModel(A=5e-8, B=0.012, C=2e-4, D=0.008)


def test_throughput_formula_memory_and_compute_bound():
    # memory-bound: 10 seqs, 20k tokens -> L = 0.001 + 0.012 + 0.008 = 0.021
    assert M.latency(10, 20_000) == pytest.approx(0.021)
    assert M.throughput(10, 20_000) == pytest.approx(10 / 0.021)
    # compute-bound: 100 seqs -> C*n = 0.02 > B
    assert M.latency(100, 20_000) == pytest.approx(0.001 + 0.02 + 0.008)
    assert M.throughput(0, 0) == 0.0


def test_gain_is_difference_of_throughputs():
    g = M.gain(10, 20_000, 1_000)
    assert g == pytest.approx(11 / (5e-8 * 21_000 + 0.012 + 0.008) - 10 / 0.021)
    assert M.gain(0, 0, 500) == pytest.approx(1 / (5e-8 * 500 + 0.02))


def test_diminishing_gain_and_long_sequences_cost_more():
    assert M.gain(5, 5_000, 1_000) > M.gain(80, 80_000, 1_000)
    assert M.gain(20, 20_000, 200) > M.gain(20, 20_000, 20_000)


def test_binary_model_is_zero_or_one():
    b = BinaryThroughputModel()
    assert (b.throughput(0, 0), b.throughput(3, 10)) == (0.0, 1.0)
    assert (b.gain(0, 0, 5), b.gain(3, 10, 5)) == (1.0, 0.0)


def test_model_rejects_negative_constants():
    with pytest.raises(ValueError, match="A="):
        ThroughputModel(-1.0, 0.1, 0.0, 0.0)
    with pytest.raises(ValueError, match="lacks constant 'D'"):
        ThroughputModel.from_dict({"A": 1, "B": 1, "C": 1})


def _samples(model: ThroughputModel, noise: float, seed: int, reps: int = 1
             ) -> list[ThroughputSample]:
    """A profiling sweep: batch sizes x mean lengths, `reps` noisy measurements each."""
    rng = random.Random(seed)
    out = []
    for n in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256):
        for mean_len in (200, 800, 2000):
            for _ in range(reps):
                t = n * mean_len
                lat = model.latency(n, t) * (1 + rng.uniform(-noise, noise))
                out.append(ThroughputSample(n, t, lat))
    return out


@pytest.mark.parametrize("truth", [M, ThroughputModel(1.5e-7, 0.02, 3e-4, 0.015),
                                   ThroughputModel(2e-8, 0.03, 2.5e-4, 0.004)])
def test_fitter_recovers_constants_within_5_percent(truth):
    # ±0.5 % per sample (each an average over many decode steps); 30 seeds stay < 5 %
    fit = fit_throughput_model(_samples(truth, noise=0.005, seed=1, reps=4))
    for name in "ABCD":
        got, want = getattr(fit.model, name), getattr(truth, name)
        assert got == pytest.approx(want, rel=0.05), name
    assert fit.rel_rms_error < 0.005
    assert fit.samples == 156


def test_fitter_exact_on_noiseless_samples():
    fit = fit_throughput_model(_samples(M, noise=0.0, seed=0))
    assert fit.rel_max_error < 1e-9
    assert fit.model.C * 60 == pytest.approx(fit.model.B, rel=1e-6)  # breakpoint n = B/C


def test_fitter_memory_bound_only_samples():
    truth = ThroughputModel(5e-8, 0.02, 0.0, 0.0)
    samples = [ThroughputSample(n, n * 500, truth.latency(n, n * 500) * 1.0)
               for n in (1, 2, 3, 4, 5, 6)] + [ThroughputSample(3, 9000, truth.latency(3, 9000))]
    fit = fit_throughput_model(samples)
    assert fit.rel_max_error < 1e-9
    assert fit.model.latency(4, 4000) == pytest.approx(truth.latency(4, 4000))


def test_fitter_rejects_bad_input():
    with pytest.raises(ValueError, match="at least 4"):
        fit_throughput_model([ThroughputSample(1, 10, 0.01)])
    with pytest.raises(ValueError, match="bad throughput sample"):
        fit_throughput_model([ThroughputSample(1, 10, 0.01)] * 3 + [ThroughputSample(0, 1, 1.0)])


def test_fitter_compute_bound_only_samples_and_zero_floor():
    truth = ThroughputModel(4e-8, 0.0, 5e-4, 0.0)   # no latency floor: L = A t + C n
    samples = [ThroughputSample(n, n * m, truth.latency(n, n * m))
               for n in (1, 3, 9, 27, 81) for m in (100, 1000)]
    fit = fit_throughput_model(samples)
    assert fit.rel_max_error < 1e-6
    assert fit.model.throughput(5, 5000) == pytest.approx(truth.throughput(5, 5000))
    with pytest.raises(ValueError, match="latency floor"):
        ThroughputModel(1e-8, 0.0, 0.0, 0.0)


def _brute_force_rms(samples) -> float:
    """Every split's clipped least-squares model checked on every sample (numpy), the best
    relative RMS: the reference for the fit's shortlist of splits."""
    import numpy as np

    t = np.array([s.n_tok for s in samples], float)
    n = np.array([s.n_seq for s in samples], float)
    y = np.array([s.latency for s in samples], float)
    best = np.inf
    for split in [n.min() - 1, *sorted(set(n))]:
        low = n <= split
        cols = [t, low * 1.0, ~low * n, ~low * 1.0]
        keep = [0, 1] if low.all() else [0, 2, 3] if not low.any() else [0, 1, 2, 3]
        X = np.stack([cols[k] for k in keep], 1) / y[:, None]
        sol = np.linalg.lstsq(X, np.ones_like(y), rcond=None)[0]
        full = dict(zip(keep, sol))
        a, e, c, d = (full.get(k, 0.0) for k in range(4))
        b = e if keep == [0, 1] else 0.0 if keep == [0, 2, 3] else e - d
        a, b, c, d = (max(0.0, v) for v in (a, b, c, d))
        if b + d <= 0 and c <= 0:
            continue
        pred = a * t + np.maximum(b, c * n) + d
        best = min(best, float(np.sqrt(np.mean(((pred - y) / y) ** 2))))
    return best


def test_fit_matches_a_brute_force_over_every_split():
    """Many distinct sequence counts (up to 300, more splits than the shortlist of 64):
    the fit's error is the brute force's within 2 %, and equal where no noise is."""
    rng = random.Random(7)
    for trial in range(12):
        truth = ThroughputModel(rng.uniform(0, 1e-6), rng.uniform(1e-3, 2e-2),
                                rng.uniform(1e-5, 5e-4), rng.uniform(0, 3e-3))
        noise = (0.0, 0.02, 0.1)[trial % 3]
        samples = []
        for _ in range(300):
            n = rng.randint(1, 300)
            t = n * rng.randint(1, 500)
            samples.append(ThroughputSample(n, t, truth.latency(n, t) *
                                            max(0.2, 1 + rng.gauss(0, noise))))
        fit = fit_throughput_model(samples)
        ref = _brute_force_rms(samples)
        assert fit.rel_rms_error <= ref * 1.02 + 1e-9, (trial, fit.rel_rms_error, ref)
