"""One request's routing steps from the router hook's calls, forward by forward (pure, numpy).

The CPU recorder (research/sim/record_cpu_served_trace.py) binds vLLM's router capture hook
(reap_swap/compat/routing_capture.py) and runs one request at a time with prefix caching off, so
every forward of the engine belongs to that request: the prompt in one forward (the prefill), then
one forward per fed-back token. The hook is called once per MoE layer per forward, in layer order,
with [tokens of the forward, top_k]. This module checks exactly that and returns the steps in
reap_swap/cache/trace.py's shape ([tokens, layers, top_k] each), refusing anything else by name: a
chunked prefill, a layer missing or out of order, a forward whose layers saw different token
counts, a total that is not prompt + completion - 1 (the last sampled token is never fed back,
as in vLLM's own ``routed_experts``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from reap_swap.cache.trace import TraceError


def forwards_of_calls(calls: Sequence[tuple[int, np.ndarray]], layers: Sequence[int], where: str) -> list:
    """[(layer_id, ids [n, k])] in call order -> one array [n, layers, k] per forward."""
    nl = len(layers)
    if len(calls) % nl:
        raise TraceError(f"{where}: {len(calls)} router calls, not a multiple of {nl} MoE layers")
    out = []
    for f in range(len(calls) // nl):
        group = calls[f * nl : (f + 1) * nl]
        got = [int(layer) for layer, _ in group]
        if got != [int(x) for x in layers]:
            raise TraceError(f"{where}: forward {f} routed layers {got}, expected {list(layers)}")
        sizes = {np.asarray(ids).shape for _, ids in group}
        if len(sizes) != 1:
            raise TraceError(f"{where}: forward {f} layers saw different shapes {sorted(sizes)}")
        out.append(np.stack([np.asarray(ids) for _, ids in group], axis=1))
    return out


def request_steps_from_calls(
    calls: Sequence[tuple[int, np.ndarray]],
    layers: Sequence[int],
    top_k: int,
    prompt_tokens: int,
    completion_tokens: int,
    where: str,
) -> list[np.ndarray]:
    """The request's steps (prefill, then one per decode forward), after every check above."""
    fwd = forwards_of_calls(calls, layers, where)
    if not fwd:
        raise TraceError(f"{where}: no forward was routed")
    if fwd[0].shape[2] != top_k:
        raise TraceError(f"{where}: top_k {fwd[0].shape[2]}, expected {top_k}")
    sizes = [len(x) for x in fwd]
    if sizes[0] != prompt_tokens:
        raise TraceError(f"{where}: first forward routed {sizes[0]} tokens, prompt has {prompt_tokens} "
                         "(chunked prefill? raise max_num_batched_tokens)")  # fmt: skip
    if any(n != 1 for n in sizes[1:]):
        raise TraceError(f"{where}: decode forwards routed {sorted(set(sizes[1:]))} tokens, expected 1 each")
    want = prompt_tokens + completion_tokens - 1
    if sum(sizes) != want:
        raise TraceError(f"{where}: {sum(sizes)} routed tokens, prompt {prompt_tokens} + completion "
                         f"{completion_tokens} - 1 = {want}")  # fmt: skip
    return fwd
