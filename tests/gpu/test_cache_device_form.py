"""Accounting mode's core+dlfu (CPU, numpy: what the CPU build and CI run) against the device cache
on CUDA stepped by the served Triton kernel (residency.device_cache_fast.fast_policy, what
DeviceCaches(step="triton") runs for E, N <= 512) and by the torch-op step (E or N above 512): random
skewed routing up to 256 tokens a step (read-through steps), swaps through set_pinned every 40
steps; resident and pinned sets and every counter equal after every step. The same streams pass
with the torch-op step on CPU tensors (run on the CPU machine; the streams do not depend on the
device), so a failure here is the CUDA kernel's. One-line run (H200,
well under a minute; no vLLM, no model):

    PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_cache_device_form.py 2>&1 | tee $LOGDIR/cache_device_form.log
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from tests.test_cache_device_form import drive, torch_step  # noqa: E402
from tests.test_cache_device_form_fast import fast_step, synthetic_plan  # noqa: E402


@pytest.mark.parametrize(
    "experts,top_k,tail,wide",
    [(16, 2, 2, 24), (128, 8, 8, 256), (128, 8, 32, 8), (256, 8, 64, 64), (512, 8, 128, 96)],
)
def test_accounting_equals_the_served_cuda_step(experts, top_k, tail, wide):
    cores = {0: experts // 8, 1: experts // 4, 2: 3}
    plan = synthetic_plan(experts, cores, sum(cores.values()) + 3 * tail)
    drive(plan, tail, 200, seed=experts + tail, top_k=top_k, step_fn=fast_step, device="cuda", wide=wide)


def test_accounting_equals_the_torch_cuda_step_above_the_fused_limit():
    plan = synthetic_plan(640, {0: 40, 1: 8}, 48 + 2 * 520)
    drive(plan, 520, 80, seed=1, top_k=8, step_fn=torch_step, device="cuda", wide=512)
