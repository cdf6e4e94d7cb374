"""What plan validation found: PlanIssue (path + message), ValidationReport, PlanError."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

GIB = 1 << 30


class PlanIssue(NamedTuple):
    path: str  # JSON path such as "perLayer.layer_5.sliceCatalog[3].experts[2]"; "$" is the root
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


@dataclass(frozen=True)
class ValidationReport:
    errors: tuple[PlanIssue, ...]
    warnings: tuple[PlanIssue, ...]
    summary: Mapping[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "errors": [{"path": i.path, "message": i.message} for i in self.errors],
            "warnings": [{"path": i.path, "message": i.message} for i in self.warnings],
            "summary": dict(self.summary),
        }

    def format_text(self) -> str:
        lines = [f"error   {issue}" for issue in self.errors]
        lines += [f"warning {issue}" for issue in self.warnings]
        lines.append(
            f"{'INVALID' if self.errors else 'valid'}: "
            f"{len(self.errors)} error(s), {len(self.warnings)} warning(s)"
        )
        lines += _format_summary(self.summary)
        return "\n".join(lines)


class PlanError(ValueError):
    """Raised by load_plan for a plan that does not validate; carries the full report."""

    def __init__(self, report: ValidationReport):
        self.report = report
        first = "; ".join(str(i) for i in report.errors[:3])
        more = f" (+{len(report.errors) - 3} more)" if len(report.errors) > 3 else ""
        super().__init__(f"invalid plan: {first}{more}")


def _format_summary(s: Mapping[str, Any]) -> list[str]:
    if not s:
        return []

    def size(n: int) -> str:
        return f"{n:,} B ({n / GIB:.2f} GiB)"

    per_layer = s.get("experts_per_layer")
    per_layer = ", ".join(map(str, per_layer)) if isinstance(per_layer, list) else per_layer
    rows = [
        ("model", s.get("model") or "-"),
        ("identity", s.get("identity") or "-"),
        ("layers", f"{s['layers']:,}"),
        ("experts per layer", per_layer),
        ("core experts", f"{s['core_experts']:,}"),
        ("slices", f"{s['slices']:,}"),
        ("per-expert bytes", f"{s['per_expert_bytes']:,}" if s.get("per_expert_bytes") else "-"),
    ]
    budget = s.get("swappable_budget_bytes")
    if s.get("per_expert_bytes"):
        resident = f"core {size(s['core_bytes'])}"
        if budget:
            resident += f" of budget {size(budget)} ({100 * s['core_bytes'] / budget:.1f} %)"
        rows.append(("resident bytes", resident))
        rows.append(("core ∪ slices bytes", size(s["candidate_bytes"])))
    if s.get("total_experts"):
        rows.append(
            (
                "coverage",
                f"{s['covered_experts']:,} of {s['total_experts']:,} experts in core ∪ "
                f"slices ({100 * s['coverage']:.1f} %)",
            )
        )
    return ["summary:"] + [f"  {name:<20} {value}" for name, value in rows]
