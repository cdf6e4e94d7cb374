"""One fused Triton kernel per MoE layer for the routed-selection counters (CUDA only).

Why: counters.record in plain torch ops is about ten tiny kernels per layer (casts, masks,
where, two index_add_). Inside a decode CUDA graph each costs a microsecond or two, so on a
12-layer model they would add ~0.2 ms to a ~1.5 ms token -- more than the 3 % the issue allows
when every expert is resident. This kernel reads topk_ids, topk_weights and the step's padding
buffer (is_padding or the slot mapping, see compat.moe.padding_source) and atomically adds into the
same fixed `counts` / `weights` buffers: one launch per layer, graph-safe (no allocation, no
host sync). Weight sums are float atomics, so their last bits may depend on the order the
selections land in; counts are exact.

`CountKernel.available()` self-tests the kernel against the torch path once per process, outside graph
capture, and says no (with the reason logged) if Triton is missing or disagrees: the caller
then keeps the torch path. Never silently wrong. One CountKernel per worker process, owned
by the worker runtime (reap_swap.engine.runtime) and handed to each counting layer.
"""

from __future__ import annotations

import torch

from reap_swap import get_logger

log = get_logger("reap_swap.counters")

MASK_NONE, MASK_IS_PADDING, MASK_SLOT_MAPPING = 0, 1, 2
BLOCK = 1024


def _build():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n_sel", "top_k", "num_experts"])
    def count_selections(
        ids_ptr,
        w_ptr,
        pad_ptr,
        counts_ptr,
        weights_ptr,
        n_sel,
        top_k,
        num_experts,
        MASK_MODE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inb = offs < n_sel
        ids = tl.load(ids_ptr + offs, mask=inb, other=-1).to(tl.int64)
        w = tl.load(w_ptr + offs, mask=inb, other=0.0).to(tl.float32)
        ok = inb & (ids >= 0) & (ids < num_experts)
        if MASK_MODE == 1:  # is_padding (uint8 view of bool): real rows are 0
            pad = tl.load(pad_ptr + offs // top_k, mask=inb, other=1)
            ok = ok & (pad == 0)
        if MASK_MODE == 2:  # slot mapping: real rows are >= 0
            slot = tl.load(pad_ptr + offs // top_k, mask=inb, other=-1)
            ok = ok & (slot >= 0)
        safe = tl.where(ok, ids, 0)
        tl.atomic_add(counts_ptr + safe, tl.full([BLOCK], 1, tl.int64), mask=ok)
        tl.atomic_add(weights_ptr + safe, w, mask=ok)

    return count_selections


class CountKernel:
    """The fused counter kernel of one process: compiled and self-tested once, on first use."""

    def __init__(self) -> None:
        self._kernel = None
        self._checked = False
        self._ok = False
        self._reason = "not checked yet"

    def launch(
        self,
        counts: torch.Tensor,
        weights: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        padding=None,
    ) -> None:
        """Add one batch of routing decisions (see counters.record); `padding` from
        compat.moe.padding_source."""
        ids = topk_ids.reshape(-1)
        w = topk_weights.reshape(-1)
        n_sel = ids.numel()
        if n_sel == 0:
            return
        top_k = topk_ids.shape[-1] if topk_ids.dim() > 1 else 1
        mode, pad = MASK_NONE, ids  # pad_ptr is never read without a mask mode
        if padding is not None:
            kind, tensor = padding
            if kind == "is_padding":
                mode, pad = (
                    MASK_IS_PADDING,
                    tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor,
                )
            else:
                mode, pad = MASK_SLOT_MAPPING, tensor
        grid = (-(-n_sel // BLOCK),)
        self._kernel[grid](
            ids, w, pad, counts, weights, n_sel, top_k, counts.shape[0], MASK_MODE=mode, BLOCK=BLOCK
        )

    def available(self, device: torch.device) -> bool:
        """Is the fused kernel usable (and equal to the torch path) on this device? Checked once."""
        if self._checked:
            return self._ok
        if torch.cuda.is_current_stream_capturing():
            return False  # never compile or self-test inside a capture; the torch path counts meanwhile
        self._checked = True
        try:
            self._kernel = _build()
            self._ok = _self_test(self, device)
            self._reason = (
                "fused Triton counter kernel" if self._ok else "self-test disagreed with the torch path"
            )
        except Exception as exc:  # noqa: BLE001 - any failure keeps the torch path
            self._ok = False
            self._reason = f"{type(exc).__name__}: {exc}"
        if self._ok:
            log.info("reap-swap: routed-selection counters use one fused Triton kernel per layer")
        else:
            log.error(
                "reap-swap: fused counter kernel unavailable (%s); counting with torch ops "
                "(exact, a few microseconds slower per layer)",
                self._reason,
            )
        return self._ok

    def status(self) -> dict:
        return {"checked": self._checked, "ok": self._ok, "reason": self._reason}


def _self_test(kernel: CountKernel, device: torch.device) -> bool:
    from reap_swap.engine.counting import counters

    gen = torch.Generator(device="cpu").manual_seed(0)
    rows, k, experts = 37, 8, 128
    ids = torch.randint(-1, experts, (rows, k), generator=gen).to(device=device, dtype=torch.int32)
    w = torch.rand(rows, k, generator=gen).to(device)
    pad = torch.zeros(rows, dtype=torch.bool, device=device)
    pad[-5:] = True
    slots = torch.arange(rows, device=device, dtype=torch.int64)
    slots[-3:] = -1
    for source in (None, ("is_padding", pad), ("slot_mapping", slots)):
        got_c = torch.zeros(experts, dtype=torch.int64, device=device)
        got_w = torch.zeros(experts, dtype=torch.float32, device=device)
        kernel.launch(got_c, got_w, ids, w, source)
        ref = torch.nn.Module()
        counters.register_counters(ref, experts, coactivation=False)
        ref.to(device)
        counters.record_torch(ref, ids, w, valid_rows=counters.rows_from_padding(source))
        if not torch.equal(got_c, getattr(ref, counters.COUNTS)):
            return False
        if not torch.allclose(got_w, getattr(ref, counters.WEIGHTS), rtol=1e-5, atol=1e-5):
            return False
    return True
