"""The device cache's per-layer policy step, vectorised: one Triton program
whose phases are whole-block vector operations, with no global-memory round trip between phases
at decode sizes and no work proportional to E in the choice unless the step needs it.

Same specification and result as the torch step
(device_cache.DeviceCache.step + step_counts + remap_ids): every state tensor and the remapped ids
equal bit for bit (tests/test_device_cache_fast.py under TRITON_INTERPRET=1; on CUDA
research/gpu/bench_device_cache.py counts mismatching steps). What differs is how:

- **Counting**: at decode sizes (BE x pow2(selections) <= ONEHOT_MAX) one one-hot compare matrix
  [BE, BR] in registers gives the counts (a row sum) and, later, the remapped ids (a column sum of
  the same matrix times the table): no gather through memory. Wider steps (prefill, 256 rows)
  count by ``tl.histogram`` over chunks (invalid selections land in bin 0 and are subtracted) and
  remap by a gather from the stored table.
- **Choice**: the ranking key is the torch step's total order (routed, score, cached, lower id).
  With ``rest`` the candidates (cached-unneeded and missed, not pinned) and ``k = max(free, 0)``
  slots for them, ``d = |rest| - k`` must go. ``d <= 0`` (the common case: nothing missed, or
  the misses fit the free slots) needs no ranking at all. Otherwise ``min(d, k)`` argmax/argmin
  rounds (one vector reduction each) pick the kept/dropped ones -- bounded by the misses, not E;
  only when that exceeds ``ROUNDS`` (a wide read-through step) does the all-pairs rank of the old
  kernel run (key through the scratch).
- **Placement**: skipped when nothing is admitted or evicted (slot table, expert->slot map and
  remap table unchanged; ``copy_expert`` all -1). Otherwise, for BN x BE <= MATRIX_MAX, the
  gathers of the old kernel (new_in[slot_expert], the k-th admitted expert, the inverse map) are
  compare matrices [BN, BE] reduced in registers; larger caches use the scratch as before.
- int32 wherever the values fit (ids, slots, counts); int64 only for the score and the key.

The launcher passes ``valid_rows`` (bool) as is: no cast kernel. Nothing reads back to the host.
Limits: E <= 512 and N <= 512 (one block each; checked when the scratch is allocated).
"""

from __future__ import annotations

from typing import Any

import torch

from reap_swap.cache.device import DECAY_SHIFT, SCORE_FRAC, SCORE_MAX

ONEHOT_MAX = 16384  # BE x BR elements of the counting matrix kept in registers
MATRIX_MAX = 32768  # BN x BE elements of a placement matrix kept in registers
ROUNDS = 8  # selection rounds before the all-pairs rank
HIST_BR = 1024  # selections per chunk on the histogram path
HIST_MIN_BINS = 32  # below: the chunked compare matrix instead of tl.histogram
NUM_WARPS = 4
MAX_UNITS = 512  # E and N each fit one block of the program
_kernel = None


def fits(num_experts: int, num_slots: int) -> bool:
    """Whether this kernel serves a cache of this size (else the torch step does)."""
    return num_experts <= MAX_UNITS and num_slots <= MAX_UNITS


def _pow2(n: int) -> int:
    return 1 << max(0, (max(n, 1) - 1).bit_length())


def scratch_for(cache: Any) -> torch.Tensor:
    """The cache's int64 scratch (allocated once, before any capture; state of no step)."""
    buf = getattr(cache, "_step_scratch", None)
    if buf is None:
        if not fits(cache.num_experts, cache.num_slots):
            raise ValueError(
                f"Triton step: {cache.num_experts} experts / {cache.num_slots} slots > {MAX_UNITS}"
            )
        size = max(cache.num_experts, cache.num_slots) + 1
        buf = torch.zeros(2 * size, dtype=torch.int64, device=cache.score.device)
        cache._step_scratch = buf
    return buf


def _build():
    from reap_swap.engine.device_cache.fast_kernel import dlfu_step_fast

    return dlfu_step_fast


def variant(num_experts: int, num_slots: int, n_sel: int) -> dict[str, int | bool]:
    """The kernel's compile-time parameters for a step of ``n_sel`` selections: each distinct value
    is one Triton compilation (n_sel, top_k and the slot count itself are run-time values)."""
    be, bn = _pow2(num_experts), _pow2(max(num_slots, 1))
    br_all = max(16, _pow2(n_sel))
    onehot = be * br_all <= ONEHOT_MAX
    hist = be >= HIST_MIN_BINS
    return {
        "E": num_experts, "BE": be, "BN": bn,
        "BR": br_all if onehot else HIST_BR if hist else max(16, 8192 // be), "BJ": max(16, 4096 // be),
        "ONEHOT": onehot, "HIST": hist, "MATRIX": bn * be <= MATRIX_MAX,
    }  # fmt: skip


def warm_sizes(num_experts: int, num_slots: int) -> list[int]:
    """One step size (selections) per distinct variant a step can meet: the one-hot sizes double up
    to ONEHOT_MAX, and every wider step shares the one variant beyond it."""
    seen, sizes, n_sel = set(), [], 1
    while True:
        v = variant(num_experts, num_slots, n_sel)
        key = tuple(v.items())
        if key not in seen:
            seen.add(key)
            sizes.append(n_sel)
        if not v["ONEHOT"]:
            return sizes
        n_sel *= 2


def warm(cache: Any, dtype: torch.dtype = torch.int32) -> int:
    """Compile every variant serving can meet before the first request, on a throwaway state of the
    same shape (the layer's own state is not touched): vLLM's warm-up runs only its capture sizes
    and one profile step, so a prefill of another size compiled the kernel mid-request (a
    first-request latency spike). Both forms of ``valid_rows`` (given under CUDA graphs' padding,
    absent otherwise). Returns the launches made (compilations are cached per variant)."""
    scratch = type(cache)(cache.num_experts, cache.num_slots, cache.score.device)
    n = 0
    for n_sel in warm_sizes(cache.num_experts, cache.num_slots):
        # top_k is a run-time argument: one selection per row reaches the same variants
        ids = torch.zeros((n_sel, 1), dtype=dtype, device=cache.score.device)
        for valid in (None, torch.ones(n_sel, dtype=torch.bool, device=ids.device)):
            fast_policy(scratch, ids, valid)
            n += 1
    return n


def fast_policy(cache: Any, topk_ids: torch.Tensor, valid_rows: torch.Tensor | None) -> torch.Tensor:
    """device_cache._policy in one launch (this module's docstring): updates ``cache`` and returns
    the remapped ids."""
    global _kernel
    if _kernel is None:
        _kernel = _build()
    ids = topk_ids.contiguous()
    out = torch.empty_like(ids)
    scratch = scratch_for(cache)  # also refuses E or N over 512
    valid = valid_rows.contiguous() if valid_rows is not None else ids
    _kernel[(1,)](
        ids, valid, out, ids.numel(), max(1, ids.shape[-1] if ids.dim() > 1 else 1),
        cache.score, cache.slot_expert, cache.expert_slot, cache.pinned.view(torch.int8), cache.active,
        cache.copy_expert, cache.table, cache.counters, scratch,
        cache.decay_num, cache.id_bits, cache.num_slots,
        **variant(cache.num_experts, cache.num_slots, ids.numel()), HAS_VALID=valid_rows is not None,
        SIZE=scratch.shape[0] // 2, ROUNDS=ROUNDS,
        FRAC=SCORE_FRAC, SHIFT=DECAY_SHIFT, SMAX=SCORE_MAX, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
