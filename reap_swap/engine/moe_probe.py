"""Bitwise MoE-layer outputs: every sparse-MoE block fed the same seeded input, its output hashed.

Why: greedy text can differ between two servers for reasons outside the experts (stock vLLM's
own offload flags change the text under TP=2 on a random model whose logits are near-tied).
Whether reap-swap computes the *same MoE layers* as stock vLLM with every expert in HBM is then
answered layer by layer: equal digests = bitwise-equal outputs, wherever the weights live.

`MoeProbeExtension` is a worker mixin with no other effect, so a *stock* server can load it
(`vllm serve --worker-extension-cls reap_swap.engine.moe_probe.MoeProbeExtension`, with
VLLM_SERVER_DEV_MODE=1 for POST /collective_rpc); reap-swap's worker extension inherits it.
This module must not import reap_swap.engine.worker (whose import changes how the model is built).

On a reap-swap server the probe's routed selections land in the router counters like any
forward pass's; open a new request (reset) after probing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from reap_swap import compat
from reap_swap.engine.probe_compare import compare_probes  # noqa: F401 (re-exported: callers import it here)

DEFAULT_TOKENS = (1, 8, 64, 256)


def digest(t: torch.Tensor) -> str:
    """sha256 (16 hex) of a tensor's dtype, shape and raw bytes: equal iff bitwise equal."""
    raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    head = f"{t.dtype}:{tuple(t.shape)}:".encode()
    return hashlib.sha256(head + raw).hexdigest()[:16]


def probe_input(tokens: int, hidden: int, seed: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The same activations on every rank and every machine: drawn on the CPU from `seed`."""
    g = torch.Generator(device="cpu").manual_seed(int(seed) * 1_000_003 + int(tokens))
    return torch.randn(tokens, hidden, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)


def moe_blocks(model: torch.nn.Module, moe_layer_names: Sequence[str]) -> list[tuple[str, torch.nn.Module]]:
    """(experts layer name, its parent block) in registration order: 'model.layers.3.mlp.experts'
    -> the module at 'model.layers.3.mlp', whose forward is gate + experts + TP all-reduce."""
    out = []
    for name in moe_layer_names:
        parent = name.rsplit(".", 1)[0]
        try:
            block = model.get_submodule(parent)
        except AttributeError as exc:
            raise RuntimeError(f"MoE layer {name!r} has no parent block {parent!r} in this model") from exc
        if not hasattr(block, "experts"):
            raise RuntimeError(f"{parent!r} ({type(block).__name__}) has no .experts: not a sparse-MoE block")
        out.append((name, block))
    return out


def run_probe(
    model: torch.nn.Module, vllm_config: Any, tokens: Sequence[int] = DEFAULT_TOKENS, seed: int = 0
) -> dict:
    """{"layers": {name: {"<tokens>": digest}}, "inputs": {"<tokens>": digest}, ...}.

    One forward context per input size, blocks called once each in registration order (vLLM may
    resolve the MoE op's layer by call order within a context)."""
    names = compat.moe_layer_names(vllm_config)
    blocks = moe_blocks(model, names)
    if not blocks:
        raise RuntimeError("this model has no registered MoE layers")
    device = _activation_device(model)
    hidden = int(vllm_config.model_config.get_hidden_size())
    dtype = vllm_config.model_config.dtype
    layers: dict[str, dict[str, str]] = {name: {} for name, _ in blocks}
    inputs, absmax = {}, {}
    with torch.inference_mode():
        for n in tokens:
            x = probe_input(int(n), hidden, seed, dtype, device)
            inputs[str(n)] = digest(x)
            with compat.standalone_forward_context(vllm_config):
                for name, block in blocks:
                    y = block(x.clone())
                    layers[name][str(n)] = digest(y)
                    absmax.setdefault(name, {})[str(n)] = float(y.float().abs().max())
    return {
        "seed": int(seed),
        "tokens": [int(n) for n in tokens],
        "dtype": str(dtype),
        "device": str(device),
        "inputs": inputs,
        "layers": layers,
        "absmax": absmax,
    }


def _activation_device(model: torch.nn.Module) -> torch.device:
    """Where activations live: the first parameter not on the CPU (the CPU on vLLM's CPU build;
    offloaded weights are CPU tensors only under some offload backends, never all of them)."""
    for p in model.parameters():
        if p.device.type != "cpu":
            return p.device
    return torch.device("cpu")


class MoeProbeExtension:
    """Worker RPC `reap_moe_probe`: this rank's MoE-block output digests (see module docstring)."""

    def reap_moe_probe(self, tokens: Sequence[int] | None = None, seed: int = 0) -> dict:
        sizes = [int(n) for n in (tokens or DEFAULT_TOKENS)]
        ranks = compat.parallel_ranks(self.vllm_config)
        try:
            result = run_probe(self.get_model(), self.vllm_config, sizes, int(seed))
        except Exception as exc:  # noqa: BLE001 - answered, not raised, on every rank (see worker.py)
            return {**ranks, "error": f"{type(exc).__name__}: {exc}"}
        return {**ranks, **result}
