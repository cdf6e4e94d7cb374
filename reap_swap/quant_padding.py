"""HBM bytes per resident expert under the 2 MiB mapping granularity, per format and layout.

Why: a CUDA VMM mapping is 2 MiB-granular, so an expert whose slab is not a multiple of 2 MiB
wastes the rest of its last page. Measured here per format for Qwen3-30B-A3B experts, against the
unpadded ideal, for the layouts the stride-reading kernels allow:

- `private`: today's engine -- one unit per expert holding w13 then w2, padded (`ceil(P/G)*G`).
  Any layout in which experts never share a page costs at least this much (each expert owns
  whole pages), so it is the floor for independent per-expert residency.
- `group b`: groups of b consecutive expert ids share pages. Each tensor gets an expert stride
  `s = G*a/b >= P` (a whole pages per b experts), so groups tile the range exactly and the stride
  stays uniform (the kernel reads `base + e*s`). Only for kernels that take the stride (Triton).
- `contiguous b`: stride = slab (what Marlin requires); groups of b are exact when b*P is a
  multiple of G, else a group's last page is shared with the next group.

A group layout makes the group the unit of residency; it pays only when the experts the plan
keeps resident are adjacent ids. `random_set_bytes` prices that: a uniformly random resident set of
fraction f rounded up to whole groups.

Pure arithmetic; `python -m reap_swap.quant_padding` prints the research.md table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

MiB = 2**20
GRANULE = 2 * MiB


@dataclass(frozen=True)
class ExpertFormat:
    """One expert's bytes: the re-homed tensors (w13, w2) and the per-expert bytes kept whole."""

    name: str
    w13: int
    w2: int
    kept: int  # scales, zeros, g_idx, biases: whole in HBM for every expert
    kernel: str  # "strided" (Triton) or "contiguous" (Marlin) or "opaque"

    @property
    def ideal(self) -> int:
        return self.w13 + self.w2


def qwen3_30b_formats(hidden: int = 2048, inter: int = 768) -> list[ExpertFormat]:
    """Per-expert bytes after vLLM 0.26's process_weights_after_loading on SM90, TP=1."""
    h, n = hidden, inter
    g13, g2 = h // 128, n // 128  # int4 group-128 groups along K
    bf16 = ExpertFormat("bf16 (Triton)", 2 * n * h * 2, h * n * 2, 0, "strided")
    fp8b = ExpertFormat(
        "FP8 block 128x128 (Triton)",
        2 * n * h,
        h * n,
        4 * (math.ceil(2 * n / 128) * math.ceil(h / 128) + math.ceil(h / 128) * math.ceil(n / 128)),
        "strided",
    )
    fp8c = ExpertFormat("FP8 channel, CT (Triton)", 2 * n * h, h * n, 4 * (2 * n + h), "strided")
    fp8t = ExpertFormat("FP8 tensor / online fp8 (Triton)", 2 * n * h, h * n, 4 * 2, "strided")
    int4_scales = 2 * (2 * n * g13 + h * g2)  # bf16/fp16 group scales
    int4_zeros = (2 * n * g13 + h * g2) // 2  # packed 4-bit zero points (AWQ)
    # every INT4 path is contiguous: Marlin, and moe_wna16's CUDA kernel (decode) as well
    int4 = ExpertFormat(
        "INT4 g128 AWQ/GPTQ/CT (Marlin; moe_wna16)", n * h, h * n // 2, int4_scales + int4_zeros, "contiguous"
    )
    mx_scales = 2 * n * (h // 32) + h * (n // 32)  # e8m0 per 32 values
    mxfp4 = ExpertFormat("MXFP4 (Marlin)", n * h, h * n // 2, mx_scales + 2 * (2 * n + h), "contiguous")
    return [bf16, fp8b, fp8c, fp8t, int4, mxfp4]


def private_bytes(fmt: ExpertFormat, g: int = GRANULE) -> int:
    """Today's unit: w13 + w2 of one expert padded to the granularity (strided kernels only)."""
    return -(-fmt.ideal // g) * g


def per_expert_bytes(fmt: ExpertFormat, g: int = GRANULE) -> float:
    """One expert resident on its own: today's private unit, or -- for a contiguous kernel, which
    allows no padding -- the pages its unpadded slabs touch (a shared page counted whole)."""
    if fmt.kernel == "contiguous":
        return float(group_bytes_per_expert(fmt, 1, g))
    return float(private_bytes(fmt, g))


def group_stride(payload: int, b: int, g: int = GRANULE) -> Fraction:
    """Smallest stride s = g*a/b >= payload: b experts then fill exactly a pages."""
    return Fraction(g * -(-payload * b // g), b)


def _pages_touched(start: int, length: int, g: int) -> int:
    return (start + length - 1) // g - start // g + 1


def contiguous_group_pages(payload: int, b: int, num_experts: int, g: int = GRANULE) -> Fraction:
    """Mean pages one isolated group of b experts touches when the stride is the payload."""
    groups = max(num_experts // b, 1)
    total = sum(_pages_touched(k * b * payload, b * payload, g) for k in range(groups))
    return Fraction(total, groups)


def group_bytes_per_expert(fmt: ExpertFormat, b: int, g: int = GRANULE, num_experts: int = 128) -> Fraction:
    """HBM per expert when groups of b consecutive experts are resident together (a group whose
    pages it shares with a non-resident neighbour pays for those pages alone)."""
    if fmt.kernel == "contiguous":  # stride = payload, as Marlin requires
        pages = sum(contiguous_group_pages(p, b, num_experts, g) for p in (fmt.w13, fmt.w2))
        return pages * g / b
    return group_stride(fmt.w13, b, g) + group_stride(fmt.w2, b, g)


def straddle_random_bytes(fmt: ExpertFormat, f: float, num_experts: int = 128, g: int = GRANULE) -> float:
    """Per-expert residency over a contiguous layout (stride = payload): a page is in HBM when
    any expert overlapping it is resident. HBM per resident expert for a random set of fraction f."""
    total = 0.0
    for payload in (fmt.w13, fmt.w2):
        pages = -(-payload * num_experts // g)
        for page in range(pages):
            lo, hi = page * g, (page + 1) * g
            overlapping = min(hi - 1, payload * num_experts - 1) // payload - lo // payload + 1
            total += g * (1 - (1 - f) ** overlapping)
    return total / (f * num_experts)


def smallest_group(fmt: ExpertFormat, max_waste: float = 0.12, g: int = GRANULE) -> int:
    """Smallest power-of-two group size whose padding waste stays under max_waste."""
    b = 1
    while b <= 64:
        if float(group_bytes_per_expert(fmt, b, g)) <= fmt.ideal * (1 + max_waste):
            return b
        b *= 2
    return 0


def random_set_bytes(fmt: ExpertFormat, b: int, f: float, g: int = GRANULE) -> float:
    """HBM per *wanted* expert for a random resident set of fraction f rounded up to groups of b
    (each expert independently resident with probability f)."""
    groups_touched = 1 - (1 - f) ** b  # per group
    return float(group_bytes_per_expert(fmt, b, g)) * b * groups_touched / (b * f)


def experts_per_gib(bytes_per_expert: float) -> float:
    return 2**30 / bytes_per_expert


def table_rows(formats: list[ExpertFormat] | None = None) -> list[dict]:
    rows = []
    for fmt in formats or qwen3_30b_formats():
        b = smallest_group(fmt)
        priv = per_expert_bytes(fmt)
        grp = float(group_bytes_per_expert(fmt, b)) if b else float("nan")
        rows.append(
            {
                "format": fmt.name,
                "ideal_mib": fmt.ideal / MiB,
                "kept_kib": fmt.kept / 1024,
                "private_mib": priv / MiB,
                "private_waste": priv / fmt.ideal - 1,
                "group": b,
                "group_mib": grp / MiB,
                "group_waste": grp / fmt.ideal - 1,
                "ideal_per_gib": experts_per_gib(fmt.ideal),
                "private_per_gib": experts_per_gib(priv),
                "group_per_gib": experts_per_gib(grp),
                "random50_group_mib": random_set_bytes(fmt, b, 0.5) / MiB if b else float("nan"),
                "random25_group_mib": random_set_bytes(fmt, b, 0.25) / MiB if b else float("nan"),
                "straddle50_mib": straddle_random_bytes(fmt, 0.5) / MiB,
            }
        )
    return rows


def table_markdown(rows: list[dict] | None = None) -> str:
    head = (
        "| format | ideal MiB | kept whole KiB/expert | one expert alone MiB | waste | group b < 12 % | "
        "group MiB/expert | waste | experts/GiB ideal / today / group | random set f=0.5 / 0.25, "
        "group layout, MiB per wanted expert | straddle f=0.5 MiB |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows or table_rows():
        lines.append(
            f"| {r['format']} | {r['ideal_mib']:.2f} | {r['kept_kib']:.1f} | {r['private_mib']:.2f} | "
            f"{r['private_waste']:.1%} | {r['group']} | {r['group_mib']:.2f} | {r['group_waste']:.1%} | "
            f"{r['ideal_per_gib']:.0f} / {r['private_per_gib']:.0f} / {r['group_per_gib']:.0f} | "
            f"{r['random50_group_mib']:.2f} / {r['random25_group_mib']:.2f} | {r['straddle50_mib']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - prints the table for research.md
    print(table_markdown())
