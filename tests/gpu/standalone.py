"""Shared set-up of the GPU tests (imported by them; no tests here)."""


def standalone_bf16_layer(seed: int, experts: int, hidden: int, inter: int):
    """One random bf16 MoE layer ([E, 2I, H] / [E, H, I], scaled 0.02) re-homed into a standalone
    engine state with a slot per expert: yields (state, (w13, w2), the layer's views), then frees
    the range and the pool. Use it inside a module-scoped fixture with `yield from`."""
    import torch

    from reap_swap.engine.residency.state import standalone_state

    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    st, views = standalone_state({0: (w13, w2)}, num_slots=experts)
    yield st, (w13, w2), views[0]
    st.layers[0].rng.release()
    st.pool.release()


def skewed_routing(gen, rows: int, experts: int, hidden: int, top_k: int):
    """Random tokens routed with a skew toward low ids (so a small cache both hits and evicts):
    bf16 activations, float32 weights and int32 ids on the GPU, as vLLM's router hands them over."""
    import torch

    logits = torch.randn(rows, experts, generator=gen) + torch.linspace(2, 0, experts)
    tw, ti = torch.topk(torch.softmax(logits, -1), top_k)
    x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
    return x.cuda(), tw.float().cuda(), ti.to(torch.int32).cuda()


def replay_against_stock(step, routing, warm, cached, stock, label: str, replays: int = 60) -> None:
    """Capture one cached MoE step (its policy step included) in a CUDA graph, restore the cache
    state the capture advanced, then replay it on `replays` fresh routings: every replay must equal
    the stock kernel bitwise, and the cache must have admitted past its slots and evicted.
    `routing()` -> (x, tw, ti); `warm`, `cached`, `stock` take (x, tw, ti, valid); `warm` compiles
    the kernels outside capture."""
    import torch

    x, tw, ti = routing()
    valid = torch.ones(x.shape[0], dtype=torch.bool, device="cuda")
    warm(x, tw, ti, valid)
    cache = step.cache
    empty = torch.full((cache.num_slots,), -1, dtype=torch.int64, device="cuda")
    step.copy_fn(step.units, empty, cache.num_experts)
    saved = [t.clone() for t in cache.state_tensors()]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = cached(x, tw, ti, valid)
    for t, v in zip(cache.state_tensors(), saved, strict=True):
        t.copy_(v)
    for i in range(replays):
        for dst, src in zip((x, tw, ti), routing(), strict=True):
            dst.copy_(src)
        g.replay()
        assert torch.equal(out, stock(x, tw, ti, valid)), f"{label}replay {i}"
    r = cache.read_counters()
    assert r["steps"] == replays and r["admitted"] > cache.num_slots and r["evicted"] > 0, r
