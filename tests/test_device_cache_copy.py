"""The slot copy kernels (residency.device_cache_copy): the persistent launch (the default) and the
dense one, Triton under TRITON_INTERPRET=1 on CPU tensors (skipped where Triton is missing),
against the torch reference: 0, 1, some and every slot admitted, grids smaller and larger than
the work (programs looping over several (slot, chunk) items, programs with nothing to do), a
partial last chunk, and slot contents left untouched where nothing is admitted."""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from reap_swap.engine.device_cache import copy as dc  # noqa: E402
from reap_swap.engine.device_cache.copy import copy_units_torch, unit_view  # noqa: E402

SCRIPT = r"""
import torch
from reap_swap.engine.device_cache import copy as dc
E, N, unit_bytes = 5, 4, 8 * (2 * dc.BLOCK + 100)  # a unit of three chunks, the last partial
gen = torch.Generator().manual_seed(0)
raw = torch.randint(0, 255, ((E + N) * unit_bytes,), dtype=torch.uint8, generator=gen)
plans = ([-1, -1, -1, -1], [-1, 3, -1, -1], [4, -1, 0, 2], [1, 2, 3, 4], [0, 0, -1, 0])
for plan in plans:
    p = torch.tensor(plan, dtype=torch.int64)
    ref = dc.unit_view(raw.clone(), E + N, unit_bytes)
    dc.copy_units_torch(ref, p, E)
    for progs in (1, 2, 5, 7, None, 64):  # 7: more programs than one unit's chunks
        units = dc.unit_view(raw.clone(), E + N, unit_bytes)
        dc.copy_units(units, p, E, programs=progs)
        assert torch.equal(units, ref), f"persistent, plan {plan}, {progs} programs"
    units = dc.unit_view(raw.clone(), E + N, unit_bytes)
    dc.copy_units_dense(units, p, E)
    assert torch.equal(units, ref), f"dense, plan {plan}"
    if all(e < 0 for e in plan):
        assert torch.equal(ref, dc.unit_view(raw, E + N, unit_bytes)), "nothing admitted, slots changed"
# int32 entries (the kernel loads and widens them) and a single slot
p32 = torch.tensor([-1, 2, -1, 1], dtype=torch.int32)
units, ref = dc.unit_view(raw.clone(), E + N, unit_bytes), dc.unit_view(raw.clone(), E + N, unit_bytes)
dc.copy_units(units, p32, E, programs=3)
dc.copy_units_torch(ref, p32.to(torch.int64), E)
assert torch.equal(units, ref), "int32 plan"
one = dc.unit_view(raw.clone(), E + 1, unit_bytes)
want = one.clone()
want[E] = one[3]
dc.copy_units(one, torch.tensor([3]), E, programs=2)
assert torch.equal(one, want), "one slot"
print("ok")
"""


def test_reference_copies_active_entries_only():
    raw = torch.arange(6 * 16, dtype=torch.int64).view(torch.uint8)
    units = unit_view(raw, 6, 128)
    before = units.clone()
    copy_units_torch(units, torch.tensor([2, -1]), 4)
    assert torch.equal(units[4], before[2]) and torch.equal(units[5], before[5])
    assert torch.equal(units[:4], before[:4])
    with pytest.raises(ValueError, match="multiple of 8"):
        unit_view(raw, 6, 12)


def test_persistent_grid_is_fixed_and_bounded_by_the_work():
    units = torch.zeros(10, 3 * dc.BLOCK, dtype=torch.int64)  # 3 chunks per unit
    assert dc.programs_for(units, 2) == min(dc.CPU_PROGRAMS, 6)
    assert dc.programs_for(units, 2, programs=100) == 6  # never more than N x chunks items
    assert dc.programs_for(units, 4, programs=5) == 5
    dc.copy_units(units, torch.empty(0, dtype=torch.int64), 10)  # no slots: no launch
    with pytest.raises(ValueError, match="4097 cache slots"):
        dc.copy_units(units, torch.full((4097,), -1), 10)


def test_triton_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_persistent_kernel_compiles_for_sm90_with_16_byte_accesses():
    """Ahead-of-time compile (no GPU needed: Triton's bundled ptxas) of the persistent kernel for
    an H200 (sm_90): every load and store of the copy loop is a 16 B vector access, which needs
    unit_elems left to Triton's divisibility specialisation (the dense kernel's 8 B ones did not)."""
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("this Triton has no ASTSource / GPUTarget")
    sig = {"units_ptr": "*i64", "copy_ptr": "*i64", "num_experts": "i32", "num_slots": "i32"}
    sig |= {"unit_elems": "i32", "chunks": "i32", "BN": "constexpr", "BLOCK": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 4)}  # what a 2 MiB-multiple unit gets
    src = ASTSource(dc._kernel("persistent"), sig, {"BN": 64, "BLOCK": dc.BLOCK}, attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": dc.NUM_WARPS}).asm[
        "ptx"
    ]
    per_thread = dc.BLOCK // (32 * dc.NUM_WARPS) // 2  # 16 B = two int64 per access
    assert ptx.count("ld.global.v2.b64") == per_thread and ptx.count("st.global.v2.b64") == per_thread
