"""The device cache's whole per-layer policy step as ONE Triton program.

Why: the torch-op step (device_cache.DeviceCache.step + step_counts + remap_ids) is ~40 small
kernels; on the H200 it cost 174-184 us per layer-step replayed in a CUDA graph, 46-60 us
torch.compile'd -- with 48 MoE layers more than a whole decode step. This kernel does the same
integer arithmetic in one launch of one program (grid (1,)), fixed shapes, no host sync, so a CUDA
graph captures it: count the step's routed selections on the ORIGINAL ids (padding rows and ids
outside [0, E) not counted), the hit/miss counters against the contents at step start, the dlfu
score update (int64, 16 fractional bits, cache_policy.device), the victim choice with the same
total-order key as ``DeviceCache._choose`` (routed, score, already cached, lower id), the slot
placement of ``_place`` (k-th admitted expert by ascending id into the k-th free slot), the rebuilt
expert->slot map and remap table, ``copy_expert`` for the copy kernel, and the remapped ids.

Every state tensor it writes equals the torch step's, bit for bit (tests/test_device_cache_fused.py
under TRITON_INTERPRET=1 on the mini traces; research/gpu/bench_device_cache.py on CUDA counts
mismatching steps). Inside one program, values that must be gathered by a data-dependent index
(key ranks, the admitted order, the expert->slot inverse, the remap table) go through a per-cache
int64 scratch in global memory between ``tl.debug_barrier()`` calls (one CTA: the barrier orders
the writes of all its threads before the reads).

Limits: E <= 512 and N <= 512 (one block each; checked at construction).
"""

from __future__ import annotations

from typing import Any

import torch

from reap_swap.cache_policy.device import DECAY_SHIFT, SCORE_FRAC, SCORE_MAX

MAX_FUSED = 512
_kernel = None


def _build():  # noqa: C901 - one kernel body, split in phases by comments
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n_sel", "top_k"])
    def dlfu_step(
        ids_ptr, valid_ptr, out_ptr, n_sel, top_k,
        score_ptr, slot_expert_ptr, expert_slot_ptr, pinned_ptr, active_ptr,
        copy_ptr, table_ptr, counters_ptr, scratch_ptr,
        decay_num, id_bits,
        E: tl.constexpr, N: tl.constexpr, BE: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
        BJ: tl.constexpr, HAS_VALID: tl.constexpr, SIZE: tl.constexpr,
        FRAC: tl.constexpr, SHIFT: tl.constexpr, SMAX: tl.constexpr,
    ):  # fmt: skip
        e = tl.arange(0, BE)
        em = e < E
        # ---- step counts on the original ids -------------------------------------------------
        counts = tl.zeros([BE], dtype=tl.int64)
        for r0 in range(0, n_sel, BR):
            r = r0 + tl.arange(0, BR)
            rm = r < n_sel
            ids = tl.load(ids_ptr + r, mask=rm, other=-1).to(tl.int64)
            ok = rm & (ids >= 0) & (ids < E)
            if HAS_VALID:
                ok = ok & (tl.load(valid_ptr + r // top_k, mask=rm, other=0) != 0)
            hit2 = (e[:, None].to(tl.int64) == ids[None, :]) & ok[None, :]
            counts += tl.sum(hit2.to(tl.int64), axis=1)
        need = counts > 0
        es = tl.load(expert_slot_ptr + e, mask=em, other=-1)
        in_slot = es >= 0
        pinned = tl.load(pinned_ptr + e, mask=em, other=0) != 0
        resident = in_slot | pinned
        hit = need & resident
        active = tl.load(active_ptr)
        # ---- score update --------------------------------------------------------------------
        score = tl.load(score_ptr + e, mask=em, other=0)
        score = (score * decay_num) >> SHIFT
        score = tl.minimum(score + (counts << FRAC), SMAX)
        tl.store(score_ptr + e, score, mask=em)
        # ---- choose: forced + the best `free` of the rest -------------------------------------
        forced = in_slot & need
        free_n = active - tl.sum(forced.to(tl.int64), axis=0)
        rest = (in_slot | need) & (~forced) & (~pinned) & em
        key = (
            (need.to(tl.int64) << 61)
            | (score << (id_bits + 1))
            | (in_slot.to(tl.int64) << id_bits)
            | ((E - 1) - e).to(tl.int64)
        )
        key = tl.where(rest, key, -1)
        tl.store(scratch_ptr + e, key, mask=em)
        tl.debug_barrier()
        rank = tl.zeros([BE], dtype=tl.int64)
        for j0 in range(0, BE, BJ):
            j = j0 + tl.arange(0, BJ)
            kj = tl.load(scratch_ptr + j, mask=j < E, other=-1)
            rank += tl.sum((kj[None, :] > key[:, None]).to(tl.int64), axis=1)
        new_in = forced | (rest & (rank < free_n))
        evict = in_slot & (~new_in)
        admit = new_in & (~in_slot)
        # ---- place: k-th admitted (ascending id) into the k-th free slot ----------------------
        tl.debug_barrier()
        tl.store(scratch_ptr + e, new_in.to(tl.int64), mask=em)
        admit_rank = tl.cumsum(admit.to(tl.int64), axis=0) - 1
        tl.store(scratch_ptr + SIZE + admit_rank, e.to(tl.int64), mask=admit & em)
        tl.debug_barrier()
        s = tl.arange(0, BN)
        sm = s < N
        se = tl.load(slot_expert_ptr + s, mask=sm, other=-1)
        kept = tl.load(scratch_ptr + tl.maximum(se, 0), mask=sm & (se >= 0), other=1) != 0
        leaving = (se >= 0) & (~kept)
        free = sm & (s < active) & ((se < 0) | leaving)
        free_rank = tl.cumsum(free.to(tl.int64), axis=0) - 1
        n_admit = tl.sum(admit.to(tl.int64), axis=0)
        gets = free & (free_rank < n_admit)
        incoming = tl.load(scratch_ptr + SIZE + tl.maximum(free_rank, 0), mask=gets, other=-1)
        copy = tl.where(gets, incoming, -1)
        se_new = tl.where(gets, incoming, tl.where(free, -1, se))
        tl.store(slot_expert_ptr + s, se_new, mask=sm)
        tl.store(copy_ptr + s, copy, mask=sm)
        # ---- rebuild expert_slot and the table ------------------------------------------------
        tl.store(expert_slot_ptr + e, tl.full([BE], -1, tl.int64), mask=em)
        tl.debug_barrier()
        tl.store(expert_slot_ptr + tl.maximum(se_new, 0), s.to(tl.int64), mask=sm & (se_new >= 0))
        tl.debug_barrier()
        es_new = tl.load(expert_slot_ptr + e, mask=em, other=-1)
        table = tl.where(es_new >= 0, E + es_new, e.to(tl.int64))
        tl.store(table_ptr + e, table, mask=em)
        # ---- counters (device_cache.COUNTER_NAMES order) --------------------------------------
        bypassed = tl.sum((need & (~resident) & (~new_in)).to(tl.int64), axis=0)
        n_need = tl.sum(need.to(tl.int64), axis=0)
        wide = (n_need > tl.sum(pinned.to(tl.int64), axis=0) + active).to(tl.int64)
        c = tl.arange(0, 16)
        upd = tl.where(c == 0, 1, 0).to(tl.int64)
        upd += tl.where(c == 1, tl.sum(counts, axis=0), 0)
        upd += tl.where(c == 2, tl.sum(tl.where(hit, counts, 0), axis=0), 0)
        upd += tl.where(c == 3, n_need, 0)
        upd += tl.where(c == 4, tl.sum(hit.to(tl.int64), axis=0), 0)
        upd += tl.where(c == 5, n_admit, 0)
        upd += tl.where(c == 6, tl.sum(evict.to(tl.int64), axis=0), 0)
        upd += tl.where(c == 7, bypassed, 0)
        upd += tl.where(c == 8, wide, 0)
        cm = c < 9
        tl.store(counters_ptr + c, tl.load(counters_ptr + c, mask=cm, other=0) + upd, mask=cm)
        # ---- remap the ids the kernel reads ---------------------------------------------------
        tl.debug_barrier()
        for r0 in range(0, n_sel, BR):
            r = r0 + tl.arange(0, BR)
            rm = r < n_sel
            ids = tl.load(ids_ptr + r, mask=rm, other=-1)
            ok = rm & (ids >= 0) & (ids < E)
            mapped = tl.load(table_ptr + tl.where(ok, ids, 0), mask=ok, other=0)
            tl.store(out_ptr + r, tl.where(ok, mapped.to(ids.dtype), ids), mask=rm)

    return dlfu_step


def _pow2(n: int) -> int:
    return 1 << max(0, (max(n, 1) - 1).bit_length())


def scratch_for(cache: Any) -> torch.Tensor:
    """The cache's int64 scratch (allocated once, before any capture; state of no step)."""
    buf = getattr(cache, "_fused_scratch", None)
    if buf is None:
        if cache.num_experts > MAX_FUSED or cache.num_slots > MAX_FUSED:
            raise ValueError(
                f"fused step: {cache.num_experts} experts / {cache.num_slots} slots > {MAX_FUSED}"
            )
        size = max(cache.num_experts, cache.num_slots) + 1
        buf = torch.zeros(2 * size, dtype=torch.int64, device=cache.score.device)
        cache._fused_scratch = buf
    return buf


def fused_policy(cache: Any, topk_ids: torch.Tensor, valid_rows: torch.Tensor | None) -> torch.Tensor:
    """device_cache._policy in one launch: updates ``cache`` and returns the remapped ids."""
    global _kernel
    if _kernel is None:
        _kernel = _build()
    # counters: device_cache.COUNTER_NAMES, 9 of them, in that order (not imported: no cycle)
    ids = topk_ids.contiguous()
    out = torch.empty_like(ids)
    scratch = scratch_for(cache)
    e, n = cache.num_experts, cache.num_slots
    be, bn = _pow2(e), _pow2(max(n, 1))
    valid = valid_rows.to(torch.int8).contiguous() if valid_rows is not None else ids
    _kernel[(1,)](
        ids, valid, out, ids.numel(), max(1, ids.shape[-1] if ids.dim() > 1 else 1),
        cache.score, cache.slot_expert, cache.expert_slot, cache.pinned.view(torch.int8), cache.active,
        cache.copy_expert, cache.table, cache.counters, scratch,
        cache.decay_num, cache.id_bits,
        E=e, N=max(n, 1) if n else 0, BE=be, BN=bn, BR=max(16, 8192 // be), BJ=max(16, 4096 // be),
        HAS_VALID=valid_rows is not None, SIZE=scratch.shape[0] // 2,
        FRAC=SCORE_FRAC, SHIFT=DECAY_SHIFT, SMAX=SCORE_MAX, num_warps=8,
    )  # fmt: skip
    return out
