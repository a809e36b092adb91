"""All-to-all planning (appendix B.2), hybrid layout sizing (B.1), slice rules, control block."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest

from pivotrl_hpc.gps import control
from pivotrl_hpc.gps.layout import (ParallelPlace, TensorInfo, byte_ranges, choose_group_size,
                                    covering_range, hybrid_owner, target_index)
from pivotrl_hpc.gps.plan import (MAX_CHUNKS, MIN_CHUNK, LinkModel, PlanCache, Transfer, assign,
                                  chain, chunk_size, estimated_seconds, pipelined_seconds,
                                  refine)
from pivotrl_hpc.gps.shapes import ModelShape

SHAPE = ModelShape(vocab_size=512, hidden_size=128, intermediate_size=512, num_layers=2,
                   num_heads=8, num_kv_heads=4, head_dim=16, rope_theta=1e6,
                   tie_word_embeddings=False, qkv_bias=True, rms_norm_eps=1e-6,
                   max_position_embeddings=2048)


def test_refine_cuts_at_every_boundary_of_both_layouts():
    holders = {0: [(0, 100)], 1: [(0, 50)], 2: [(50, 100)]}
    demands = refine(holders, {3: [(0, 100)], 4: [(25, 75)]})
    assert [(d, r) for d, r, _ in demands] == [
        ((0, 25), 3), ((25, 50), 3), ((50, 75), 3), ((75, 100), 3), ((25, 50), 4), ((50, 75), 4)]
    assert dict(((d, r), h) for d, r, h in demands)[((0, 25), 3)] == (0, 1)
    assert dict(((d, r), h) for d, r, h in demands)[((50, 75), 4)] == (0, 2)
    with pytest.raises(LookupError, match=r"\[100, 120\)"):
        refine({0: [(0, 100)]}, {1: [(0, 120)]})


def test_greedy_balances_equal_links():
    links = LinkModel(local_bps=1e9, remote_bps=1e9, overhead_s=0.0)
    slices = [((i * 10, i * 10 + 10), 9, (0, 1)) for i in range(4)]
    plan = assign(slices, links)
    per = {s: sum(t.nbytes for t in plan if t.src == s) for s in (0, 1)}
    assert per == {0: 20, 1: 20}


def test_greedy_gives_fast_local_link_proportionally_more():
    """Paper Fig. 16: the receiver's own CPU (PCIe) is 4x faster than RDMA peers; it takes
    about 4x the data of each remote holder (15 + 3 x 3 of 24 equal slices is the best integer
    split: makespan 375 ns vs 400 ns for 16 + 8), and beats the local holder alone."""
    links = LinkModel(local_bps=4e9, remote_bps=1e9, overhead_s=0.0)
    demands = [((i * 100, i * 100 + 100), 2, (0, 1, 2, 3)) for i in range(24)]
    plan = assign(demands, links, skip_local=False)
    per = {s: sum(t.nbytes for t in plan if t.src == s) for s in range(4)}
    assert per[2] == 1500 and per[0] == per[1] == per[3] == 300
    only_local = assign([(d, r, (2,)) for d, r, _ in demands], links, skip_local=False)
    assert estimated_seconds(plan, links) < estimated_seconds(only_local, links)


def test_contiguous_slices_merge_and_local_ones_move_nothing():
    links = LinkModel(overhead_s=0.0)
    plan = assign([((0, 10), 1, (0,)), ((10, 20), 1, (0,)), ((20, 30), 1, (1,))], links)
    assert [(t.src, t.dst, t.start, t.stop) for t in plan] == [(0, 1, 0, 20)]


def test_a_write_goes_down_a_chain_of_its_receivers():
    """Writer 0, receivers 1..3, pieces of 25: each receiver pulls a piece from the node
    before it once that node holds it, so the Write takes M/B + (N-2) c/B (100 + 2 x 25),
    where the writer alone sending to all three takes 3 M/B."""
    links = LinkModel(local_bps=1.0, remote_bps=1.0, overhead_s=0.0)
    holders, targets = {0: [(0, 100)]}, {n: [(0, 100)] for n in range(4)}
    plan = chain(holders, targets, links, chunk=25)
    assert plan.transfers[:4] == (Transfer(0, 1, 0, 25), Transfer(1, 2, 0, 25),
                                  Transfer(2, 3, 0, 25), Transfer(0, 1, 25, 50))
    for n in (1, 2, 3):   # every receiver gets the whole model once, from one node
        got = [t for t in plan.transfers if t.dst == n]
        assert {t.src for t in got} == {n - 1} and sum(t.nbytes for t in got) == 100
    assert [plan.step(t) for t in plan.transfers if t.dst == 3] == [0, 1, 2, 3]
    assert pipelined_seconds(plan.transfers, links) == 150.0
    star = assign(refine(holders, targets), links)
    assert pipelined_seconds(star, links) == estimated_seconds(star, links) == 300.0


def test_chains_start_at_every_holder_and_carry_only_what_a_node_lacks():
    links = LinkModel(overhead_s=0.0)
    # two writers of one half each (a TP group over two nodes): the first half goes 0 -> 1
    # -> 2 -> 3, the second 1 -> 2 -> 3 -> 0
    plan = chain({0: [(0, 50)], 1: [(50, 100)]}, {n: [(0, 100)] for n in range(4)}, links,
                 chunk=50)
    assert [(t.src, t.dst, t.start) for t in plan.transfers] == [
        (0, 1, 0), (1, 2, 0), (2, 3, 0), (1, 2, 50), (2, 3, 50), (3, 0, 50)]
    # two holders of everything: two lines, each as long as half the receivers
    plan = chain({0: [(0, 100)], 1: [(0, 100)]}, {n: [(0, 100)] for n in range(6)}, links,
                 chunk=100)
    assert [(t.src, t.dst) for t in plan.transfers] == [(0, 2), (2, 3), (1, 4), (4, 5)]
    # the hybrid layout: a node is in the line of the slices it owns only
    plan = chain({0: [(0, 100)]}, {0: [(0, 100)], 1: [(0, 60)], 2: [(60, 100)],
                                   3: [(0, 60)]}, links, chunk=100)
    assert [(t.src, t.dst, t.start, t.stop) for t in plan.transfers] == [
        (0, 1, 0, 60), (1, 3, 0, 60), (0, 2, 60, 100)]
    # one receiver of slices scattered over the model (k = 2 on two nodes): one step, so
    # the node pulls them in one request, as the all-to-all did
    plan = chain({0: [(0, 100)]}, {0: [(0, 100)], 1: [(10, 20), (50, 60), (90, 100)]}, links)
    assert len(plan.transfers) == 3 and {plan.step(t) for t in plan.transfers} == {0}


def test_chunk_size_trades_the_pipeline_fill_against_the_pieces_overhead():
    links = LinkModel(remote_bps=50e9, overhead_s=20e-6)
    m = 15_231_233_024          # Qwen2.5-7B in bf16
    assert chunk_size(m, 1, links) == m                      # nobody forwards: one piece
    assert chunk_size(m, 3, links) == int((m * 20e-6 * 50e9 / 2) ** 0.5)   # the optimum
    assert chunk_size(m, 127, links) == m // MAX_CHUNKS      # at most MAX_CHUNKS pieces
    assert chunk_size(5_000_000, 2, LinkModel()) == MIN_CHUNK
    assert chunk_size(100, 2, LinkModel()) == 100


def test_a_chain_of_128_nodes_takes_about_one_model_transfer():
    """Qwen2.5-7B from one writer to 127 nodes over 50 GB/s IB: the pipeline needs (pieces +
    hops - 1) piece times, 1.29x one transfer of the model; the star plan 127x."""
    links = LinkModel(local_bps=63e9, remote_bps=50e9, overhead_s=20e-6)
    m, nodes = 15_231_233_024, 128
    holders, targets = {0: [(0, m)]}, {n: [(0, m)] for n in range(nodes)}
    plan = chain(holders, targets, links)
    c = plan.chunk
    assert c == m // MAX_CHUNKS and len(plan.transfers) == MAX_CHUNKS * (nodes - 1)
    one = links.cost(m, 0, 1)
    took = pipelined_seconds(plan.transfers, links)
    assert took == pytest.approx((MAX_CHUNKS + nodes - 2) * links.cost(c, 0, 1))
    assert 1.25 < took / one < 1.3
    star = assign(refine(holders, targets), links)
    assert pipelined_seconds(star, links) == pytest.approx((nodes - 1) * one)


def test_plan_cache_hits_by_signature():
    cache, calls = PlanCache(), []
    build = lambda: calls.append(1) or []  # noqa: E731
    a = cache.get(("read", "policy", ("n1",), ParallelPlace(2, 0)), build)
    b = cache.get(("read", "policy", ("n1",), ParallelPlace(2, 0)), build)
    cache.get(("read", "policy", ("n1",), ParallelPlace(2, 1)), build)
    assert a is b and len(calls) == 2 and (cache.hits, cache.misses) == (1, 2)


def test_group_size_is_the_smallest_that_fits():
    sizes = [[100] * 8, [300] * 4]  # 800 + 1200 bytes
    assert choose_group_size(sizes, 4, 2000) == 1
    assert choose_group_size(sizes, 4, 1999) == 2
    assert choose_group_size(sizes, 4, 999) == 4
    with pytest.raises(MemoryError, match="per-node budget of 10 bytes"):
        choose_group_size(sizes, 4, 10)
    infos = [TensorInfo(f"t{i}", "F32", (s // 4,), 0, s) for i, s in enumerate([40, 30, 20, 10])]
    owner = hybrid_owner(infos, 2)
    load = [sum(t.nbytes for t in infos if owner[t.name] == j) for j in (0, 1)]
    assert sorted(load) == [50, 50]


def test_byte_ranges_of_row_and_column_splits():
    info = TensorInfo("w", "F32", (4, 8), 1000, 1000 + 128)
    assert byte_ranges(info, (slice(2, 4), slice(None)), 4) == [(1064, 1128)]
    assert byte_ranges(info, (slice(None), slice(4, 8)), 4) == [
        (1016, 1032), (1048, 1064), (1080, 1096), (1112, 1128)]
    assert covering_range(info, (slice(None), slice(4, 8)), 4) == (1000, 1128)
    assert covering_range(info, (slice(1, 3), slice(None)), 4) == (1032, 1096)


def test_slice_rules_kv_replication_and_experts():
    kv = "model.layers.0.self_attn.k_proj.weight"
    assert target_index(kv, (64, 128), SHAPE, ParallelPlace(8, 5))[0] == slice(32, 48)
    with pytest.raises(ValueError):
        ParallelPlace(2, 2)

    moe = replace(SHAPE, num_experts=8, moe_intermediate_size=64)
    name = "model.layers.0.mlp.experts.{}.gate_proj.weight"
    place = ParallelPlace(tp_size=2, tp_rank=1, ep_size=4, ep_rank=1)
    assert target_index(name.format(1), (64, 128), moe, place) is None
    assert target_index(name.format(2), (64, 128), moe, place) == (slice(None), slice(None))
    assert target_index(name.format(3), (64, 128), moe, ParallelPlace(2, 1)) == (
        slice(32, 64), slice(None))


def test_control_block_seqlock_and_pins(tmp_path):
    path = tmp_path / "ctl"
    agent = control.ControlBlock(path, create=True, group_size=2)
    agent.publish("policy", 3, (2, 3))
    reader = control.ControlBlock(path)
    assert reader.state("policy") == control.ModelState(3, (2, 3))
    assert reader.group_size == 2 and reader.agent_pid == os.getpid()
    seg = tmp_path / "seg"
    seg.write_bytes(b"x")
    rfd, afd = os.open(seg, os.O_RDONLY), os.open(seg, os.O_RDONLY)
    control.lock_shared(rfd)
    assert not control.try_lock_exclusive(afd)  # pinned: the agent may not free it
    os.close(rfd)  # a reader's death drops its lock too
    assert control.try_lock_exclusive(afd)
    os.close(afd)
    with pytest.raises(KeyError):
        reader.state("genrm")
