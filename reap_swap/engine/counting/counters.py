"""Per-layer routed-selection counters on fixed device buffers.

Why tensor ops only: under torch.compile the recording is traced into the graph, and under
CUDA graphs only kernels replay -- a Python side effect (a list append, a `.item()`) would run at
capture time and never again. So the buffers are allocated once, when the model is built, and
every update is an in-place `index_add_` / matmul into them; nothing reads them on the hot path.

Buffers (E = the layer's global expert count):
  counts  int64 [E]     routed selections (token, expert) since the last reset
  weights float32 [E]   routed gate weight summed over those selections
  coact   int64 [E, E]  optional: tokens on which both experts were routed (diagonal = counts);
                        costs E*E*8 bytes per layer, so it is off unless asked for
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from reap_swap.engine.counting.count_kernel import CountKernel

COUNTS = "reap_counts"
WEIGHTS = "reap_weights"
COACT = "reap_coact"


def register_counters(module: torch.nn.Module, num_experts: int, coactivation: bool) -> None:
    """Allocate the buffers on `module` (non-persistent: never part of a checkpoint)."""
    # layers are built under vLLM's default-device context (cuda:N on GPU, cpu on CPU): that is
    # where activations and topk_ids live, even if some weights are offloaded elsewhere
    device = torch.empty(0).device
    module.register_buffer(
        COUNTS, torch.zeros(num_experts, dtype=torch.int64, device=device), persistent=False
    )
    module.register_buffer(
        WEIGHTS, torch.zeros(num_experts, dtype=torch.float32, device=device), persistent=False
    )
    if coactivation:
        module.register_buffer(
            COACT, torch.zeros(num_experts, num_experts, dtype=torch.int64, device=device), persistent=False
        )
    else:
        setattr(module, COACT, None)


def record(
    module: torch.nn.Module,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    valid_rows: torch.Tensor | None = None,
    padding=None,
    kernel: CountKernel | None = None,
) -> None:
    """Add one batch of routing decisions. topk_ids/topk_weights: [tokens, top_k].

    Ids outside [0, E) (e.g. -1 for dropped selections) are not counted. Padded rows, e.g.
    CUDA-graph padding, are excluded when the caller knows them: `valid_rows` (bool [tokens]) or
    `padding` (compat.moe.padding_source's answer). On CUDA, without co-activation, the process's
    fused Triton `kernel` (count_kernel.py, owned by the worker runtime) does the whole update
    when given and usable; otherwise the torch ops below.
    """
    if topk_ids.is_cuda and kernel is not None and valid_rows is None and getattr(module, COACT) is None:
        if kernel.available(topk_ids.device):
            kernel.launch(getattr(module, COUNTS), getattr(module, WEIGHTS), topk_ids, topk_weights, padding)
            return
    if padding is not None and valid_rows is None:
        valid_rows = rows_from_padding(padding)
    record_torch(module, topk_ids, topk_weights, valid_rows)


def rows_from_padding(source):
    """compat.moe.padding_source's answer -> bool mask of the real rows (None stays None)."""
    if source is None:
        return None
    kind, tensor = source
    return ~tensor if kind == "is_padding" else tensor >= 0


def record_torch(
    module: torch.nn.Module,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    valid_rows: torch.Tensor | None = None,
) -> None:
    """The reference path (any device): plain tensor ops into the same buffers."""
    counts: torch.Tensor = getattr(module, COUNTS)
    weights: torch.Tensor = getattr(module, WEIGHTS)
    coact: torch.Tensor | None = getattr(module, COACT)
    num_experts = counts.shape[0]
    ids = topk_ids.to(torch.int64)
    ok = (ids >= 0) & (ids < num_experts)
    if valid_rows is not None:
        ok = ok & valid_rows.reshape(-1, 1).to(torch.bool)
    safe = torch.where(ok, ids, torch.zeros_like(ids)).reshape(-1)
    okf = ok.reshape(-1)
    counts.index_add_(0, safe, okf.to(torch.int64))
    weights.index_add_(0, safe, topk_weights.reshape(-1).to(torch.float32) * okf.to(torch.float32))
    if coact is not None:
        # one-hot rows (top-k ids of a token are distinct), float matmul: integer matmul is not
        # implemented on CUDA; exact while a single batch has fewer than 2**24 tokens
        onehot = torch.zeros(ids.shape[0], num_experts, dtype=torch.float32, device=ids.device)
        onehot.scatter_add_(1, torch.where(ok, ids, torch.zeros_like(ids)), ok.to(torch.float32))
        coact.add_((onehot.t() @ onehot).round().to(torch.int64))


def read(module: torch.nn.Module, reset: bool) -> dict:
    """Host copies {"counts": [...], "weights": [...], ("coact": [[...]])}; optionally zero them.

    Called between engine steps (collective_rpc runs on the engine-core thread), so no forward
    pass races with the read-and-reset.
    """
    out = {"counts": getattr(module, COUNTS).tolist(), "weights": getattr(module, WEIGHTS).tolist()}
    coact = getattr(module, COACT)
    if coact is not None:
        out["coact"] = coact.tolist()
    if reset:
        zero(module)
    return out


def zero(module: torch.nn.Module) -> None:
    getattr(module, COUNTS).zero_()
    getattr(module, WEIGHTS).zero_()
    coact = getattr(module, COACT)
    if coact is not None:
        coact.zero_()
