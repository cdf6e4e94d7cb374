"""Carry out a planned swap against an expert store, and undo it if a step fails.

The order is the issue's contract: validate (capacity) before anything moves; release the evicted
experts first, so HBM use never exceeds the pool; copy the admitted experts host->device; publish
each one (remap) once its copy has landed (or, remapping ahead, before: below). The host copy is
the master, so an eviction copies nothing. Whenever a kernel may run, every expert is backed by
either its host master or a slot holding the same bytes, so a forward pass that runs after a
failure still reads correct weights (a swap that remapped ahead and fails lands its copies, a
quiesce, before it publishes); the table is committed step by step, so once a swap returns or
raises it says what the device holds (remapping ahead, it lists admissions while their copies are
still in flight, which nothing reads until they land). On a failure the swap is rolled
back to the previous resident set (re-copying what the failed swap overwrote), and the error is
re-raised.

Publishing in chunks (to meet the swap guard): setting access costs tens of microseconds per unit,
several times that for host-backed ones (research.md); paid after the last copy landed it was a
noticeable part of the swap's tail. So every `publish_every` admissions whose copies have
landed and been remapped, while later copies are still in flight, the store publishes what is
pending so far (those admissions and the swap's evictions); the final publish handles the rest.
Why this is safe while copies run: a copy reads the *source* expert's unit of a MixedRange (a
host-backed unit not yet remapped, so not pending and not touched by the publish; remapping ahead,
the master's second mapping, which no remap or publish touches) and writes a
slot's *staging* address in the DeviceSlotPool (a reservation of its own, mapped and made
accessible once at startup, never changed). cuMemSetAccess acts only on the virtual-address
range it is given (shared/notes/cuda-vmm.md, step 4: access is set "for that subrange"), here
the pending runs of remapped units, disjoint from every in-flight copy's source and destination;
cuMemUnmap/cuMemMap of other units of the same ranges already run during in-flight copies (the
remaps overlap the copies). No kernel runs during a swap (quiesce), so a unit published
early is read by nothing until the swap returns. Not promised by the CUDA docs: that the call
does not block until the copies end ("any CUDA API call may block or synchronize", driver API
sync notes); it would then show as publish_overlapped ~ the copy time and no gain in the A/B of
research/gpu/gpu_swap_guard.py. `publish_every = 0` turns it off.

Remapping ahead (`publish_every = PUBLISH_AHEAD`, stores with `copies_read_masters`): the copies
read each host master at a second mapping of its allocation (vmm.MixedRange.master_address) that
no remap touches, so an admission need not wait for its copy before its unit is remapped. Every
remap and one publish then run while the copies are in flight, and the swap ends by waiting for
them: the CPU's work hides behind the copies instead of following the last one. Between a remap
and the landing of its copy the unit is mapped to a slot still being written; no kernel reads it
then (quiesce: none runs until the swap returns, and it returns only after every copy landed;
when a step fails, the swap quiesces before its final publish, so a raise lands every copy too).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from reap_swap.cache.slot_table import SlotTable, SwapPlan

# publish_every > 0: landed admissions between overlapped publishes; 0 = publish only at the end
# (the original behaviour). 8 was the default before remapping ahead (research/gpu/gpu_swap_guard.py's A/B:
# faster than 0 on the 1 GiB delta, a much shorter publish tail; 32 no better; research.md).
# publish_every value PUBLISH_WHEN_IDLE: publish what is pending only while the CPU would otherwise
# wait, i.e. just before waiting on a copy that has not landed yet (the store's copy_landed). Why:
# fixed chunks can add CPU work to an admit loop that is already at the copies' pace, so the loop
# ends after the copies (research.md). A store without copy_landed publishes only at the end.
PUBLISH_WHEN_IDLE = -1
# publish_every value PUBLISH_AHEAD: remap every admission as soon as its copy is issued, publish once,
# then wait for the copies (module docstring). Only for a store whose copies read the masters' second
# mapping (`copies_read_masters`); any other store publishes only at the end.
PUBLISH_AHEAD = -2
# The default: remapping ahead beat chunks of 8 on the 1 GiB delta in every guard session, on the H200
# and the H100, close to the copies alone, bytes bitwise; the engine's GPU tests and a server swapping
# 1 % to 100 % of its pool passed with it, text and logprobs unchanged (research.md). A store whose
# copies do not read the masters' second mapping publishes only at the end instead (_remaps_ahead).
PUBLISH_EVERY = PUBLISH_AHEAD
# --reap-swap-publish names (settings.py) -> publish_every values; an integer N >= 1 is chunks of N
PUBLISH_MODES = {"ahead": PUBLISH_AHEAD, "idle": PUBLISH_WHEN_IDLE, "end": 0}


def publish_every_of(setting: str | int) -> int:
    """The publish_every value of a --reap-swap-publish setting (already validated by settings.py)."""
    return PUBLISH_MODES[setting] if isinstance(setting, str) else int(setting)


def publish_mode(explicit: int | None, state: Any) -> int:
    """A store's publish_every: its own argument, else its state's (the server's --reap-swap-publish,
    which the engine puts there), else PUBLISH_EVERY, read now (tests change it)."""
    if explicit is not None:
        return explicit
    chosen = getattr(state, "publish_every", None)
    return PUBLISH_EVERY if chosen is None else int(chosen)


def reads_masters(publish_every: int) -> bool:
    """Whether a store in this mode copies from the masters' second mapping (vmm.MixedRange.
    master_address): remapping ahead remaps the units themselves while the copies run. The stores
    and the load (which makes that mapping beforehand) decide by this one rule."""
    return publish_every == PUBLISH_AHEAD


class ExpertStore(Protocol):
    """The data path: where an expert's bytes live and how they move (CUDA VMM, or a test fake)."""

    bytes_per_expert: int

    def quiesce(self) -> None:
        """Wait until no kernel can be reading the ranges about to be remapped."""

    def map_host(self, layer: int, expert: int) -> None:
        """Back the expert by its host master again (evict: nothing is copied)."""

    def start_copy(self, layer: int, expert: int, slot: int) -> Any:
        """Start copying the expert's host master into HBM slot `slot`; return a waitable token."""

    def wait_copy(self, token: Any) -> None:
        """Block until the copy behind `token` has landed."""

    # optional: copy_landed(token) -> bool, whether the copy has landed without waiting (used only
    # with publish_every = PUBLISH_WHEN_IDLE); copies_read_masters: bool, True when a copy reads a
    # mapping of the master that map_slot/map_host leave alone (needed by PUBLISH_AHEAD)

    def map_slot(self, layer: int, expert: int, slot: int) -> None:
        """Back the expert by HBM slot `slot` (readable by kernels after publish())."""

    def publish(self) -> None:
        """Make every remap so far readable (the CUDA store sets access per run of units); called
        at the end of every swap, also of one that failed mid-way, and every `publish_every`
        landed admissions while later copies are in flight (a store may set `publish_every`;
        absent, PUBLISH_EVERY; 0 = only at the end; PUBLISH_AHEAD: once, before the waits, for a
        store with `copies_read_masters`, else only at the end)."""


class SwapStepFailed(RuntimeError):
    """A swap step failed; `rolled_back` says whether the previous resident set was restored."""

    def __init__(self, message: str, rolled_back: bool, resident: dict[int, frozenset[int]]):
        super().__init__(message)
        self.rolled_back = rolled_back
        self.resident = resident


@dataclass
class SwapResult:
    plan: SwapPlan
    bytes_copied: int = 0
    phases: dict[str, float] = field(default_factory=dict)


def _admit(table: SlotTable, store: ExpertStore, plan: SwapPlan, tokens: dict, result: SwapResult) -> None:
    """Wait for each admission's copy, remap it, commit it; every `publish_every` landed ones,
    while later copies are still in flight, publish what is pending (the module docstring says
    why that is safe). Records the overlapped publishes' count and time in result.phases."""
    every = int(getattr(store, "publish_every", PUBLISH_EVERY) or 0)
    landed = getattr(store, "copy_landed", None)
    if every < 0 and (landed is None or every != PUBLISH_WHEN_IDLE):
        every = 0  # idle publishing needs copy_landed; PUBLISH_AHEAD here: a store without master copies
    chunks, overlapped, pending = 0, 0.0, len(plan.evict)  # the evictions' remaps await a publish too
    last = len(plan.admit) - 1

    def publish_pending() -> None:
        nonlocal chunks, overlapped, pending
        t = time.perf_counter()
        store.publish()
        overlapped += time.perf_counter() - t
        chunks, pending = chunks + 1, 0

    for i, step in enumerate(plan.admit):
        if every < 0 and pending and not landed(tokens[step]):  # idle until it lands: publish now
            publish_pending()
        store.wait_copy(tokens[step])
        store.map_slot(step.layer, step.expert, step.slot)
        table.commit_admit(step)
        result.bytes_copied += store.bytes_per_expert
        pending += 1
        if every > 0 and (i + 1) % every == 0 and i < last:  # the final publish handles the rest
            publish_pending()
    result.phases["publish_overlapped"] = overlapped
    result.phases["publish_chunks"] = float(chunks)


def _admit_ahead(
    table: SlotTable, store: ExpertStore, plan: SwapPlan, tokens: dict, result: SwapResult
) -> None:
    """PUBLISH_AHEAD: remap and commit every admission while the copies run, publish once, then
    wait for every copy (the module docstring says why no kernel sees a slot mid-copy)."""
    for step in plan.admit:
        store.map_slot(step.layer, step.expert, step.slot)
        table.commit_admit(step)
        result.bytes_copied += store.bytes_per_expert
    t = time.perf_counter()
    store.publish()
    result.phases["publish_overlapped"] = time.perf_counter() - t
    result.phases["publish_chunks"] = 1.0
    for step in plan.admit:  # one stream: in order, each wait after the first is short
        store.wait_copy(tokens[step])


def _remaps_ahead(store: ExpertStore) -> bool:
    every = int(getattr(store, "publish_every", PUBLISH_EVERY) or 0)
    return every == PUBLISH_AHEAD and bool(getattr(store, "copies_read_masters", False))


def _execute(table: SlotTable, store: ExpertStore, plan: SwapPlan) -> SwapResult:
    result = SwapResult(plan=plan)
    t0 = time.perf_counter()
    store.quiesce()  # no kernel may read a range while it is remapped
    t1 = time.perf_counter()
    # Copies into slots that are free now can start at once; they overlap the eviction remaps
    # and the admission remaps of experts whose copies have already landed. A slot freed by an
    # eviction is written only after that eviction, so a failure never leaves a stale mapping.
    free_now = set(range(table.num_slots)) - {table.slot_of(s.layer, s.expert) for s in plan.evict}
    ahead = _remaps_ahead(store)
    try:
        tokens = {s: store.start_copy(s.layer, s.expert, s.slot) for s in plan.admit if s.slot in free_now}
        t2 = time.perf_counter()
        for step in plan.evict:
            store.map_host(step.layer, step.expert)
            table.commit_evict(step)
        t3 = time.perf_counter()
        for step in plan.admit:
            if step not in tokens:
                tokens[step] = store.start_copy(step.layer, step.expert, step.slot)
        (_admit_ahead if ahead else _admit)(table, store, plan, tokens, result)
        t4 = time.perf_counter()
    except BaseException:
        if ahead:  # units remapped ahead may point at slots still being written: land every copy
            store.quiesce()  # before the publish below makes them readable (also if no rollback follows)
        raise
    finally:
        # no kernel runs during a swap, so access is set per run of remapped units (in chunks
        # while copies are in flight, the rest here) -- and also when a step failed: every remap
        # done so far must be readable before the rollback copies from those ranges (unreadable,
        # the copy faults: a segfault on the H200) and before the next forward pass
        store.publish()
    t5 = time.perf_counter()
    result.phases.update(
        {
            "quiesce": t1 - t0,
            "copy_issue": t2 - t1,
            "evict": t3 - t2,
            "admit": t4 - t3,  # includes publish_overlapped
            "publish": t5 - t4,  # the final publish: the tail after the last copy
        }
    )
    return result


def apply_swap(table: SlotTable, store: ExpertStore, target: Mapping[int, Iterable[int]]) -> SwapResult:
    """Move the store to `target`; raises PoolCapacityError before anything moves, SwapStepFailed after."""
    plan = table.plan(target)  # capacity check: nothing has moved yet
    if plan.is_noop:
        return SwapResult(plan=plan)
    previous = table.resident()
    try:
        return _execute(table, store, plan)
    except Exception as exc:  # roll back to the previous set, then report
        try:
            _execute(table, store, table.plan(previous))
            rolled_back = True
        except Exception:  # the table still says what the device holds
            rolled_back = False
        raise SwapStepFailed(
            f"swap failed ({type(exc).__name__}: {exc}); "
            + ("previous resident set restored" if rolled_back else "rollback failed too"),
            rolled_back=rolled_back,
            resident=table.resident(),
        ) from exc
