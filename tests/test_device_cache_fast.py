"""The vectorised policy step (residency.device_cache_fast) against the torch-op step, under
TRITON_INTERPRET=1 on CPU tensors: every state tensor and the remapped ids equal after every step
of random traces (admissions, evictions, read-through, padding rows, ids outside [0, E), pins and a
yielded tail, no slots), on every path of the kernel -- forced by lowering the module's size limits
on small caches (the interpreter runs ~30 ms a step on this machine), and each path's use counted
from the torch twin's state so the test fails if a path was never taken."""

from collections import Counter

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from reap_swap.engine.device_cache import fast  # noqa: E402
from reap_swap.engine.device_cache.layer import DeviceCache, _policy, step_counts  # noqa: E402
from tests.triton_child import INTERPRETED, run_child_pytest  # noqa: E402

PARENT = "test_the_fast_kernel_under_the_triton_interpreter"

if not INTERPRETED:

    def test_the_fast_kernel_under_the_triton_interpreter():
        run_child_pytest(__file__)


@pytest.fixture(autouse=True)
def interpreted(request):
    if request.node.name != PARENT and not INTERPRETED:
        pytest.skip("runs in the child pytest started with TRITON_INTERPRET=1")
    yield


def path_of(cache: DeviceCache, ids, valid) -> tuple[str, bool]:
    """Which choice path the kernel takes this step (from the state before it) and whether the
    placement runs (something admitted or evicted): the kernel's branch conditions in torch."""
    need = step_counts(ids, cache.num_experts, valid) > 0
    in_slot = cache.expert_slot >= 0
    forced = in_slot & need
    rest = (in_slot | need) & ~forced & ~cache.pinned
    k = max(int(cache.active) - int(forced.sum()), 0)
    d = int(rest.sum()) - k
    if d <= 0:
        path = "no-ranking"
    elif k <= d:
        path = "keep-rounds" if k <= fast.ROUNDS else "all-pairs"
    else:
        path = "drop-rounds" if d <= fast.ROUNDS else "all-pairs"
    return path, None  # placement: see run_trace


def run_trace(experts, slots, rows, top_k, steps, seed, pins=(), skew=3.0):
    """Drive the kernel and the torch twin over a random trace; returns the paths taken."""
    gen = torch.Generator().manual_seed(seed)
    a, b = DeviceCache(experts, slots, "cpu"), DeviceCache(experts, slots, "cpu")
    for c in (a, b):
        c.seed(range(0, min(slots, experts), 3))
    paths = Counter()
    for t in range(steps):
        for at, pinned, active in pins:
            if t == at:
                for c in (a, b):
                    c.set_pinned(pinned, active)
        logits = torch.randn(rows, experts, generator=gen) + torch.linspace(skew, 0, experts)
        ids = torch.topk(logits, top_k, dim=-1).indices.to(torch.int32)
        if t % 5 == 3:
            ids[0, 0] = -1  # an id outside [0, E) passes through unchanged, uncounted
        valid = torch.rand(rows, generator=gen) > 0.2
        path, _ = path_of(b, ids, valid)
        before = b.slot_expert.clone()
        got, want = fast.fast_policy(a, ids, valid), _policy(b, ids, valid)
        paths[path] += 1
        paths["placed" if not torch.equal(before, b.slot_expert) else "unchanged"] += 1
        assert torch.equal(got, want) and got.dtype == ids.dtype, f"step {t}: remapped ids differ"
        for x, y in zip(a.state_tensors(), b.state_tensors(), strict=True):
            assert torch.equal(x, y), f"step {t}: state {x.tolist()} != {y.tolist()}"
    assert a.read_counters() == b.read_counters() and a.read_counters()["steps"] == steps
    return paths, a.read_counters()


# (ONEHOT_MAX, MATRIX_MAX, ROUNDS): the decode configuration, then each fallback forced
LIMITS = {
    "registers": (fast.ONEHOT_MAX, fast.MATRIX_MAX, fast.ROUNDS),
    "histogram+scratch": (16, 16, fast.ROUNDS),
    "all-pairs": (fast.ONEHOT_MAX, fast.MATRIX_MAX, 0),
    "one-round": (16, fast.MATRIX_MAX, 1),
}


@pytest.mark.parametrize("limits", sorted(LIMITS))
def test_fast_equals_torch_on_random_traces_on_every_path(limits, monkeypatch):
    onehot, matrix, rounds = LIMITS[limits]
    monkeypatch.setattr(fast, "ONEHOT_MAX", onehot)
    monkeypatch.setattr(fast, "MATRIX_MAX", matrix)
    monkeypatch.setattr(fast, "ROUNDS", rounds)
    monkeypatch.setattr(fast, "HIST_BR", 16)  # several histogram chunks on 40 selections
    monkeypatch.setattr(fast, "HIST_MIN_BINS", 16 if limits != "one-round" else 64)  # both ways
    pins = ((25, range(3), 4), (45, (), 6))  # a swap pins 3 and shrinks the tail; then undone
    paths, counters = run_trace(16, 6, 4, 4, 60, seed=1, pins=pins)  # mostly read-through
    light, _ = run_trace(32, 8, 2, 2, 60, seed=5, pins=((30, range(2), 7),), skew=5.0)  # mostly hits
    paths += light
    assert counters["admitted"] > 0 and counters["evicted"] > 0 and counters["read_through_steps"] > 0
    assert paths["placed"] > 0 and paths["unchanged"] > 0, paths
    if limits == "all-pairs":
        assert paths["all-pairs"] > 0, paths
    elif limits == "one-round":
        assert paths["keep-rounds"] > 0 and paths["drop-rounds"] > 0 and paths["all-pairs"] > 0, paths
    else:
        assert paths["no-ranking"] > 0 and paths["drop-rounds"] > 0 and paths["keep-rounds"] > 0, paths


def test_fast_at_decode_sizes_and_without_slots():
    """E=128 / 32 slots, 2 rows x top-8 (the register paths at a served shape), and a cache with
    no slots (every miss reads through)."""
    paths, counters = run_trace(128, 32, 2, 8, 16, seed=2, pins=((8, range(5), 24),))
    assert counters["admitted"] > 0 and counters["evicted"] > 0, counters
    paths, counters = run_trace(24, 0, 3, 2, 6, seed=3)
    assert counters["bypassed"] > 0 and counters["admitted"] == 0


def test_fast_int64_ids_and_no_valid_rows():
    a, b = DeviceCache(16, 4, "cpu"), DeviceCache(16, 4, "cpu")
    gen = torch.Generator().manual_seed(4)
    for t in range(8):
        ids = torch.randint(-1, 17, (3, 2), generator=gen)  # int64, some outside [0, E)
        got, want = fast.fast_policy(a, ids, None), _policy(b, ids, None)
        assert torch.equal(got, want) and got.dtype == torch.int64, t
        for x, y in zip(a.state_tensors(), b.state_tensors(), strict=True):
            assert torch.equal(x, y), t


def test_fast_refuses_more_than_512_experts():
    with pytest.raises(ValueError, match="512"):
        fast.fast_policy(DeviceCache(600, 4, "cpu"), torch.zeros(1, 2, dtype=torch.int32), None)


def test_fast_equals_torch_and_simulator_on_the_heldout_trace():
    """The committed mini trace (every step, one layer, core+dlfu at 25 %, padded to 8 rows):
    compare_layer checks the counters against the simulator, the twin step every state tensor."""
    from reap_swap.cache.trace import load_trace
    from reap_swap.engine.device_cache.replay import Variant, compare_layer, make_cache
    from reap_swap.plan.document import load_plan
    from reap_swap.sizing.cache_tail import layer_slots

    trace, layer = load_trace("data/traces/mini-moe-heldout.npz"), 2
    plan = load_plan("research-notes/cache-sim/plan-0.25.json")
    core = {l: plan.layers[l].core for l in trace.layers}
    slots = layer_slots(
        int(0.25 * len(trace.layers) * trace.num_experts), trace.layers, core, "core+tail", trace.num_experts
    )[0]
    v = Variant.of("core+dlfu", frozenset(core[layer]))
    twin = make_cache(v, trace.num_experts, slots[layer], "cpu", 0.8)

    def step(cache, ids, valid):
        got, want = fast.fast_policy(cache, ids, valid), _policy(twin, ids, valid)
        assert torch.equal(got, want)
        for x, y in zip(cache.state_tensors(), twin.state_tensors(), strict=True):
            assert torch.equal(x, y)

    got = compare_layer(trace, layer, v, slots[layer], step_fn=step, pad_to=8)
    assert got["steps"] == trace.num_steps and got["admitted"] > 0 and got["evicted"] > 0


def test_warm_runs_every_variant_on_a_throwaway_state():
    cache = DeviceCache(8, 4, "cpu")
    cache.seed([1, 5])
    before = {k: v.clone() for k, v in vars(cache).items() if isinstance(v, torch.Tensor)}
    launches = fast.warm(cache)
    assert launches == 2 * len(fast.warm_sizes(8, 4))
    for name, value in before.items():
        assert torch.equal(getattr(cache, name), value), f"warm changed the layer's {name}"
