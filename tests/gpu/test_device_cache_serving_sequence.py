"""Issue 17 / branch cachebug on the H200: run10's serving sequence at run10's shapes, at kernel
level, every step bitwise against the stock kernel call. One line (~1 min; logs to $LOGDIR):

    PYTHONPATH=$PWD python -m pytest -q -s tests/gpu/test_device_cache_serving_sequence.py 2>&1 | tee $LOGDIR/cachebug_gpu.log

Shapes: E = 128 experts (host-backed units of a real CacheRange), N = 32 HBM slot units, top-8,
hidden 2048, intermediate 768, bf16 -- the kit's mk_model. Sequence (the CPU twin is
tests/test_device_cache_serving_sequence.py): a profile run of 512 rows on 8 experts, all-padding
warm-ups, 8 prompts of a read-through prefill (17-64 rows, eager) then 48 one-row decode steps
with a drifting hot set and padded 8-row steps (5 real rows), then the same decode pattern
replayed inside captured CUDA graphs (1 row, and 8 rows with 3 padding rows) with new inputs.
Policy step: the Triton step that serves (device_cache/fast.py). Kernel: vLLM's fused_experts; the cached call gets
the stock [E, ...] tile config (what compat.moe_cache's config alias does when serving) and
vLLM's block-assignment rule evaluated with the stock E (the cachebug fix). Also measured and
printed: whether vLLM's naive and aligned block assignments give the same bits for 5 tokens
(the case the fix changes; ``NAIVE_VS_ALIGNED`` line).

A failure names the step, its rows, the path taken and whether the slots held their bytes.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

E, N, H, INTER, TOPK = 128, 32, 2048, 768, 8


@pytest.fixture(scope="module")
def fm():
    return pytest.importorskip("vllm.model_executor.layers.fused_moe")


@pytest.fixture(scope="module")
def fmm():
    return pytest.importorskip("vllm.model_executor.layers.fused_moe.fused_moe")


@pytest.fixture(scope="module")
def layer():
    from reap_swap.engine import vmm
    from reap_swap.engine.device_cache.range import rehome_with_slots
    from reap_swap.sizing.unit_layout import plan_unit

    gen = torch.Generator(device="cpu").manual_seed(0)
    w13 = (torch.randn(E, 2 * INTER, H, generator=gen) * 0.02).to(torch.bfloat16).cuda()
    w2 = (torch.randn(E, H, INTER, generator=gen) * 0.02).to(torch.bfloat16).cuda()
    slabs = [("w13_weight", w13[0].numel() * 2), ("w2_weight", w2[0].numel() * 2)]
    unit = plan_unit(slabs, vmm.ensure_available(0)).unit_bytes
    rng, range_bytes, views, ext = rehome_with_slots(w13, w2, unit, N, 0)
    yield {"w13": w13, "w2": w2, "unit": unit, "rng": rng, "bytes": range_bytes, "ext": ext}
    rng.release()


@pytest.fixture
def stock_rule(monkeypatch, fmm):
    """The cached call's block assignment decided with the stock E (compat.moe_cache's fix), over
    fused_moe's own name (fused_experts calls it there)."""
    from reap_swap.compat import moe_cache

    monkeypatch.setattr(moe_cache, "_UNITS", {E + N: E})
    monkeypatch.setattr(
        fmm, "_prepare_expert_assignment", moe_cache.stock_assignment(fmm._prepare_expert_assignment)
    )


def _cfg(fmm, rows):
    return fmm.try_get_optimal_moe_config((E, 2 * INTER, H), (E, H, INTER), TOPK, None, rows)


def _stock(fm, fmm, layer, x, tw, ti):
    return fm.fused_experts(x, layer["w13"], layer["w2"], tw, ti)


def _cached(fm, fmm, layer, x, tw, ids):
    with fm.override_config(_cfg(fmm, x.shape[0])):
        return fm.fused_experts(x, *layer["ext"], tw, ids, global_num_experts=E + N)


def _routing(gen, rows, hot, spread):
    logits = torch.randn(rows, E, generator=gen) * spread
    logits[:, hot] += 4.0
    tw, ti = torch.topk(torch.softmax(logits, -1), TOPK)
    x = (torch.randn(rows, H, generator=gen)).to(torch.bfloat16)
    return x.cuda(), tw.float().cuda(), ti.to(torch.int32).cuda()


def _sequence(gen):
    hot0 = torch.arange(8)
    steps = [(512, None, hot0, 0.0)]
    steps += [(r, torch.zeros(r, dtype=torch.bool), hot0, 1.0) for r in (16, 8, 4, 2, 1) * 3]
    for plen in (38, 23, 45, 17, 64, 29, 40, 33):
        hot = torch.randperm(E, generator=gen)[:24]
        steps.append((plen, None, hot, 6.0))
        for t in range(48):
            if t % 7 == 3:
                steps.append((8, torch.arange(8) < 5, hot, 1.0))
            if t % 12 == 0:
                hot = torch.cat([hot[4:], torch.randperm(E, generator=gen)[:4]])
            steps.append((1, torch.ones(1, dtype=torch.bool), hot, 1.0))
    return steps


def _step(layer):
    from reap_swap.engine.device_cache.copy import unit_view
    from reap_swap.engine.device_cache.layer import DeviceCache, LayerStep

    cache = DeviceCache(E, N, "cuda")
    step = LayerStep(cache, unit_view(layer["bytes"], E + N, layer["unit"]), step="triton")
    cache.set_pinned(range(0, E, 4))  # 32 pinned, as the plan core (their units stay host-backed here)
    return step


def _slots_ok(step) -> list[int]:
    units, bad = step.units, []
    for s, e in enumerate(step.cache.slot_expert.tolist()):
        if e >= 0 and not torch.equal(units[E + s], units[e]):
            bad.append(s)
    return bad


def _garbage_padding(gen, ti, valid):
    if valid is None or bool(valid.all()):
        return ti
    junk = torch.randint(0, E, ti.shape, generator=gen, dtype=torch.int32).cuda()
    return torch.where(valid.cuda()[:, None], ti, junk)


def test_eager_serving_sequence_bitwise(fm, fmm, layer, stock_rule):
    gen = torch.Generator().manual_seed(11)
    step = _step(layer)
    for t, (rows, valid, hot, spread) in enumerate(_sequence(gen)):
        x, tw, ti = _routing(gen, rows, hot, spread)
        ti = _garbage_padding(gen, ti, valid)
        ref = _stock(fm, fmm, layer, x, tw, ti)
        ids = step(ti, None if valid is None else valid.cuda())
        out = _cached(fm, fmm, layer, x, tw, ids)
        if not torch.equal(out, ref):
            diff = (out.float() - ref.float()).abs().max().item()
            pytest.fail(
                f"step {t}: {rows} rows, naive={rows * TOPK * 4 <= E}, max diff {diff:.3e}, "
                f"slots with wrong bytes {_slots_ok(step)}, counters {step.cache.read_counters()}"
            )
        if t % 16 == 0:
            assert not _slots_ok(step), f"step {t}: slots {_slots_ok(step)} do not hold their experts"
    c = step.cache.read_counters()
    print("EAGER", c)
    assert c["admitted"] > N and c["evicted"] > 0 and c["read_through_steps"] >= 8, c


@pytest.mark.parametrize("rows,real", [(1, 1), (8, 5)])
def test_graph_replayed_decode_bitwise(fm, fmm, layer, stock_rule, rows, real):
    gen = torch.Generator().manual_seed(12 + rows)
    step = _step(layer)
    hot = torch.randperm(E, generator=gen)[:24]
    x, tw, ti = _routing(gen, rows, hot, 1.0)
    valid = (torch.arange(rows) < real).cuda()
    for _ in range(3):  # vLLM's warm-up runs before capture (executed: state and copies advance)
        _cached(fm, fmm, layer, x, tw, step(ti, valid))
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = _cached(fm, fmm, layer, x, tw, step(ti, valid))
    for t in range(120):
        if t % 12 == 0:
            hot = torch.cat([hot[4:], torch.randperm(E, generator=gen)[:4]])
        nx, ntw, nti = _routing(gen, rows, hot, 1.0)
        nti = _garbage_padding(gen, nti, valid.cpu())
        x.copy_(nx)
        tw.copy_(ntw)
        ti.copy_(nti)
        g.replay()
        ref = _stock(fm, fmm, layer, x, tw, ti)
        if not torch.equal(out, ref):
            diff = (out.float() - ref.float()).abs().max().item()
            pytest.fail(
                f"replay {t} ({rows} rows, {real} real): max diff {diff:.3e}, bad slots {_slots_ok(step)}"
            )
    c = step.cache.read_counters()
    print("GRAPH", rows, c)
    assert c["admitted"] > N and c["evicted"] > 0, c


def test_naive_vs_aligned_and_the_fixed_five_token_step(fm, fmm, layer, stock_rule):
    """Prints NAIVE_VS_ALIGNED equal=<bool> for 5 tokens on the stock weights (what the fix avoids
    when False), then checks the cached 5-token step is bitwise stock with the fix."""
    from reap_swap.compat import moe_cache

    gen = torch.Generator().manual_seed(13)
    x, tw, ti = _routing(gen, 5, torch.arange(24), 1.0)
    aligned = _stock(fm, fmm, layer, x, tw, ti)  # stock: 5 * 8 * 4 > 128 -> aligned
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe_cache, "_UNITS", {})  # the unfixed rule over E + N = 160: naive
        naive = _cached(fm, fmm, layer, x, tw, ti)
    diff = (naive.float() - aligned.float()).abs().max().item()
    print(f"NAIVE_VS_ALIGNED equal={torch.equal(naive, aligned)} max_diff={diff:.3e}")
    fixed = _cached(fm, fmm, layer, x, tw, ti)
    assert torch.equal(fixed, aligned)


def test_unit_count_alone_changes_no_bit(fm, fmm, layer, stock_rule):
    """Isolates hypothesis 2 (research.md cachebug): the kernel over the E + N views with
    global_num_experts = E + N on the *original* ids (no slot read at all) must equal stock for
    every step size 1..64 (and 128, 256, 512)."""
    gen = torch.Generator().manual_seed(14)
    bad = []
    for m in (*range(1, 65), 128, 256, 512):
        x, tw, ti = _routing(gen, m, torch.arange(24), 2.0)
        if not torch.equal(_cached(fm, fmm, layer, x, tw, ti), _stock(fm, fmm, layer, x, tw, ti)):
            bad.append(m)
    print("UNIT_COUNT_MISMATCH_ROWS", bad)
    assert not bad, f"step sizes whose output changes with the unit count alone: {bad}"
