"""Accounting's core+dlfu against the device's *served* policy step (the vectorised Triton kernel,
residency.device_cache_fast, what DeviceCaches(step="triton") runs for E, N <= 512), under
TRITON_INTERPRET=1 on CPU tensors: the same drive as tests/test_cache_device_form.py (random
skewed routing, read-through steps, swaps through set_pinned), equal after every step. The CUDA
run of the same comparison is tests/gpu/test_cache_device_form.py."""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from tests.test_cache_device_form import drive  # noqa: E402
from tests.triton_child import INTERPRETED, run_child_pytest  # noqa: E402

PARENT = "test_the_served_step_under_the_triton_interpreter"

if not INTERPRETED:

    def test_the_served_step_under_the_triton_interpreter():
        run_child_pytest(__file__)


@pytest.fixture(autouse=True)
def interpreted(request):
    if request.node.name != PARENT and not INTERPRETED:
        pytest.skip("runs in the child pytest started with TRITON_INTERPRET=1")
    yield


def fast_step(d, ids):
    from reap_swap.engine.device_cache.fast import fast_policy

    fast_policy(d, ids, None)


def synthetic_plan(experts: int, cores: dict[int, int], budget_slots: int):
    layers = {l: SimpleNamespace(core=frozenset(range(n)), num_experts=experts) for l, n in cores.items()}
    return SimpleNamespace(layers=layers, swappable_budget_bytes=budget_slots, per_expert_bytes=1)


def test_mini_plan_shapes():
    from reap_swap.plan.document import load_plan

    drive(load_plan("plans/reap-mini-moe.plan.json"), 2, 100, seed=7, step_fn=fast_step)


def test_a_wider_layer():
    plan = synthetic_plan(64, {0: 12, 1: 5}, 64)
    drive(plan, 6, 60, seed=3, top_k=4, step_fn=fast_step, wide=20)
