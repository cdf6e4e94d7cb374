"""The Triton step's warm-up covers every compile-time variant a step can meet: a variant it misses
is compiled inside the first request that meets it (run 32 saw that as a first-request spike)."""

import pytest

pytest.importorskip("torch")

from reap_swap.engine.device_cache import fast  # noqa: E402


@pytest.mark.parametrize("experts", [8, 16, 60, 64, 128, 160, 256, 384, 512])
@pytest.mark.parametrize("slots", [1, 7, 32, 64, 200, 512])
def test_warm_sizes_reach_every_variant_of_any_step(experts, slots):
    warmed = {tuple(fast.variant(experts, slots, n).items()) for n in fast.warm_sizes(experts, slots)}
    # every step size up to 64k selections (8k tokens at top-8), densely at the small end
    sizes = list(range(1, 4097)) + [4096 + 61 * i for i in range(1, 1000)]
    met = {tuple(fast.variant(experts, slots, n).items()) for n in sizes}
    assert met <= warmed, f"variants compiled mid-request: {met - warmed}"
    assert len(warmed) == len(fast.warm_sizes(experts, slots))  # no size warms a variant twice


def test_a_step_wider_than_the_one_hot_limit_is_one_variant():
    wide = {tuple(fast.variant(128, 64, n).items()) for n in (129, 1000, 16384, 65536)}
    assert len(wide) == 1
    assert fast.variant(128, 64, 128)["ONEHOT"] and not fast.variant(128, 64, 129)["ONEHOT"]


def test_a_triton_step_that_cannot_compile_leaves_the_layer_on_the_torch_step(monkeypatch):
    import torch

    from reap_swap.engine.device_cache import api
    from reap_swap.engine.device_cache.layer import DeviceCache

    caches = api.DeviceCaches(step="triton")
    cache = DeviceCache(128, 64, "cpu")

    def broken(_cache):
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(api, "warm_triton_step", broken)
    said = []
    monkeypatch.setattr(api.log, "warning", lambda fmt, *args: said.append(fmt % args))
    assert caches._warm(cache, 3) == "torch"
    assert any("layer 3 runs the torch policy step" in m and "PassManager" in m for m in said), said
    monkeypatch.setattr(api, "warm_triton_step", lambda c: 10)
    assert caches._warm(cache, 3) == "triton"
    assert torch.equal(cache.slot_expert, torch.full((64,), -1))  # the layer's own state untouched
