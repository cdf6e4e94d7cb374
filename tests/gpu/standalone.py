"""Shared set-up of the GPU tests (imported by them; no tests here)."""


def standalone_bf16_layer(seed: int, experts: int, hidden: int, inter: int):
    """One random bf16 MoE layer ([E, 2I, H] / [E, H, I], scaled 0.02) re-homed into a standalone
    engine state with a slot per expert: yields (state, (w13, w2), the layer's views), then frees
    the range and the pool. Use it inside a module-scoped fixture with `yield from`."""
    import torch

    from reap_swap.residency.engine import standalone_state

    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    st, views = standalone_state({0: (w13, w2)}, num_slots=experts)
    yield st, (w13, w2), views[0]
    st.layers[0].rng.release()
    st.pool.release()
