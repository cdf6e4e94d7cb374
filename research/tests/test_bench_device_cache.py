"""research/gpu/bench_device_cache.py's CPU-checkable part: the admission plans it times on the GPU
(moved from tests/test_device_cache_copy.py)."""

from __future__ import annotations

import pytest
from harness_modules import load_script

pytest.importorskip("torch")


def test_bench_admission_plans_spread_slots_and_rotate_sources():
    bench = load_script("bench_device_cache")
    plans = bench.admit_plans(32, 4, 48, "cpu")
    assert len(plans) == bench.LAYERS
    for layer, p in enumerate(plans):
        assert (p >= 0).nonzero().flatten().tolist() == [0, 8, 16, 24]
        assert p[p >= 0].tolist() == [(layer * 4 + j) % 48 for j in range(4)]
    first = {int(e) for p in plans[:12] for e in p[p >= 0]}
    assert len(first) == 48  # 12 layers x 4 admissions read 48 distinct units
