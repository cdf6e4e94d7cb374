"""Grouped residency units: a static, plan-chosen physical expert order and groups of b experts.

Why (research.md "Padding: HBM per resident expert"): a 2 MiB-granular mapping unit of one expert
wastes 33 % for FP8 Qwen3-30B-A3B experts (4.5 MiB -> 6 MiB). Independent per-expert residency
cannot do better; groups of b consecutive *physical* ids sharing pages can (FP8 b = 2: 5 MiB per
expert, 11.1 %), but only if the experts a plan keeps resident together are physically adjacent.
So the physical order is chosen once from the plan -- the core first, then each slice in plan
order, then the plan's fillOrder, then the remaining ids -- fixed at load and never changed by a
swap. Routing ids are mapped logical -> physical right before the unchanged kernel; router
statistics keep counting logical ids (they are taken before the map).

This module is the pure part (no torch): the permutation, the group size per format (the smallest
power of two whose waste is under 12 %, by `quant_padding`'s math), the per-tensor group layout
(uniform expert stride `s_t = G * a_t / b` inside a region of whole groups), and the translation of
a resident set of logical ids into physical groups with the HBM it really takes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from reap_swap.sizing.quant.padding import GRANULE, ExpertFormat, group_stride, smallest_group

MAX_WASTE = 0.12  # the target: HBM per resident expert within 12 % of the unpadded ideal
STRIDE_ALIGN = 16  # bytes: what the Triton kernel's expert stride must be a multiple of
GROUP_SIZES = ("auto", "1", "2", "4", "8")


# -- the permutation ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Permutation:
    """`to_physical[logical]` and its inverse `to_logical[physical]` (one layer)."""

    to_physical: tuple[int, ...]
    to_logical: tuple[int, ...]

    @classmethod
    def from_order(cls, order: Sequence[int]) -> Permutation:
        """`order[p]` is the logical id placed at physical id p."""
        n = len(order)
        if sorted(order) != list(range(n)):
            raise ValueError(f"not a permutation of 0..{n - 1}: {list(order)[:16]}...")
        phys = [0] * n
        for p, e in enumerate(order):
            phys[e] = p
        return cls(tuple(phys), tuple(int(e) for e in order))

    @classmethod
    def identity(cls, n: int) -> Permutation:
        return cls(tuple(range(n)), tuple(range(n)))

    @property
    def num_experts(self) -> int:
        return len(self.to_physical)

    @property
    def is_identity(self) -> bool:
        return self.to_physical == tuple(range(self.num_experts))


def physical_order(
    num_experts: int,
    core: Iterable[int] = (),
    slices: Iterable[Iterable[int]] = (),
    fill: Iterable[int] = (),
) -> list[int]:
    """Logical ids in physical order: core (ascending), each slice in plan order (its experts in
    listed order), the fill order, then every id not placed yet (ascending). Duplicates and ids
    outside [0, num_experts) are skipped: each id gets the first place it is named at."""
    order: list[int] = []
    seen: set[int] = set()

    def place(ids: Iterable[int]) -> None:
        for e in ids:
            e = int(e)
            if 0 <= e < num_experts and e not in seen:
                seen.add(e)
                order.append(e)

    place(sorted(int(e) for e in core))
    for s in slices:
        place(s)
    place(fill)
    place(range(num_experts))
    return order


def plan_permutations(plan) -> dict[int, Permutation]:
    """Per plan layer, the permutation of `physical_order` (plan: plan_model.Plan)."""
    fill, _ = plan.fill_order()
    by_layer: dict[int, list[int]] = {}
    for layer, e in fill:
        by_layer.setdefault(int(layer), []).append(int(e))
    return {
        index: Permutation.from_order(
            physical_order(lp.num_experts, lp.core, (s.experts for s in lp.slices), by_layer.get(index, ()))
        )
        for index, lp in plan.layers.items()
    }


# -- the group size and the unit layout of a group ----------------------------------------------
def choose_group_size(
    slabs: Sequence[tuple[str, int]], requested: str = "auto", granule: int = GRANULE
) -> tuple[int, str]:
    """(b, why) for one layer's re-homed slabs (name, bytes per expert), stride-taking kernel.

    auto: `quant_padding.smallest_group` over w13 + w2 (the smallest power of two with waste
    < 12 %); a layer with other re-homed tensors than w13_weight / w2_weight keeps b = 1."""
    if requested not in GROUP_SIZES:
        raise ValueError(f"--reap-group-size {requested!r}: expected one of {', '.join(GROUP_SIZES)}")
    if requested != "auto":
        return int(requested), f"--reap-group-size {requested}"
    sizes = dict(slabs)
    if set(sizes) != {"w13_weight", "w2_weight"}:
        return 1, f"re-homed tensors {sorted(sizes)} are not w13_weight + w2_weight: private units"
    fmt = ExpertFormat("layer", sizes["w13_weight"], sizes["w2_weight"], 0, "strided")
    b = smallest_group(fmt, MAX_WASTE, granule)
    if b == 0:
        return 1, f"no group of <= 64 experts wastes < {MAX_WASTE:.0%}: private units"
    return b, f"auto: smallest b with waste < {MAX_WASTE:.0%}"


@dataclass(frozen=True)
class GroupLayout:
    """Each re-homed tensor in its own region of whole groups: expert p of tensor t at
    `region_t + p * strides[t]`; group g = pages [g * a_t, (g + 1) * a_t) of every region."""

    names: tuple[str, ...]
    slab_bytes: tuple[int, ...]  # one expert's slab of each tensor
    strides: tuple[int, ...]  # expert stride of each tensor (bytes): G * a_t / b
    unit_bytes: tuple[int, ...]  # one group's pages of each tensor: b * stride = a_t * G
    group_size: int  # b
    num_experts: int
    granule: int

    @property
    def num_groups(self) -> int:
        return -(-self.num_experts // self.group_size)

    def payload(self, index: int, members: int | None = None) -> int:
        """Bytes a swap copies for tensor `index` of a group of `members` experts (default b)."""
        m = self.group_size if members is None else members
        return (m - 1) * self.strides[index] + self.slab_bytes[index]

    @property
    def group_payload_bytes(self) -> int:
        """Bytes copied per (full) group, every tensor."""
        return sum(self.payload(i) for i in range(len(self.names)))

    @property
    def group_bytes(self) -> int:
        """HBM of one resident group (its pages of every tensor)."""
        return sum(self.unit_bytes)

    @property
    def expert_bytes(self) -> int:
        return sum(self.slab_bytes)

    @property
    def bytes_per_expert(self) -> float:
        """HBM per expert when whole groups are resident."""
        return self.group_bytes / self.group_size

    @property
    def padding_overhead(self) -> float:
        return self.bytes_per_expert / max(self.expert_bytes, 1) - 1

    def group_of(self, physical: int) -> int:
        return physical // self.group_size

    def members(self, group: int) -> range:
        return range(group * self.group_size, min((group + 1) * self.group_size, self.num_experts))


def plan_groups(
    slabs: Sequence[tuple[str, int]], num_experts: int, group_size: int, granule: int = GRANULE
) -> GroupLayout:
    """The group layout of `slabs` (name, bytes per expert); b = 1 is one private unit per tensor."""
    if not slabs:
        raise ValueError("no tensor to re-home: a group needs at least one slab")
    if group_size < 1 or num_experts < 1:
        raise ValueError(f"group size {group_size}, {num_experts} experts")
    names = tuple(n for n, _ in slabs)
    if len(set(names)) != len(names):
        raise ValueError(f"tensor listed twice: {names}")
    strides = []
    for name, nbytes in slabs:
        if nbytes <= 0:
            raise ValueError(f"{name}: slab of {nbytes} B")
        s = group_stride(int(nbytes), group_size, granule)  # quant_padding: smallest G*a/b >= slab
        if s.denominator != 1 or int(s) % STRIDE_ALIGN:
            raise ValueError(f"{name}: group of {group_size} gives stride {s} B (not a multiple of 16 B)")
        strides.append(int(s))
    return GroupLayout(
        names,
        tuple(int(n) for _, n in slabs),
        tuple(strides),
        tuple(s * group_size for s in strides),
        group_size,
        num_experts,
        granule,
    )


def group_pool_slots(expert_slots: int, private_unit_bytes: int, layout: GroupLayout, max_groups: int) -> int:
    """Group slots of a grouped pool that replaces a private pool of `expert_slots` units.

    The rule: the grouped pool takes no more HBM than the private pool it replaces
    (`expert_slots * private_unit_bytes`), and at least ceil(expert_slots / b) groups (the plan's
    expert count in whole groups); the padding saved becomes room for the boundary groups of
    odd-sized core / slices (their passengers). Capped at `max_groups` (every group of every layer)."""
    if expert_slots <= 0:
        return 0
    same_hbm = expert_slots * int(private_unit_bytes) // layout.group_bytes
    whole = -(-int(expert_slots) // layout.group_size)
    return max(0, min(max(same_hbm, whole), int(max_groups)))


# -- resident sets: logical ids -> physical groups -----------------------------------------------
def groups_for(experts: Iterable[int], perm: Permutation, group_size: int) -> frozenset[int]:
    """The physical groups to make resident: a group is resident if any member is wanted."""
    return frozenset(perm.to_physical[int(e)] // group_size for e in experts)


def residents_of(groups: Iterable[int], perm: Permutation, group_size: int) -> frozenset[int]:
    """Every logical expert that resident `groups` hold (the wanted ones and their passengers)."""
    n = perm.num_experts
    return frozenset(
        perm.to_logical[p] for g in groups for p in range(g * group_size, min((g + 1) * group_size, n))
    )


def group_target(
    target: Mapping[int, Iterable[int]], perms: Mapping[int, Permutation], sizes: Mapping[int, int]
) -> dict[int, list[int]]:
    """Layer -> sorted physical groups for a target of layer -> logical experts."""
    return {
        int(l): sorted(groups_for(v, perms[int(l)], sizes[int(l)]))
        for l, v in target.items()
        if int(l) in perms
    }


@dataclass(frozen=True)
class SetCost:
    wanted: int  # logical experts asked for
    groups: int  # groups made resident
    resident: int  # experts those groups hold (wanted + passengers)
    hbm_bytes: int  # groups * group_bytes

    @property
    def bytes_per_wanted(self) -> float:
        return self.hbm_bytes / self.wanted if self.wanted else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {
            "wanted": self.wanted,
            "groups": self.groups,
            "resident_experts": self.resident,
            "hbm_bytes": self.hbm_bytes,
            "hbm_bytes_per_wanted_expert": round(self.bytes_per_wanted, 1),
        }


def set_cost(experts: Iterable[int], perm: Permutation, layout: GroupLayout) -> SetCost:
    """What a resident set of logical ids costs in HBM under `layout` (the groups it touches)."""
    wanted = frozenset(int(e) for e in experts)
    groups = groups_for(wanted, perm, layout.group_size)
    resident = residents_of(groups, perm, layout.group_size)
    return SetCost(len(wanted), len(groups), len(resident), len(groups) * layout.group_bytes)


def layer_status(layout: GroupLayout, perm: Permutation, why: str) -> dict:
    """What /reap/status says about one layer's layout."""
    return {
        "layout": "grouped" if layout.group_size > 1 else "private",
        "group_size": layout.group_size,
        "why": why,
        "groups": layout.num_groups,
        "group_bytes": layout.group_bytes,
        "group_payload_bytes": layout.group_payload_bytes,
        "bytes_per_expert": layout.bytes_per_expert,
        "padding_overhead": round(layout.padding_overhead, 4),
        "strides": dict(zip(layout.names, layout.strides, strict=True)),
        "permuted": not perm.is_identity,
    }


# -- derived figures (research.md) -------------------------------------------------------------
def _synthetic_plan(num_experts: int, core: int, slice_size: int, slices: int, seed: int):
    """Core and slices as random logical ids (routing does not make hot experts adjacent ids)."""
    import random

    ids = list(range(num_experts))
    random.Random(seed).shuffle(ids)
    cut = [ids[core + k * slice_size : core + (k + 1) * slice_size] for k in range(slices)]
    return ids[:core], cut


def plan_ordered_rows(
    formats: Sequence[ExpertFormat],
    shapes: Sequence[tuple[int, int]] = ((16, 8), (13, 6)),
    num_experts: int = 128,
    slices: int = 6,
    seed: int = 0,
) -> list[dict]:
    """HBM per wanted expert, one layer, for plan-shaped resident sets (core + slices 1..n, and
    core + the last slice alone): private units, groups over the logical order, groups over the
    plan order. Pure arithmetic over `set_cost`."""
    rows = []
    for fmt in formats:
        slabs = (("w13_weight", fmt.w13), ("w2_weight", fmt.w2))
        b, _ = choose_group_size(slabs)
        private = plan_groups(slabs, num_experts, 1)
        grouped = plan_groups(slabs, num_experts, b)
        for core_n, size in shapes:
            core, cut = _synthetic_plan(num_experts, core_n, size, slices, seed)
            ordered = Permutation.from_order(physical_order(num_experts, core, cut))
            ident = Permutation.identity(num_experts)
            sets = {f"core+{n} slices": [*core, *(e for s in cut[:n] for e in s)] for n in (1, 3, slices)}
            sets[f"core+slice {slices} alone"] = [*core, *cut[-1]]
            for label, wanted in sets.items():
                rows.append(
                    {
                        "format": fmt.name,
                        "b": b,
                        "plan": f"core {core_n}, slices of {size}",
                        "set": label,
                        "wanted": len(wanted),
                        "ideal_mib": fmt.ideal / 2**20,
                        "private_mib": set_cost(wanted, ident, private).bytes_per_wanted / 2**20,
                        "grouped_id_order_mib": set_cost(wanted, ident, grouped).bytes_per_wanted / 2**20,
                        "grouped_plan_order_mib": set_cost(wanted, ordered, grouped).bytes_per_wanted / 2**20,
                    }
                )
    return rows


def plan_ordered_markdown(rows: list[dict]) -> str:
    lines = [
        "| format | b | plan | resident set | wanted | ideal | private | grouped, id order | "
        "grouped, plan order |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['format']} | {r['b']} | {r['plan']} | {r['set']} | {r['wanted']} | {r['ideal_mib']:.2f} | "
            f"{r['private_mib']:.2f} | {r['grouped_id_order_mib']:.2f} | {r['grouped_plan_order_mib']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - prints the research.md table
    from reap_swap.sizing.quant.padding import qwen3_30b_formats

    fmts = [f for f in qwen3_30b_formats() if f.kernel == "strided"][:2]
    print(plan_ordered_markdown(plan_ordered_rows(fmts)))
