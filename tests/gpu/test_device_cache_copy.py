"""The slot copy kernels on CUDA (residency.device_cache_copy, branch ``copynoop``): bit-exact copies
from HOST-backed expert units of a real cache range (device_cache_range.CacheRange) into its HBM
slots, eager and replayed in a CUDA graph with 0, 1, some and all N slots admitted, for the
persistent kernel (the default; its default grid and a small grid that loops) and the dense one;
slots not admitted keep their bytes. One-line run (H200, ~20 s):

    PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_device_cache_copy.py 2>&1 | tee $LOGDIR/device_cache_copy.log
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

E, N = 8, 6
PLANS = (
    [-1] * N,  # nothing admitted: the slots keep their bytes
    [-1, -1, 5, -1, -1, -1],  # one
    [7, -1, 0, 3, -1, 1],  # some, with gaps
    [2, 4, 6, 1, 0, 5],  # every slot
    [-1] * N,
)


@pytest.fixture(scope="module")
def rng_units():
    from reap_swap.engine import vmm
    from reap_swap.engine.device_cache.copy import unit_view
    from reap_swap.engine.device_cache.range import CacheRange

    unit = vmm.ensure_available(0)  # one granule (2 MiB): 64 chunks of 32 KiB
    rng = CacheRange.create(E, N, unit, 0)
    units = unit_view(rng.as_bytes(), E + N, unit)
    gen = torch.Generator(device="cuda").manual_seed(0)
    units.copy_(torch.randint(-(2**62), 2**62, units.shape, device="cuda", generator=gen))
    torch.cuda.synchronize()
    yield units
    del units
    rng.release()


def _kernels():
    from reap_swap.engine.device_cache import copy as dc

    return {
        "persistent": dc.copy_units,
        "persistent-p7": lambda u, p, e: dc.copy_units(u, p, e, programs=7),  # 7 < 64 chunks: loops
        "dense": dc.copy_units_dense,
    }


def _refill_slots(units, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    units[E:].copy_(torch.randint(-(2**62), 2**62, units[E:].shape, device="cuda", generator=gen))


def _reference(units, plan):
    from reap_swap.engine.device_cache.copy import copy_units_torch

    want = units.clone()  # an HBM copy of the whole range, host units included
    copy_units_torch(want, plan, E)
    return want


@pytest.mark.parametrize("kernel", ["persistent", "persistent-p7", "dense"])
def test_eager_copies_are_bit_exact(rng_units, kernel):
    fn = _kernels()[kernel]
    for i, plan in enumerate(PLANS):
        p = torch.tensor(plan, dtype=torch.int64, device="cuda")
        _refill_slots(rng_units, 100 + i)
        want = _reference(rng_units, p)
        fn(rng_units, p, E)
        torch.cuda.synchronize()
        assert torch.equal(rng_units, want), f"{kernel}: plan {plan}"


@pytest.mark.parametrize("kernel", ["persistent", "persistent-p7", "dense"])
def test_graph_replays_copy_what_each_step_admits(rng_units, kernel):
    fn = _kernels()[kernel]
    static = torch.full((N,), -1, dtype=torch.int64, device="cuda")
    fn(rng_units, static, E)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(rng_units, static, E)
    for i, plan in enumerate(PLANS * 2):
        static.copy_(torch.tensor(plan, dtype=torch.int64))
        _refill_slots(rng_units, 200 + i)
        want = _reference(rng_units, static)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(rng_units, want), f"{kernel} in a graph: replay {i}, plan {plan}"


def test_partial_chunk_unit_on_device_memory():
    """A unit that is not a multiple of the 32 KiB chunk (plain device tensor): masked tail."""
    from reap_swap.engine.device_cache import copy as dc

    unit_bytes = 8 * (3 * dc.BLOCK + 40)
    gen = torch.Generator(device="cuda").manual_seed(3)
    raw = torch.randint(0, 255, ((E + N) * unit_bytes,), dtype=torch.uint8, device="cuda", generator=gen)
    for kernel, fn in _kernels().items():
        for plan in PLANS:
            units = dc.unit_view(raw.clone(), E + N, unit_bytes)
            p = torch.tensor(plan, dtype=torch.int64, device="cuda")
            want = _reference(units, p)
            fn(units, p, E)
            assert torch.equal(units, want), f"{kernel}: plan {plan}"
