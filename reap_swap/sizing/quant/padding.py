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

Pure arithmetic; `python -m reap_swap.sizing.quant.padding` prints the research.md table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from reap_swap.sizing.quant.scheme import QuantScheme
from reap_swap.sizing.unit_layout import round_up

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


def expert_format(
    scheme: QuantScheme, hidden: int, inter: int, dtype_bytes: int = 2, bias: bool = False, name: str = ""
) -> ExpertFormat:
    """One expert's bytes after vLLM 0.26's process_weights_after_loading on SM90, TP=1: the
    re-homed w13 ([2I, H]) and w2 ([H, I]) as stored, and the per-expert bytes kept whole (scales,
    zero points, biases). `dtype_bytes` is the model dtype (biases, INT4 group scales)."""
    h, n = hidden, inter
    biases = (2 * n + h) * dtype_bytes if bias else 0
    if scheme.kind == "unquantized":
        return ExpertFormat(
            name or "unquantized", 2 * n * h * dtype_bytes, h * n * dtype_bytes, biases, "strided"
        )
    if scheme.kind == "fp8":
        if scheme.strategy == "block" and scheme.block:
            bn, bk = scheme.block
            scales = math.ceil(2 * n / bn) * math.ceil(h / bk) + math.ceil(h / bn) * math.ceil(n / bk)
        elif scheme.strategy == "channel":
            scales = 2 * n + h
        else:  # tensor (checkpoint or online): one f32 per projection
            scales = 2
        return ExpertFormat(name or "fp8", 2 * n * h, h * n, 4 * scales + biases, "strided")
    if scheme.kind == "int" and scheme.bits in (4, 8):
        g = scheme.group_size or max(h, n)  # channel-wise: one group spans K
        groups = 2 * n * math.ceil(h / g) + h * math.ceil(n / g)
        kept = dtype_bytes * groups + groups * scheme.bits // 8 + biases  # scales + packed zeros
        # every INT4 path is contiguous: Marlin, and moe_wna16's CUDA kernel (decode) as well
        bits = scheme.bits
        return ExpertFormat(name or "int", 2 * n * h * bits // 8, h * n * bits // 8, kept, "contiguous")
    if scheme.kind == "mxfp4":
        scales = 2 * n * (h // 32) + h * (n // 32)  # e8m0 per 32 values
        return ExpertFormat(name or "mxfp4", n * h, h * n // 2, scales + biases, "contiguous")
    raise ValueError(f"no per-expert byte model for quantization {scheme}")


def qwen3_30b_formats(hidden: int = 2048, inter: int = 768) -> list[ExpertFormat]:
    """Per-expert bytes of the quantized formats at Qwen3-30B-A3B shape (the research.md table)."""
    h, n = hidden, inter
    return [
        expert_format(QuantScheme("unquantized", 16, "none"), h, n, name="bf16 (Triton)"),
        expert_format(
            QuantScheme("fp8", 8, "block", block=(128, 128)), h, n, name="FP8 block 128x128 (Triton)"
        ),
        expert_format(QuantScheme("fp8", 8, "channel"), h, n, name="FP8 channel, CT (Triton)"),
        expert_format(QuantScheme("fp8", 8, "tensor"), h, n, name="FP8 tensor / online fp8 (Triton)"),
        expert_format(
            QuantScheme("int", 4, "group", group_size=128),
            h,
            n,
            name="INT4 g128 AWQ/GPTQ/CT (Marlin; moe_wna16)",
        ),
        expert_format(
            QuantScheme("mxfp4", 4, "group", group_size=32), h, n, bias=True, name="MXFP4 (Marlin)"
        ),
    ]


def private_bytes(fmt: ExpertFormat, g: int = GRANULE) -> int:
    """Today's unit: w13 + w2 of one expert padded to the granularity (strided kernels only)."""
    return round_up(fmt.ideal, g)


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
