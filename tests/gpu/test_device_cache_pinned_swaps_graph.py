"""The pinned device cache (core+dlfu, the
`--reap-cache-slots swaps` split) under per-request swaps through the REAL data path on CUDA:
CudaEngine with a CacheConfig (pool split K + L*N, lent slot units), CudaResidency.apply
(apply_swap over VmmStore with the default PUBLISH_AHEAD, then device_cache_serving.on_swap ->
set_pinned), the fast Triton policy step + persistent copy kernel captured in a CUDA graph and
replayed with new routing; swaps every 3 replays, then a phase without swaps.

After every replay (synchronised) it checks, eagerly:
  * every remapped id the kernel would read holds the ORIGINAL expert's w13/w2 bytes
    (ext views [E+N] gathered at the graph's output ids == masters gathered at the router ids);
  * every occupied cache slot holds the bytes its slot_expert names;
  * the cache's pinned mask == the swap table's resident set, and no pinned expert sits in a slot;
  * no pool slot handle is mapped both by an expert unit (swap table) and a cache slot unit.
Fails on: a slot/table mismatch (persistent corruption), a stale remap, a missing on_swap, a
pool slot with two owners, or a stream race between set_pinned and the next replay.

Run on a GPU with the vLLM kit installed (results: research.md):
    PYTHONPATH=$PWD python -m pytest -q -s tests/gpu/test_device_cache_pinned_swaps_graph.py
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

E, H, INTER, TOPK, L = 16, 1024, 512, 2, 2
CORE = [0, 1, 2, 3]
SLICES = [[4 + 2 * i, 5 + 2 * i] for i in range(6)]
N = 3  # tail per layer
POOL = L * (len(CORE) + N + 4)  # core + tail + room for two 2-expert slices per layer
ROWS = 4


class _Kernel:
    def __init__(self):
        self.fused_experts = type("TritonExperts", (), {"_lora_context": None})()
        self.prepare_finalize = type("MoEPrepareAndFinalizeNoDPEPModular", (), {})()


class _Method:
    is_monolithic = False
    unquantized_backend = type("B", (), {"name": "TRITON"})()

    def __init__(self):
        self.moe_kernel = _Kernel()

    def process_weights_after_loading(self, layer):
        pass


_Method.__name__ = _Method.__qualname__ = "UnquantizedFusedMoEMethod"


def _build(monkeypatch):
    from reap_swap.engine.device_cache.api import DeviceCaches
    from reap_swap.engine.device_cache.lending import CacheConfig
    from reap_swap.engine.residency.cuda_backend import CudaResidency
    from reap_swap.engine.residency.engine import CudaEngine
    from reap_swap.engine.residency.refusals import LayerRefusals

    monkeypatch.setattr("reap_swap.compat.moe_cache.install_config_alias", lambda: "stand-in")
    unit = (2 * INTER * H + H * INTER) * 2
    plan = SimpleNamespace(
        layers={l: SimpleNamespace(core=CORE, num_experts=E) for l in range(L)},
        swappable_budget_bytes=POOL * unit,
        per_expert_bytes=unit,
    )
    cfg = CacheConfig(DeviceCaches(step="triton"), slots_per_layer=N, seed_core=False)
    cfg.slots_setting = N * L  # what server.resolve_cache_slots hands the workers for `swaps`
    engine = CudaEngine(plan, LayerRefusals(), cache=cfg)
    masters = {}
    gen = torch.Generator(device="cuda").manual_seed(7)
    for l in range(L):
        m = torch.nn.Module()
        m.layer_name, m.expert_map, m.global_num_experts = f"model.layers.{l}.mlp.experts", None, E
        m.activation, m.apply_router_weight_on_input, m.quant_method = "silu", False, _Method()
        for name, shape in (("w13_weight", (E, 2 * INTER, H)), ("w2_weight", (E, H, INTER))):
            w = (torch.randn(*shape, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
            m.register_parameter(name, torch.nn.Parameter(w, requires_grad=False))
        masters[l] = (m.w13_weight.detach().clone(), m.w2_weight.detach().clone())
        engine.hook_layer(m, l, quant_config={})
        m.quant_method.process_weights_after_loading(m)
    st = engine.state
    assert st.table.num_slots == POOL - L * N and cfg.lent_slots == {l: N for l in range(L)}
    return engine, CudaResidency(engine), cfg.caches, masters


def _check(st, caches, masters, l, ti, ids):
    cache = caches.layers[l].cache
    ext13, ext2 = caches.views[l]
    m13, m2 = masters[l]
    ids, ti = ids.long(), ti.long()
    assert torch.equal(ext13[ids], m13[ti]) and torch.equal(ext2[ids], m2[ti]), (
        "kernel would read wrong bytes"
    )
    for s, e in enumerate(cache.slot_expert.tolist()):
        if e >= 0:
            assert torch.equal(ext13[E + s], m13[e]) and torch.equal(ext2[E + s], m2[e]), (l, s, e)
    pinned = {int(e) for e in torch.nonzero(cache.pinned).flatten().tolist()}
    assert pinned == set(st.table.resident().get(l, ())), (l, pinned)
    assert not pinned & {e for e in cache.slot_expert.tolist() if e >= 0}
    rng = st.layers[l].rng
    own = [rng.backing[e] for e in range(E) if rng.backing[e] is not None]
    slots = rng.backing[E:]
    assert not any(any(h is o for o in own) for h in slots), "a pool slot is mapped as expert and cache slot"


def test_pinned_cache_with_swaps_under_graph_replays(monkeypatch):
    engine, backend, caches, masters = _build(monkeypatch)
    try:
        st = engine.state
        r = random.Random(0)
        static = {l: torch.zeros(ROWS, TOPK, dtype=torch.int32, device="cuda") for l in range(L)}
        outs = {}
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up: compiles the Triton kernels (a real step, consistent)
            for l in range(L):
                caches.layers[l](static[l], None)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for l in range(L):
                outs[l] = caches.layers[l](static[l], None)
        for t in range(600):
            if t < 400 and t % 3 == 0:
                target = {l: CORE + sum(r.sample(SLICES, r.randint(0, 2)), []) for l in range(L)}
                backend.apply(target)  # quiesce, remap, on_swap -> set_pinned (between replays)
            ti = {}
            for l in range(L):
                rows = [r.sample(range(E), TOPK) for _ in range(ROWS)]
                ti[l] = torch.tensor(rows, dtype=torch.int32, device="cuda")
                static[l].copy_(ti[l])
            g.replay()
            torch.cuda.synchronize()
            for l in range(L):
                _check(st, caches, masters, l, ti[l], outs[l])
        c = caches.read_counters()
        assert all(v["admitted"] > 0 and v["evicted"] > 0 for v in c.values()), c
    finally:
        engine.release()
