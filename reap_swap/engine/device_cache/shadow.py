"""A debug shadow of the device cache inside a real server.

``--reap-cache-shadow out|bytes`` (or ``REAP_CACHE_SHADOW``, read by the launcher like every REAP_*
setting and passed to the workers in the additional config): every cached MoE layer-step also runs the
*uncached* kernel call -- vLLM's own ``forward_native`` arguments (the layer's E-unit weight views,
the router's original ids, ``global_num_experts = E``: exactly the ``--reap-cache off`` path that
matched stock bit for bit in run10) -- and compares the two outputs on the device. The served
output stays the cached one (the text still shows the bug). Everything is device tensor ops with
fixed shapes and no host sync, so it is captured and replayed inside vLLM's CUDA graphs like the
step itself (it doubles the MoE cost: diagnostics only).

Per layer, read between steps (``DeviceCaches.status()["shadow"]``, hence ``/reap/status`` under
``cache.shadow``): steps seen, steps whose outputs differ, the first such step's index (in the
layer's own step count, the cache counters' ``steps``), its row count, the largest absolute
difference seen, and for the first mismatching step its first ``KEEP`` original ids, the remapped
ids the cached kernel read (>= E: a slot), and ``copy_expert`` (what that step copied into each
slot). A position that is NaN in both outputs is not a difference (CUDA-graph padding rows carry
garbage inputs, which were reported as mismatches with a NaN max before this
rule); ``nan_steps`` counts the steps that had one. ``bytes`` also checks, every step, that each occupied slot
holds its expert's bytes (reads every slot's source over PCIe: slow) and counts the steps where
one does not.
"""

from __future__ import annotations

import torch

KEEP = 64  # selections recorded from the first mismatching step
_STAT = ("steps", "mismatched_steps", "first_step", "first_rows", "bad_slot_steps", "nan_steps")


def shadow_mode(settings) -> str | None:
    """None (off), "out" (compare outputs) or "bytes" (also check slot bytes): --reap-cache-shadow."""
    raw = settings.cache.shadow
    return None if raw == "off" else raw


class Shadow:
    """One layer's shadow record (device tensors, allocated at engage: before any capture)."""

    def __init__(self, device, num_slots: int, check_bytes: bool) -> None:
        kw = {"dtype": torch.int64, "device": device}
        self.stats = torch.tensor([0, 0, -1, 0, 0, 0], **kw)
        self.max_diff = torch.zeros((), dtype=torch.float32, device=device)
        self.ids = torch.full((KEEP,), -1, **kw)
        self.remapped = torch.full((KEEP,), -1, **kw)
        self.copies = torch.full((max(num_slots, 1),), -1, **kw)
        self.check_bytes = check_bytes

    def record(self, out, ref, topk_ids, ids, copy_expert, slots_ok=None) -> None:
        """Fold one layer-step into the record (captured: no host sync)."""
        st = self.stats
        both_nan = torch.isnan(out) & torch.isnan(ref)  # garbage padding rows: NaN in both, not a difference
        differ = (out != ref) & ~both_nan
        bad = differ.any()
        st[5] += both_nan.any().to(torch.int64)
        first = bad & (st[1] == 0)
        st[2] = torch.where(first, st[0], st[2])
        st[3] = torch.where(first, torch.full_like(st[3], out.shape[0]), st[3])
        st[1] += bad.to(torch.int64)
        if slots_ok is not None:
            st[4] += (~slots_ok).to(torch.int64)
        st[0] += 1
        if out.numel():  # NaN on one side only is a difference of inf
            gap = torch.where(differ, (out.float() - ref.float()).abs(), 0.0)
            diff = torch.nan_to_num(gap, nan=float("inf")).max()
        else:
            diff = self.max_diff
        self.max_diff.copy_(torch.maximum(self.max_diff, diff))
        k = min(KEEP, topk_ids.numel())
        if k:
            self.ids[:k] = torch.where(first, topk_ids.reshape(-1)[:k].to(torch.int64), self.ids[:k])
            self.remapped[:k] = torch.where(first, ids.reshape(-1)[:k].to(torch.int64), self.remapped[:k])
        n = copy_expert.numel()
        if n:
            self.copies[:n] = torch.where(first, copy_expert, self.copies[:n])

    def report(self) -> dict:
        vals = dict(zip(_STAT, self.stats.tolist(), strict=True))
        vals["max_abs_diff"] = float(self.max_diff)
        if vals["mismatched_steps"]:
            vals["first_ids"] = [i for i in self.ids.tolist() if i >= 0]
            vals["first_remapped"] = [i for i in self.remapped.tolist() if i >= 0]
            vals["first_copy_expert"] = self.copies.tolist()
        return vals


def slots_hold_their_experts(
    units: torch.Tensor, slot_expert: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """bool 0-dim: every occupied slot's unit equals its expert's unit (fixed shapes; one slot at a
    time, so the temporary is one unit, not N). No host sync, so it is captured in CUDA graphs: the
    expert's unit is gathered with index_select on a 1-element id (indexing with a 0-dim tensor
    reads the id on the host, which fails vLLM's graph capture)."""
    ok = torch.ones((), dtype=torch.bool, device=units.device)
    for s in range(slot_expert.shape[0]):
        e = slot_expert[s : s + 1]
        held = units.index_select(0, e.clamp(min=0))[0]
        ok = ok & ((held == units[num_experts + s]).all() | (e[0] < 0))
    return ok
