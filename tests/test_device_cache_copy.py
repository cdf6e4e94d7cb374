"""The slot copy kernel (residency.device_cache_copy): Triton under TRITON_INTERPRET=1 on CPU
tensors (skipped where Triton is missing) against the torch reference, with inactive entries."""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from reap_swap.residency.device_cache_copy import copy_units_torch, unit_view  # noqa: E402

SCRIPT = r"""
import torch
from reap_swap.residency import device_cache_copy as dc
E, N, unit_bytes = 5, 3, 8 * (dc.BLOCK + 100)  # a unit of two chunks, the second partial
gen = torch.Generator().manual_seed(0)
raw = torch.randint(0, 255, ((E + N) * unit_bytes,), dtype=torch.uint8, generator=gen)
units = dc.unit_view(raw, E + N, unit_bytes)
ref = units.clone()
plan = torch.tensor([4, -1, 0], dtype=torch.int64)
dc.copy_units(units, plan, E)
dc.copy_units_torch(ref, plan, E)
assert torch.equal(units, ref), "kernel != reference"
assert torch.equal(units[E], units[4]) and torch.equal(units[E + 2], units[0])
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


def test_triton_kernel_under_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
