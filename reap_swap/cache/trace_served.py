"""A routing trace (reap_swap/cache/trace.py) from what a vLLM server routed, request by request.

Pure (numpy, base64). vLLM 0.26.0 on CUDA, started with ``--enable-return-routed-experts``,
returns in every non-streamed chat/completion choice ``routed_experts``: a base64 ``.npy`` of
shape [prompt + completion - 1, layers, top_k] (uint8/uint16; the last sampled token is never
fed back), the experts its own router chose for every token of the sequence
(vllm/entrypoints/openai/chat_completion/protocol.py, 0.26.0). That is the serving engine's
routing (bf16, its fused top-k, CUDA graphs), not transformers' re-run of the checkpoint that
``reap-swap observe --trace`` records (reap_swap/engine/trace_recorder.py); research/gpu/gpu_skew_trace.py
sends the requests one at a time with prefix caching off, so every prompt token is routed in
its own request, as in the bench's greedy phase.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from reap_swap.cache.trace import Trace, TraceError, from_requests, steps_of_sequence


def decode_routed(b64: str | None) -> np.ndarray:
    """A choice's ``routed_experts`` (base64 .npy) -> [tokens, layers, top_k]; TraceError when absent."""
    if not b64:
        raise TraceError(
            "routed_experts: missing from the response (is the server started with "
            "--enable-return-routed-experts, and the request not streamed?)"
        )
    arr = np.load(io.BytesIO(base64.b64decode(b64)), allow_pickle=False)
    if arr.ndim != 3:
        raise TraceError(f"routed_experts: shape {arr.shape}, expected [tokens, layers, top_k]")
    return arr


def request_steps(routed: np.ndarray, prompt_tokens: int, completion_tokens: int, where: str) -> list:
    """One request's steps, after checking the routed length against the usage vLLM reported."""
    want = prompt_tokens + completion_tokens - 1
    if len(routed) != want:
        raise TraceError(
            f"{where}: routed_experts has {len(routed)} tokens, usage says {prompt_tokens} prompt + "
            f"{completion_tokens} completion - 1 = {want}"
        )
    return steps_of_sequence(routed, prompt_tokens)


def trace_from_served(
    records: Sequence[Mapping[str, Any]],
    *,
    moe_layers: Sequence[int],
    model: str,
    num_experts: int,
    top_k: int,
    per_expert_bytes: int,
    source: Mapping[str, Any] | None = None,
) -> Trace:
    """``records``: per request, in the order they ran, {"tag", "routed_experts" (base64),
    "prompt_tokens", "completion_tokens"}. Layers: vLLM lists the MoE layers in model order,
    which are ``moe_layers``; a layer-count or top_k mismatch is refused, naming the request."""
    requests, tags = [], []
    for i, rec in enumerate(records):
        where = f"request {i} ({rec.get('tag') or 'untagged'})"
        routed = decode_routed(rec.get("routed_experts"))
        if routed.shape[1:] != (len(moe_layers), top_k):
            raise TraceError(
                f"{where}: routed_experts shape {routed.shape}, expected [tokens, {len(moe_layers)} "
                f"MoE layers, top_k {top_k}]"
            )
        requests.append(
            request_steps(routed, int(rec["prompt_tokens"]), int(rec["completion_tokens"]), where)
        )
        tags.append(str(rec.get("tag") or ""))
    return from_requests(
        requests,
        layers=moe_layers,
        model=model,
        num_experts=num_experts,
        top_k=top_k,
        per_expert_bytes=per_expert_bytes,
        request_tags=tags,
        source=dict(source or {}),
    )
