"""The Triton kernel of device_cache_fast.py (imported on first use: triton is imported here at
module level, so that the jit helpers resolve as module globals, compiled or under
TRITON_INTERPRET=1; the design and the equality argument are in device_cache_fast.py)."""

# ruff: noqa: E501 - kernel signatures
import triton
import triton.language as tl


@triton.jit
def _rank_all(key, rest, k, scratch_ptr, e, E: tl.constexpr, BE: tl.constexpr, BJ: tl.constexpr):
    tl.debug_barrier()
    tl.store(scratch_ptr + e, key, mask=e < E)
    tl.debug_barrier()
    rank = tl.zeros([BE], dtype=tl.int32)
    for j0 in range(0, BE, BJ):
        j = j0 + tl.arange(0, BJ)
        kj = tl.load(scratch_ptr + j, mask=j < E, other=-1)
        rank += tl.sum((kj[None, :] > key[:, None]).to(tl.int32), axis=1)
    return rest & (rank < k)


@triton.jit
def _kept(
    key, rest, k, d, scratch_ptr, e, E: tl.constexpr, BE: tl.constexpr, BJ: tl.constexpr, ROUNDS: tl.constexpr
):
    """The members of ``rest`` kept: all when d <= 0, else the k best by ``key``."""
    kept = rest
    if d > 0:
        if k <= d:
            if k <= ROUNDS:
                kept = rest & (e < 0)
                rem = rest
                for _ in range(0, k):
                    top = (key == tl.max(tl.where(rem, key, -1), axis=0)) & rem
                    kept = kept | top
                    rem = rem & ~top
            else:
                kept = _rank_all(key, rest, k, scratch_ptr, e, E, BE, BJ)
        else:
            if d <= ROUNDS:
                for _ in range(0, d):
                    low = tl.min(tl.where(kept, key, 0x7FFFFFFFFFFFFFFF), axis=0)
                    kept = kept & (key != low)
            else:
                kept = _rank_all(key, rest, k, scratch_ptr, e, E, BE, BJ)
    return kept


@triton.jit
def _place_matrix(se, s, sm, active, new_in, admit, n_admit, e):
    """Registers only: (slot_expert after, copy_expert, expert_slot after)."""
    kept_s = tl.sum(((e[None, :] == se[:, None]) & new_in[None, :]).to(tl.int32), axis=1) > 0
    free = sm & (s < active) & ((se < 0) | ~kept_s)
    free_rank = tl.cumsum(free.to(tl.int32), axis=0) - 1
    admit_rank = tl.cumsum(admit.to(tl.int32), axis=0) - 1
    gets = free & (free_rank < n_admit)
    match = (admit_rank[None, :] == free_rank[:, None]) & admit[None, :]
    incoming = tl.sum(tl.where(match, e[None, :], 0), axis=1)
    copy = tl.where(gets, incoming, -1)
    se_new = tl.where(gets, incoming, tl.where(free, -1, se))
    es_new = tl.max(tl.where(se_new[:, None] == e[None, :], s[:, None], -1), axis=0)
    return se_new, copy, es_new


@triton.jit
def _place_scratch(se, s, sm, active, new_in, admit, n_admit, e, em, scratch_ptr, SIZE: tl.constexpr):
    """The old kernel's placement through the scratch (caches too large for the matrices)."""
    tl.debug_barrier()
    tl.store(scratch_ptr + e, new_in.to(tl.int64), mask=em)
    admit_rank = tl.cumsum(admit.to(tl.int32), axis=0) - 1
    tl.store(scratch_ptr + SIZE + admit_rank, e.to(tl.int64), mask=admit & em)
    tl.debug_barrier()
    kept_s = tl.load(scratch_ptr + tl.maximum(se, 0), mask=sm & (se >= 0), other=1) != 0
    free = sm & (s < active) & ((se < 0) | ~kept_s)
    free_rank = tl.cumsum(free.to(tl.int32), axis=0) - 1
    gets = free & (free_rank < n_admit)
    incoming = tl.load(scratch_ptr + SIZE + tl.maximum(free_rank, 0), mask=gets, other=-1).to(tl.int32)
    copy = tl.where(gets, incoming, -1)
    se_new = tl.where(gets, incoming, tl.where(free, -1, se))
    tl.debug_barrier()
    tl.store(scratch_ptr + e, (e * 0 - 1).to(tl.int64), mask=em)
    tl.debug_barrier()
    tl.store(scratch_ptr + tl.maximum(se_new, 0), s.to(tl.int64), mask=sm & (se_new >= 0))
    tl.debug_barrier()
    es_new = tl.load(scratch_ptr + e, mask=em, other=-1).to(tl.int32)
    return se_new, copy, es_new


@triton.jit
def _load_ids(ids_ptr, valid_ptr, r, n_sel, top_k, E: tl.constexpr, HAS_VALID: tl.constexpr):
    """(ids, in the block, in [0, E) -- remapped, in [0, E) on a valid row -- counted)."""
    rm = r < n_sel
    ids = tl.load(ids_ptr + r, mask=rm, other=-1)
    inr = rm & (ids >= 0) & (ids < E)
    ok = inr
    if HAS_VALID:
        ok = ok & (tl.load(valid_ptr + r // top_k, mask=rm, other=0) != 0)
    return ids, rm, inr, ok


# n_sel, top_k and N are run-time values, not specialised: layers whose slot counts differ (the seeded
# form spreads the pool unevenly) share one compilation per block size.
@triton.jit(do_not_specialize=["n_sel", "top_k", "N"])
def dlfu_step_fast(
    ids_ptr, valid_ptr, out_ptr, n_sel, top_k,
    score_ptr, slot_expert_ptr, expert_slot_ptr, pinned_ptr, active_ptr,
    copy_ptr, table_ptr, counters_ptr, scratch_ptr,
    decay_num, id_bits, N,
    E: tl.constexpr, BE: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, BJ: tl.constexpr,
    ONEHOT: tl.constexpr, HIST: tl.constexpr, MATRIX: tl.constexpr, HAS_VALID: tl.constexpr, SIZE: tl.constexpr,
    ROUNDS: tl.constexpr, FRAC: tl.constexpr, SHIFT: tl.constexpr, SMAX: tl.constexpr,
):  # fmt: skip
    e = tl.arange(0, BE)
    em = e < E
    s = tl.arange(0, BN)
    sm = s < N
    c = tl.arange(0, 16)
    cm = c < 9
    # ---- every state load first (independent: one memory latency) ------------------------
    es = tl.load(expert_slot_ptr + e, mask=em, other=-1).to(tl.int32)
    pinned = (tl.load(pinned_ptr + e, mask=em, other=0) != 0) & em
    score = tl.load(score_ptr + e, mask=em, other=0)
    table = tl.load(table_ptr + e, mask=em, other=0).to(tl.int32)
    se = tl.load(slot_expert_ptr + s, mask=sm, other=-1).to(tl.int32)
    active = tl.load(active_ptr).to(tl.int32)
    old_counters = tl.load(counters_ptr + c, mask=cm, other=0)
    # ---- step counts on the original ids ---------------------------------------------------
    if ONEHOT:
        ids, rm, inr, ok = _load_ids(ids_ptr, valid_ptr, tl.arange(0, BR), n_sel, top_k, E, HAS_VALID)
        onehot = e[:, None] == tl.where(inr, ids, -1).to(tl.int32)[None, :]
        counts = tl.sum((onehot & ok[None, :]).to(tl.int32), axis=1)
    else:
        counts = tl.zeros([BE], dtype=tl.int32)
        for r0 in range(0, n_sel, BR):
            ids, rm, inr, ok = _load_ids(
                ids_ptr, valid_ptr, r0 + tl.arange(0, BR), n_sel, top_k, E, HAS_VALID
            )
            if HIST:
                hist = tl.histogram(tl.where(ok, ids, 0).to(tl.int32), BE)
                counts += hist - tl.where(e == 0, tl.sum((~ok).to(tl.int32), axis=0), 0)
            else:  # fewer than 32 experts: tl.histogram's GPU lowering wants >= 32 bins
                hit2 = (e[:, None] == tl.where(ok, ids, -1).to(tl.int32)[None, :]) & ok[None, :]
                counts += tl.sum(hit2.to(tl.int32), axis=1)
    need = counts > 0
    in_slot = es >= 0
    resident = in_slot | pinned
    hit = need & resident
    # ---- score update --------------------------------------------------------------------
    score = (score * decay_num) >> SHIFT
    score = tl.minimum(score + (counts.to(tl.int64) << FRAC), SMAX)
    tl.store(score_ptr + e, score, mask=em)
    # ---- choose: forced + the best `free` of the rest -------------------------------------
    forced = in_slot & need
    free_n = active - tl.sum(forced.to(tl.int32), axis=0)
    rest = (in_slot | need) & (~forced) & (~pinned) & em
    key = (
        (need.to(tl.int64) << 61)
        | (score << (id_bits + 1))
        | (in_slot.to(tl.int64) << id_bits)
        | ((E - 1) - e).to(tl.int64)
    )
    key = tl.where(rest, key, -1)
    k = tl.maximum(free_n, 0)
    d = tl.sum(rest.to(tl.int32), axis=0) - k
    new_in = forced | _kept(key, rest, k, d, scratch_ptr, e, E, BE, BJ, ROUNDS)
    evict = in_slot & (~new_in)
    admit = new_in & (~in_slot)
    n_admit = tl.sum(admit.to(tl.int32), axis=0)
    n_evict = tl.sum(evict.to(tl.int32), axis=0)
    # ---- place: k-th admitted (ascending id) into the k-th free slot ----------------------
    copy = tl.full([BN], -1, tl.int32)
    if n_admit + n_evict > 0:
        if MATRIX:
            se_new, copy, es_new = _place_matrix(se, s, sm, active, new_in, admit, n_admit, e)
        else:
            se_new, copy, es_new = _place_scratch(
                se, s, sm, active, new_in, admit, n_admit, e, em, scratch_ptr, SIZE
            )
        table = tl.where(es_new >= 0, E + es_new, e)
        tl.store(slot_expert_ptr + s, se_new.to(tl.int64), mask=sm)
        tl.store(expert_slot_ptr + e, es_new.to(tl.int64), mask=em)
        tl.store(table_ptr + e, table.to(tl.int64), mask=em)
    tl.store(copy_ptr + s, copy.to(tl.int64), mask=sm)
    # ---- counters (device_cache.COUNTER_NAMES order) --------------------------------------
    bypassed = tl.sum((need & (~resident) & (~new_in)).to(tl.int32), axis=0)
    n_need = tl.sum(need.to(tl.int32), axis=0)
    wide = (n_need > tl.sum(pinned.to(tl.int32), axis=0) + active).to(tl.int32)
    upd = tl.where(c == 0, 1, 0)
    upd += tl.where(c == 1, tl.sum(counts, axis=0), 0)
    upd += tl.where(c == 2, tl.sum(tl.where(hit, counts, 0), axis=0), 0)
    upd += tl.where(c == 3, n_need, 0)
    upd += tl.where(c == 4, tl.sum(hit.to(tl.int32), axis=0), 0)
    upd += tl.where(c == 5, n_admit, 0)
    upd += tl.where(c == 6, n_evict, 0)
    upd += tl.where(c == 7, bypassed, 0)
    upd += tl.where(c == 8, wide, 0)
    tl.store(counters_ptr + c, old_counters + upd.to(tl.int64), mask=cm)
    # ---- remap the ids the kernel reads ---------------------------------------------------
    if ONEHOT:
        mapped = tl.sum(tl.where(onehot, table[:, None], 0), axis=0)
        tl.store(out_ptr + tl.arange(0, BR), tl.where(inr, mapped.to(ids.dtype), ids), mask=rm)
    else:
        tl.debug_barrier()
        for r0 in range(0, n_sel, BR):
            r = r0 + tl.arange(0, BR)
            ids, rm, inr, ok = _load_ids(ids_ptr, valid_ptr, r, n_sel, top_k, E, False)
            mapped = tl.load(table_ptr + tl.where(inr, ids, 0), mask=inr, other=0)
            tl.store(out_ptr + r, tl.where(inr, mapped.to(ids.dtype), ids), mask=rm)
