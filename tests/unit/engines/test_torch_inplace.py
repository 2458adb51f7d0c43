"""The CPU decode's in-place reads of the paged KV pool (inplace.py, issue 42): runs of consecutive blocks, batches
of rows laid out alike (a shared prompt run is a step of 0), the placement that makes tables few runs, and the
logits of in-place reads equal to the gather path's on every kind of table (one run, several, shared, fragmented)."""
from __future__ import annotations

import pytest
import torch

from areal_mq.engines.torch import inplace
from areal_mq.engines.torch.kvcache import PagedKVCache

pytestmark = pytest.mark.timeout(120)


def test_runs_of_a_table_cut_at_its_keys():
    assert inplace.runs_of([4, 5, 6, 9, 10, 2], 90, 16) == [(4, 3, 48), (9, 2, 32), (2, 1, 10)]
    assert inplace.runs_of([4, 5, 6, 9], 20, 16) == [(4, 2, 20)]  # blocks past the keys are not read


def test_plan_batches_rows_whose_runs_step_alike():
    rows = [(0, [(0, 2, 20), (10, 1, 5)]), (1, [(0, 2, 20), (13, 1, 5)]), (2, [(0, 2, 20), (16, 1, 5)]),
            (7, [(0, 2, 20), (19, 1, 5)]),
            (3, [(0, 2, 20), (21, 1, 5)]),  # same shape, but its step breaks the progression: alone, gathered
            (4, [(40, 3, 40)]),  # another shape
            (5, [(50, 2, 30)]), (6, [(53, 2, 25)])]  # same blocks, different keys: a ragged batch
    batches = inplace.plan(rows, 16)
    assert ([0, 1, 2, 7], [(0, 0, 20), (10, 3, 5)], None) in batches  # the shared prompt run: step 0
    assert ([4], [(40, 0, 40)], None) in batches
    assert ([5, 6], [(50, 3, 32)], [30, 25]) in batches  # the last run read whole, each row's keys masked
    assert sorted(i for rows, _, _ in batches for i in rows) == [0, 1, 2, 4, 5, 6, 7]  # 3: 1 row, 2 runs: gathered


def test_rows_growing_side_by_side_keep_one_run_each():
    cache = PagedKVCache(layers=1, num_blocks=64, block_size=4, kv_heads=1, head_dim=2, dtype=torch.float32)
    tables: list[list[int]] = [[], [], [], []]
    for j in range(1, 13):  # 4 rows, one block at a time each, hint: 12 blocks
        for table in tables:
            assert cache.ensure(table, 4 * j, 12)
    assert [len(inplace.runs_of(t, 48, 4)) for t in tables] == [1, 1, 1, 1]
    cache.release(tables[1])
    late: list[int] = []
    assert cache.ensure(late, 8, 12) and late == [12, 13]  # the freed room, not the claimed room of a growing row


def _decode(engine, tables, positions, max_runs, monkeypatch):
    monkeypatch.setattr(inplace, "MAX_RUNS", max_runs)
    return engine.runner.decode(engine.cache, [3] * len(tables), positions, tables)


def test_in_place_reads_give_the_gather_paths_logits(make_engine, monkeypatch):
    engine = make_engine(max_concurrent=8, kv_cache_bytes=2 * 2 * 2 * 16 * 4 * 16 * 200)  # 199 blocks of 16
    cache = engine.cache
    gen = torch.Generator().manual_seed(0)
    for pool in (cache.k, cache.v):
        pool.copy_(torch.randn(pool.shape, generator=gen))
    prompt: list[int] = []
    assert cache.ensure(prompt, 40, 3)  # a shared 40-token prompt in blocks 0-2
    tables = []
    for _ in range(4):  # four samples on it, each with its own run after a copy of the partial block
        t = cache.share(prompt, 3)
        assert cache.writable(t, 40, 41, 10) and cache.ensure(t, 150, 10)
        tables.append(t)
    fragmented: list[int] = []
    for _ in range(6):  # one block at a time beside another growing table, no hint: many runs
        other: list[int] = []
        assert cache.ensure(fragmented, 16 * (len(fragmented) + 1)) and cache.ensure(other, 16)
    tables += [fragmented, [cache.num_blocks - 2, cache.num_blocks - 1]]
    positions = [140, 140, 140, 140, 95, 20]
    runs = [inplace.runs_of(t, p + 1, 16) for t, p in zip(tables, positions)]
    assert [len(r) for r in runs][:4] == [2, 2, 2, 2]
    assert [len(rows) for rows, _, _ in inplace.plan([(i, r) for i, r in enumerate(runs) if len(r) <= 4], 16)] == [4, 1]
    assert len(inplace.runs_of(fragmented, 96, 16)) > inplace.MAX_RUNS
    gathered = _decode(engine, tables, positions, -1, monkeypatch)
    in_place = _decode(engine, tables, positions, inplace.MAX_RUNS, monkeypatch)
    torch.testing.assert_close(in_place, gathered, rtol=1e-5, atol=1e-5)
    one_run = _decode(engine, tables, positions, 1, monkeypatch)  # only single-run rows in place
    torch.testing.assert_close(one_run, gathered, rtol=1e-5, atol=1e-5)
    ragged = [140, 141, 143, 142, 95, 20]  # the four samples in the same blocks at different positions: one batch
    batches = inplace.plan([(i, inplace.runs_of(t, p + 1, 16)) for i, (t, p) in enumerate(zip(tables, ragged))][:4], 16)
    assert len(batches) == 1 and batches[0][2] == [141 - 32, 142 - 32, 144 - 32, 143 - 32]
    torch.testing.assert_close(_decode(engine, tables, ragged, inplace.MAX_RUNS, monkeypatch),
                               _decode(engine, tables, ragged, -1, monkeypatch), rtol=1e-5, atol=1e-5)
    mixed = _decode(engine, tables, [140, 149, 60, 100, 95, 20], inplace.MAX_RUNS, monkeypatch)  # rows apart
    torch.testing.assert_close(mixed, _decode(engine, tables, [140, 149, 60, 100, 95, 20], -1, monkeypatch),
                               rtol=1e-5, atol=1e-5)
