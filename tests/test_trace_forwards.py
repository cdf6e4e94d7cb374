"""reap_swap/cache/trace_forwards.py: the CPU recorder's per-forward router calls -> a request's steps."""

from __future__ import annotations

import numpy as np
import pytest

from reap_swap.cache.trace import TraceError, from_requests, steps_of_sequence
from reap_swap.cache.trace_forwards import forwards_of_calls, request_steps_from_calls

LAYERS, K = [0, 1, 2], 2


def calls_for(sizes, seed=0):
    """Router calls as vLLM's hook makes them: per forward, layer 0..L-1, [n, K] each."""
    rng = np.random.default_rng(seed)
    fwd = [rng.integers(0, 16, size=(n, len(LAYERS), K)) for n in sizes]
    calls = [(layer, f[:, j]) for f in fwd for j, layer in enumerate(LAYERS)]
    return calls, fwd


def test_prefill_then_decodes_match_the_served_layout():
    calls, fwd = calls_for([5, 1, 1, 1])
    steps = request_steps_from_calls(calls, LAYERS, K, prompt_tokens=5, completion_tokens=4, where="r0")
    assert [len(s) for s in steps] == [5, 1, 1, 1]
    for got, want in zip(steps, fwd):
        np.testing.assert_array_equal(got, want)
    # the same steps vLLM's routed_experts ([P + C - 1, L, K]) gives through steps_of_sequence
    served = steps_of_sequence(np.concatenate(fwd), 5)
    for a, b in zip(steps, served):
        np.testing.assert_array_equal(a, b)
    t = from_requests([steps], layers=LAYERS, model="m", num_experts=16, top_k=K, per_expert_bytes=1)
    assert t.num_steps == 4 and t.num_tokens == 8


@pytest.mark.parametrize(
    "sizes,p,c,match",
    [
        ([3, 2, 1], 5, 2, "first forward routed 3 tokens"),  # chunked prefill
        ([5, 2], 5, 3, "decode forwards routed"),
        ([5, 1], 5, 3, "prompt 5 \\+ completion 3 - 1 = 7"),
    ],
)
def test_refusals_name_the_request(sizes, p, c, match):
    calls, _ = calls_for(sizes)
    with pytest.raises(TraceError, match=match):
        request_steps_from_calls(calls, LAYERS, K, p, c, where="heldout request 7")


def test_layer_order_and_count_checked():
    calls, _ = calls_for([4, 1])
    with pytest.raises(TraceError, match="not a multiple of 3"):
        forwards_of_calls(calls[:-1], LAYERS, "r")
    swapped = [calls[1], calls[0], *calls[2:]]
    with pytest.raises(TraceError, match="forward 0 routed layers \\[1, 0, 2\\]"):
        forwards_of_calls(swapped, LAYERS, "r")
    bad = [(calls[0][0], calls[0][1][:2]), *calls[1:]]
    with pytest.raises(TraceError, match="different shapes"):
        forwards_of_calls(bad, LAYERS, "r")
    with pytest.raises(TraceError, match="no forward"):
        request_steps_from_calls([], LAYERS, K, 1, 1, "r")
