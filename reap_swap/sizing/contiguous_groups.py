"""Contiguous grouped units: groups of b experts for kernels that imply the expert stride.

Why (research.md "Padding", the int4grp subsection): vLLM 0.26.0 runs every INT4 W4A16 MoE layer
through Marlin (`fused_marlin_moe` -> `ops.moe_wna16_marlin_gemm`) or `moe_wna16` (`ops.moe_wna16_gemm`
at decode, Triton `fused_moe_kernel_gptq_awq` above it). These kernels compute expert e's address as
`base + e * slab_bytes` from the tensor's *shape*, so a padded per-expert unit is read at the wrong
address. The layout that addresses correctly (its bits on Marlin depend on the id order:
research.md int4perm) keeps each re-homed tensor exactly as stock allocates it -- experts
back to back, stride = slab, no padding -- inside a VMM range whose base is page-aligned, and picks b
such that every tensor's group of b experts is whole 2 MiB pages: `b * slab_t % G == 0` for every t.
A group is then resident or host-backed as a whole, mapped page by page, no page is shared between
groups, and the unchanged kernel reads physical expert p at `base_t + p * slab_t` whatever is
resident. Qwen3-30B-A3B INT4 g128 (H = 2048, I = 768): w13 1.5 MiB, w2 0.75 MiB per expert -> b = 8
(12 MiB + 6 MiB per group, 0 % padding). The group layout itself is `group_layout.plan_groups`
(its stride formula gives stride = slab exactly when b aligns); this module only chooses b and
refuses, by name, what does not align. Pure: no torch, no vLLM.

On the GPU (vLLM 0.26.0; research.md "int4perm") the *permuted* contiguous groups were NOT bitwise
on Marlin -- gptq-/awq-marlin differed from stock at m = 8 and 64 in every residency
state, all experts resident included. Root cause (read in Marlin's kernel): the kernel splits the
concatenation of (moe block, n tile, k tile) evenly over the SMs, so where an expert's K reduction is
cut between thread blocks depends on the *position* of its blocks, and moe_align_block_size orders
the blocks by expert id; permuted ids move an expert's blocks, hence its fp32 partial sums.

So CUDA binds INT4 layers under --reap-group-size auto|2|4|8 in the identity-order variant only:
groups of consecutive expert ids, no permutation (residency/grouped_engine.permutation_for), so the
kernel sees stock's ids and stock's bytes at stock's offsets; `identity_fill` keeps the plan's core
within the HBM a permuted layout would have packed it into. Verified on the H200 at kernel level
(bitwise wherever stock is deterministic; tests/gpu/test_int4_groups.py) and in the server (vLLM
0.26.0): awq, gptq and ct-w4a16 at auto bound as groups of b = 8 (18 MiB,
no padding), greedy text and MoE digests identical to stock at 0/25/50/100 % resident and after
swaps, CUDA graphs on, bytes moved = admitted groups x payload. Permuted INT4 groups are never built.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from reap_swap.sizing.groups import GROUP_SIZES, GroupLayout, plan_groups
from reap_swap.sizing.quant.padding import GRANULE

MAX_CONTIGUOUS_B = 16  # larger groups make the residency too coarse to follow a plan's slices
CANDIDATES = (1, 2, 4, 8, 16)


def identity_fill(wanted: Iterable[int], group_size: int, max_groups: int | None = None) -> list[int]:
    """The wanted experts kept in identity order (group g = experts g*b .. g*b + b-1) when at most
    `max_groups` groups may be resident (default: ceil(len(wanted) / b), the HBM a permuted layout
    packs them into): the groups holding the most wanted experts, ties to the lower group id."""
    wanted = sorted({int(e) for e in wanted})
    if group_size < 1:
        raise ValueError(f"group size {group_size}")
    cap = math.ceil(len(wanted) / group_size) if max_groups is None else max(int(max_groups), 0)
    per_group: dict[int, list[int]] = {}
    for e in wanted:
        per_group.setdefault(e // group_size, []).append(e)
    ranked = sorted(per_group, key=lambda g: (-len(per_group[g]), g))[:cap]
    return sorted(e for g in ranked for e in per_group[g])


class ContiguousLayoutError(ValueError):
    """No group of <= MAX_CONTIGUOUS_B experts fits: the message names the tensors and why."""


def _misaligned(slabs: Sequence[tuple[str, int]], b: int, granule: int) -> list[str]:
    return [f"{n} ({s} B x {b} = {s * b / 2**20:g} MiB)" for n, s in slabs if (s * b) % granule]


def check_contiguous_group(
    slabs: Sequence[tuple[str, int]], num_experts: int, b: int, granule: int = GRANULE
) -> str | None:
    """Why `b` cannot group these slabs contiguously (None: it can)."""
    if b < 1 or b > MAX_CONTIGUOUS_B:
        return f"group size {b} outside 1..{MAX_CONTIGUOUS_B}"
    bad = _misaligned(slabs, b, granule)
    if bad:
        return (
            f"a group of {b} does not end on a {granule // 2**20} MiB page for {', '.join(bad)}: "
            "the kernel implies stride = slab, so groups must be whole pages"
        )
    if num_experts % b:
        return f"{num_experts} experts are not whole groups of {b}"
    return None


def contiguous_group_size(
    slabs: Sequence[tuple[str, int]], num_experts: int, requested: str = "auto", granule: int = GRANULE
) -> tuple[int, str]:
    """(b, why) for a contiguous-kernel layer; raises ContiguousLayoutError naming what misfits.

    auto: the smallest b in 1, 2, 4, 8, 16 that makes every tensor's group whole pages and divides
    num_experts. An explicit b is checked, never rounded."""
    if requested not in GROUP_SIZES:
        raise ContiguousLayoutError(
            f"--reap-group-size {requested!r}: expected one of {', '.join(GROUP_SIZES)}"
        )
    if not slabs or any(int(s) <= 0 for _, s in slabs):
        raise ContiguousLayoutError(f"no per-expert slab to group: {list(slabs)}")
    if requested != "auto":
        b = int(requested)
        problem = check_contiguous_group(slabs, num_experts, b, granule)
        if problem:
            raise ContiguousLayoutError(f"--reap-group-size {requested}: {problem}")
        return b, f"--reap-group-size {requested}: contiguous groups (stride = slab, whole pages)"
    problems = []
    for b in CANDIDATES:
        problem = check_contiguous_group(slabs, num_experts, b, granule)
        if problem is None:
            return b, f"auto: smallest b <= {MAX_CONTIGUOUS_B} whose contiguous groups are whole pages"
        problems.append(f"b = {b}: {problem}")
    raise ContiguousLayoutError(
        f"no contiguous group of <= {MAX_CONTIGUOUS_B} experts fits ({'; '.join(problems[-1:])})"
    )


def plan_contiguous_groups(
    slabs: Sequence[tuple[str, int]], num_experts: int, b: int, granule: int = GRANULE
) -> GroupLayout:
    """`group_layout.plan_groups` for a contiguous kernel: refused unless every stride = slab."""
    problem = check_contiguous_group(slabs, num_experts, b, granule)
    if problem:
        raise ContiguousLayoutError(problem)
    layout = plan_groups(slabs, num_experts, b, granule)
    if layout.strides != layout.slab_bytes:  # cannot happen when b aligns; kept as the invariant
        raise ContiguousLayoutError(f"strides {layout.strides} differ from slabs {layout.slab_bytes}")
    return layout


if __name__ == "__main__":  # pragma: no cover - the research.md figures
    for name, h, i in (("Qwen3-30B-A3B", 2048, 768), ("Qwen3.5-35B-A3B", 2048, 512)):
        w13, w2 = 2 * i * h // 2, h * i // 2
        sl = (("w13_qweight", w13), ("w2_qweight", w2))
        try:
            b, why = contiguous_group_size(sl, 256)
            lay = plan_contiguous_groups(sl, 256, b)
            print(name, b, lay.unit_bytes, f"{lay.padding_overhead:.1%}", why)
        except ContiguousLayoutError as exc:
            print(name, "refused:", exc)
