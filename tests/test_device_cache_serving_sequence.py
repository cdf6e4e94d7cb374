"""Branch cachebug (issue 17): a fake *serving sequence* through the device cache on CPU tensors,
every step compared bitwise with the uncached reference.

What serving does that the kernel tests did not (run10's reap-cache arm, E = 128, top-8, 32 pinned
+ 32 tail slots): a profile run of many rows all routed to the same 8 experts, CUDA-graph warm-ups
whose rows are all padding (valid_rows all False), prefills of 17-64 rows (wider than pinned +
slots: read-through), padded piecewise steps (5 real rows + 3 padding rows with garbage routing),
long decode runs of 1 row with a drifting hot set (admissions and evictions every few steps).
The step is the torch reference (device_cache.LayerStep with copy_units_torch) over a CPU "range"
of E + N units laid out as rehome_with_slots lays them out; the MoE is a per-selection torch
reference evaluated in top-k order, so cached == stock bitwise iff every selection read the bytes
of its own expert. After each step every occupied slot must hold its expert's bytes."""

import pytest

torch = pytest.importorskip("torch")

from reap_swap.engine.device_cache.copy import unit_view  # noqa: E402
from reap_swap.engine.device_cache.layer import DeviceCache, LayerStep  # noqa: E402

E, N, TOPK, H, INTER = 128, 32, 8, 16, 8
UNIT_ELEMS = 2 * INTER * H + H * INTER + 64  # w13, w2, then padding (units are padded in HBM too)


def _range(gen):
    w13 = torch.randn(E, 2 * INTER, H, generator=gen)
    w2 = torch.randn(E, H, INTER, generator=gen)
    flat = torch.zeros((E + N) * UNIT_ELEMS, dtype=torch.float32)

    def views(units):
        a = flat.as_strided((units, 2 * INTER, H), (UNIT_ELEMS, H, 1), 0)
        b = flat.as_strided((units, H, INTER), (UNIT_ELEMS, INTER, 1), 2 * INTER * H)
        return a, b

    v13, v2 = views(E)
    v13.copy_(w13)
    v2.copy_(w2)
    units = unit_view(flat.view(torch.uint8), E + N, UNIT_ELEMS * 4)
    return w13, w2, views(E + N), units


def _moe(x, w13, w2, tw, ids):
    """Per-selection experts summed in top-k order: bitwise a function of (x, bytes of ids)."""
    g, u = (torch.einsum("mh,mkih->mki", x, w13[ids.long()])).chunk(2, dim=-1)
    y = torch.einsum("mki,mkhi->mkh", torch.nn.functional.silu(g) * u, w2[ids.long()])
    out = torch.zeros_like(x)
    for k in range(ids.shape[1]):
        out = out + tw[:, k : k + 1] * y[:, k]
    return out


def _routing(gen, rows, hot, spread):
    """Skewed top-k: mostly from the ``hot`` set, sometimes anywhere (spread)."""
    logits = torch.randn(rows, E, generator=gen) * spread
    logits[:, hot] += 4.0
    tw, ti = torch.topk(torch.softmax(logits, -1), TOPK)
    return torch.randn(rows, H, generator=gen), tw, ti.to(torch.int32)


def _sequence(gen):
    """(rows, valid rows or None, hot set, spread) per step, in serving order."""
    hot0 = torch.arange(8)
    steps = [(512, None, hot0, 0.0)]  # profile run: zero-ish input, every row to the same experts
    steps += [(r, torch.zeros(r, dtype=torch.bool), hot0, 1.0) for r in (16, 8, 4, 2, 1) * 3]
    for plen in (38, 23, 45, 17, 64, 29, 40, 33):
        hot = torch.randperm(E, generator=gen)[:24]
        steps.append((plen, None, hot, 6.0))  # eager prefill: read-through
        for t in range(48):
            if t % 7 == 3:  # a padded piecewise step: 5 real rows, 3 padding rows
                steps.append((8, torch.arange(8) < 5, hot, 1.0))
            if t % 12 == 0:  # the hot set drifts: new admissions, evictions of idle slots
                hot = torch.cat([hot[4:], torch.randperm(E, generator=gen)[:4]])
            steps.append((1, torch.ones(1, dtype=torch.bool), hot, 1.0))
    return steps


@pytest.mark.parametrize("seed", [0, 1])
def test_serving_sequence_is_bitwise_stock_at_every_step(seed):
    gen = torch.Generator().manual_seed(seed)
    w13, w2, (x13, x2), units = _range(gen)
    cache = DeviceCache(E, N, "cpu")
    step = LayerStep(cache, units)
    cache.set_pinned(range(0, E, 4))  # the plan core: 32 pinned experts in their own units
    for t, (rows, valid, hot, spread) in enumerate(_sequence(gen)):
        x, tw, ti = _routing(gen, rows, hot, spread)
        if valid is not None and not valid.all():  # padding rows: garbage routing, as vLLM pads
            ti = torch.where(
                valid[:, None], ti, torch.randint(0, E, ti.shape, generator=gen, dtype=torch.int32)
            )
        ref = _moe(x, w13, w2, tw, ti)
        ids = step(ti, valid)
        out = _moe(x, x13, x2, tw, ids)
        assert torch.equal(out, ref), f"step {t} ({rows} rows): max diff {(out - ref).abs().max()}"
        for s, e in enumerate(cache.slot_expert.tolist()):
            assert e < 0 or torch.equal(units[E + s], units[e]), f"step {t}: slot {s} != expert {e}"
    c = cache.read_counters()
    assert c["admitted"] > N and c["evicted"] > 0 and c["read_through_steps"] >= 8, c
