"""The fused Triton policy step (residency.device_cache_fused) against the torch-op step and the
simulator, under TRITON_INTERPRET=1 on CPU tensors: every state tensor and the remapped ids equal
after every step, on the committed mini traces (every layer; dlfu, dlfu-seeded, core+dlfu at 25 %
and 50 %), with padding rows, read-through steps, pins and a yielded tail."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from reap_swap.cache_policy.replay import layer_slots  # noqa: E402
from reap_swap.plan import load_plan  # noqa: E402
from reap_swap.residency import device_cache_fused as fused  # noqa: E402
from reap_swap.residency.device_cache import DeviceCache, _policy  # noqa: E402
from reap_swap.residency.device_cache_replay import Variant, compare_layer, make_cache  # noqa: E402
from reap_swap.trace import load_trace  # noqa: E402
from tests.triton_child import INTERPRETED, run_child_pytest  # noqa: E402

HELDOUT = "data/traces/mini-moe-heldout.npz"
CALIB = "data/traces/mini-moe-calibration.npz"
PLANS = {"0.25": "research-notes/cache-sim/plan-0.25.json", "0.5": "plans/reap-mini-moe.plan.json"}


# Triton decides at decoration time whether a @triton.jit function is interpreted, and the kernel's
# helpers are decorated when device_cache_fused is imported: TRITON_INTERPRET=1 must be set before
# that import, so the tests below run in a child pytest started with it (the parent only starts it).
PARENT = "test_the_fused_kernel_under_the_triton_interpreter"

if not INTERPRETED:

    def test_the_fused_kernel_under_the_triton_interpreter():
        run_child_pytest(__file__)


@pytest.fixture(autouse=True)
def interpreted(monkeypatch, request):
    """The kernel is built (jit-decorated) under TRITON_INTERPRET=1 and dropped afterwards."""
    if request.node.name == PARENT:
        yield
        return
    if not INTERPRETED:
        pytest.skip("runs in the child pytest started with TRITON_INTERPRET=1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(fused, "_kernel", None)
    yield


def _twin_step(variant, num_experts, capacity, decay):
    """A step_fn driving the fused kernel on compare_layer's cache and the torch step on a twin,
    asserting the two equal (state tensors and remapped ids) after every step."""
    twin = make_cache(variant, num_experts, capacity, "cpu", decay)
    seen = {"steps": 0}

    def run(cache, ids, valid):
        got = fused.fused_policy(cache, ids, valid)
        want = _policy(twin, ids, valid)
        t = seen["steps"]
        assert torch.equal(got, want) and got.dtype == ids.dtype, f"step {t}: remapped ids differ"
        for a, b in zip(cache.state_tensors(), twin.state_tensors(), strict=True):
            assert torch.equal(a, b), f"step {t}: state {a.tolist()} != {b.tolist()}"
        seen["steps"] += 1

    return run


def _slots(trace, plan, budget):
    total = int(float(budget) * len(trace.layers) * trace.num_experts)
    core = {l: plan.layers[l].core for l in trace.layers}
    return layer_slots(total, trace.layers, core, "core+tail", trace.num_experts)[0], core


@pytest.mark.parametrize(
    "budget,policy,layer",
    [("0.25", "dlfu", 0), ("0.5", "dlfu-seeded", 1), ("0.25", "core+dlfu", 2), ("0.5", "core+dlfu", 3)],
)
def test_fused_equals_torch_step_and_simulator_on_the_heldout_trace(budget, policy, layer):
    """Every step of the trace (1536) on one layer per case (the interpreter runs ~20 ms a step:
    every layer x policy x budget would take a quarter of an hour; the GPU bench covers more)."""
    trace = load_trace(HELDOUT)
    slots, core = _slots(trace, load_plan(PLANS[budget]), budget)
    if layer in trace.layers:
        v = Variant.of(policy, frozenset(core[layer]))
        step = _twin_step(v, trace.num_experts, slots[layer], 0.8)
        got = compare_layer(trace, layer, v, slots[layer], step_fn=step, pad_to=8)
        assert got["steps"] == trace.num_steps and got["admitted"] > 0


def test_fused_other_trace_decay_and_tiny_caches():
    trace = load_trace(CALIB)
    for layer, cap in ((0, 3),):
        v = Variant.of("dlfu", frozenset())
        step = _twin_step(v, trace.num_experts, cap, 0.5)
        got = compare_layer(trace, layer, v, cap, decay=0.5, step_fn=step, pad_to=16)
        assert got["read_through_steps"] > 0 and got["admitted"] > 0


@pytest.mark.parametrize("experts,slots,rows", [(128, 64, 1), (128, 32, 64), (512, 512, 8), (256, 0, 4)])
def test_fused_equals_torch_on_random_routing_with_pins_and_a_yielded_tail(experts, slots, rows):
    gen = torch.Generator().manual_seed(experts + slots)
    a, b = DeviceCache(experts, slots, "cpu"), DeviceCache(experts, slots, "cpu")
    for c in (a, b):
        c.seed(range(0, min(slots, experts), 3))
    for t in range(12):
        if t == 6:  # a per-request swap between steps: pins 5 experts, the tail yields a quarter
            for c in (a, b):
                c.set_pinned(range(5), slots - slots // 4)
        logits = torch.randn(rows, experts, generator=gen) + torch.linspace(3, 0, experts)
        ids = torch.topk(logits, 8, dim=-1).indices.to(torch.int32)
        ids[0, 0] = -1 if t % 4 == 3 else ids[0, 0]  # an id outside [0, E) passes through
        valid = torch.rand(rows, generator=gen) > 0.2
        got, want = fused.fused_policy(a, ids, valid), _policy(b, ids, valid)
        assert torch.equal(got, want), t
        for x, y in zip(a.state_tensors(), b.state_tensors(), strict=True):
            assert torch.equal(x, y), t
    assert a.read_counters() == b.read_counters() and a.read_counters()["steps"] == 12


def test_fused_refuses_more_than_512_experts():
    with pytest.raises(ValueError, match="512"):
        fused.fused_policy(DeviceCache(600, 4, "cpu"), torch.zeros(1, 2, dtype=torch.int32), None)
