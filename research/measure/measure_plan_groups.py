"""HBM per wanted expert and held-out coverage with and without group-aware planning (issue 16 Padding).

    PYTHONPATH=$PWD .venv/bin/python research/measure/measure_plan_groups.py     # ~10 s, CPU, pure arithmetic

Writes research-notes/plangroup/plangroup.{json,md} (the research.md "plangroup" tables).

What is measured (derived, exact arithmetic of `group_layout.set_cost` -- the HBM the grouped
engine takes for a resident set: the groups its wanted experts touch in the plan's physical order):

1. Mini MoE (4 layers x 16 experts, top-2), its routing from the committed traces
   (data/traces/mini-moe-{calibration,heldout}.npz), experts *priced as Qwen3-30B-A3B's*
   (hidden 2048, moe_intermediate 768) in FP8 block 128x128 and in bf16 -- the mini's own 72 KiB
   experts are far below one 2 MiB page, so their page arithmetic says nothing. Plans are built by
   the planner API on observations counted from the calibration trace (frequency + co-activation)
   at --budget-ratio 0.25 / 0.5: today's planner (no --group-size), --group-size auto, and
   --group-size auto at the HBM today's plan really takes on the grouped engine (rounding alone,
   pricing held equal). Coverage: `evaluate.evaluate` on the held-out trace (core share of routed
   selections; core + best slices per request).
2. The shipped plans/reap-mini-moe.plan.json (made by vLLM observe, not from the trace), same price.
3. The field plan ../shared/fixtures/strict30-v2-plan.json (Qwen3.5-35B-A3B, 256 experts, core 49,
   slices 25 x 8 + 7, bf16 experts 4 + 2 MiB; also as if FP8, 2 + 1 MiB). It carries no per-expert
   scores, so its group-aware version is a post-hoc regroup: the core's boundary group is filled
   from the top slice (catalog order = activation mass, the best ranking the file has) and the rest
   re-cut in catalog order into slices of 8. HBM only (no held-out data for that model).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import orjson

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from reap_swap.cache.trace import load_trace  # noqa: E402
from reap_swap.plan.document import load_plan, validate_plan_document  # noqa: E402
from reap_swap.planner.build import PlannerConfig, build_plan  # noqa: E402
from reap_swap.planner.evaluate import evaluate  # noqa: E402
from reap_swap.planner.groups import group_pricing  # noqa: E402
from reap_swap.planner.observation_types import LayerStats, Observations, RecordCounts  # noqa: E402
from reap_swap.sizing.groups import Permutation, physical_order, plan_groups, set_cost  # noqa: E402
from reap_swap.sizing.model_shape import read_model_shape  # noqa: E402

MiB = 2**20
OUT = ROOT / "research-notes" / "plangroup"
FIELD = ROOT.parent / "shared" / "fixtures" / "strict30-v2-plan.json"
FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}


def shape_of(config_path: Path, hidden: int | None, inter: int | None, quant: dict | None):
    cfg = orjson.loads(config_path.read_bytes())
    text = cfg.get("text_config", cfg)
    if hidden:
        text.update(hidden_size=hidden, moe_intermediate_size=inter)
    if quant:
        text["quantization_config"] = quant
    return read_model_shape(cfg)


def layer_stats(trace, layer: int, tokens: slice = slice(None)) -> LayerStats:
    ids = trace.topk_ids[tokens, trace.layers.index(layer), :].astype(np.int64)
    e = trace.num_experts
    onehot = np.zeros((ids.shape[0], e), dtype=np.int64)
    np.put_along_axis(onehot, ids, 1, axis=1)
    return LayerStats(
        total_tokens=int(ids.shape[0]),
        expert_frequency=onehot.sum(axis=0),
        coactivation=onehot.T @ onehot,
        raw_key=str(layer),
    )


def trace_observations(trace, label: str) -> Observations:
    return Observations(label, "0" * 64, {l: layer_stats(trace, l) for l in trace.layers}, fmt="reap-swap")


def trace_records(trace) -> RecordCounts:
    """Per held-out request, routed selections per layer and expert (for core + slices coverage)."""
    r = trace.num_requests
    counts = np.zeros((r, len(trace.layers), trace.num_experts), dtype=np.int64)
    tokens = np.zeros(r, dtype=np.int64)
    for q in range(r):
        a = trace.step_offsets[trace.request_offsets[q]]
        b = trace.step_offsets[trace.request_offsets[q + 1]]
        tokens[q] = b - a
        for c, l in enumerate(trace.layers):
            counts[q, c] = layer_stats(trace, l, slice(a, b)).expert_frequency
    tags = tuple(trace.request_tags) if trace.request_tags else ("",) * r
    return RecordCounts(tuple(trace.layers), counts, tags, tokens, np.arange(1, r + 1))


def layer_sets(core, slices, target: int) -> dict[str, list[int]]:
    """Plan-shaped resident sets of one layer: core, core + top slice, core + the specialist
    target in catalog order, core + the last (smallest) slice alone."""
    sets = {"core": list(core)}
    if slices:
        sets["core+top slice"] = [*core, *slices[0]]
        take, n = [], 0
        for s in slices:
            if n + len(s) > target:
                break
            take += s
            n += len(s)
        sets["core+target slices"] = [*core, *take]
        sets["core+last slice"] = [*core, *slices[-1]]
    return sets


def hbm_rows(plan_doc: dict, fmt, b: int) -> dict[str, dict]:
    """Per set kind, over all layers: wanted experts, HBM private / grouped in plan order, MiB per wanted."""
    slabs = (("w13_weight", fmt.w13), ("w2_weight", fmt.w2))
    layers = plan_doc["perLayer"]
    n = next(iter(layers.values()))["numExperts"]
    private, grouped = plan_groups(slabs, n, 1), plan_groups(slabs, n, b)
    acc: dict[str, list[int]] = {}
    for layer in layers.values():
        core, slices = layer["coreExperts"], [s["experts"] for s in layer.get("sliceCatalog", [])]
        perm = Permutation.from_order(physical_order(n, core, slices))
        for label, wanted in layer_sets(core, slices, layer.get("specialistActiveExpertTarget", 0)).items():
            a = acc.setdefault(label, [0, 0, 0, 0])
            g = set_cost(wanted, perm, grouped)
            a[0] += g.wanted
            a[1] += set_cost(wanted, perm, private).hbm_bytes
            a[2] += g.hbm_bytes
            a[3] += g.resident - g.wanted
    return {
        k: {
            "wanted": w,
            "ideal_mib": fmt.ideal / MiB,
            "private_mib": p / w / MiB,
            "grouped_mib": gr / w / MiB,
            "passengers": pa,
            "hbm_bytes": gr,
        }
        for k, (w, p, gr, pa) in acc.items()
    }


def coverage(doc: dict, held, records, b: int) -> dict:
    """Held-out shares (evaluate): the core, core + best slices per request, and the core's groups
    on the engine of b (the core plus the passengers its boundary groups hold: resident too)."""
    stats = {l: layer_stats(held, l) for l in held.layers}
    rep = evaluate(load_plan(doc), stats, records)["overall"]
    grouped = orjson.loads(orjson.dumps(doc))
    for layer in grouped["perLayer"].values():
        n, core = layer["numExperts"], layer["coreExperts"]
        order = physical_order(n, core, [s["experts"] for s in layer.get("sliceCatalog", [])])
        layer["coreExperts"] = sorted(order[: -(-len(core) // b) * b])
        layer.pop("sliceCatalog", None)
        layer.pop("coreByteCost", None)
    for key in ("summary",):
        grouped.pop(key, None)
    grouped["budget"] = {"per_expert_bytes": doc["budget"]["per_expert_bytes"]}
    with_passengers = evaluate(load_plan(grouped), stats)["overall"]["core"]
    return {"core": rep["core"], "core_plus_slices": rep["core_plus_slices"], "core_groups": with_passengers}


def core_hbm(doc: dict, fmt, b: int) -> int:
    """HBM of every layer's core on the grouped engine of b (the core is first in physical order)."""
    gb = plan_groups((("w13_weight", fmt.w13), ("w2_weight", fmt.w2)), 16, b).group_bytes
    return sum(-(-len(v["coreExperts"]) // b) * gb for v in doc["perLayer"].values())


def mini_rows() -> list[dict]:
    cal = load_trace(ROOT / "data/traces/mini-moe-calibration.npz")
    held = load_trace(ROOT / "data/traces/mini-moe-heldout.npz")
    obs, records = trace_observations(cal, "calibration-trace"), trace_records(held)
    rows = []
    config = ROOT / "models/reap-mini-moe/config.json"
    # FP8: auto is b = 2 (11.1 % waste); bf16: auto is b = 1 (private, 11.1 %), b = 2 is exact (0 %)
    for fmt_name, quant, gs in (("FP8 block", FP8, "auto"), ("bf16", None, "2")):
        shape = shape_of(config, 2048, 768, quant)
        b = group_pricing(shape, gs).group_size
        shipped = orjson.loads((ROOT / "plans/reap-mini-moe.plan.json").read_bytes())
        rows.append(_row("mini", fmt_name, "shipped plan (vLLM observe), ratio 0.5", shipped, shape, b))
        for ratio in (0.25, 0.5):
            today = build_plan([obs], shape, PlannerConfig(budget_ratio=ratio), "mini")
            grouped = build_plan([obs], shape, PlannerConfig(budget_ratio=ratio, group_size=gs), "mini")
            rows.append(_row("mini", fmt_name, f"today, ratio {ratio}", today, shape, b, held, records))
            label = f"--group-size {gs}, ratio {ratio}"
            rows.append(_row("mini", fmt_name, label, grouped, shape, b, held, records))
            # rounding alone: the group-aware plan given the HBM today's plan really takes on the
            # grouped engine (core, and core + its specialist target), the same core share of it
            real = rows[-2]
            total = real["sets"]["core+target slices"]["hbm_bytes"]
            cfg = PlannerConfig(
                budget_gib=(total + 64) / 2**30, core_fraction=real["core_hbm_bytes"] / total, group_size=gs
            )
            same = build_plan([obs], shape, cfg, "mini")
            label = f"--group-size {gs} at today's real HBM, ratio {ratio}"
            rows.append(_row("mini", fmt_name, label, same, shape, b, held, records))
    return rows


def _row(model, fmt_name, label, doc, shape, b, held=None, records=None) -> dict:
    report = validate_plan_document(doc)
    assert report.ok, report.format_text()
    cores = [len(v["coreExperts"]) for v in doc["perLayer"].values()]
    row = {
        "model": model,
        "format": fmt_name,
        "plan": label,
        "b": b,
        "core_sizes": cores,
        "slice_sizes": sorted(
            {len(s["experts"]) for v in doc["perLayer"].values() for s in v.get("sliceCatalog", [])}
        ),
        "core_hbm_bytes": core_hbm(doc, shape.expert_format, b),
        "sets": hbm_rows(doc, shape.expert_format, b),
    }
    if held is not None:
        row["coverage"] = coverage(doc, held, records, b)
    return row


def regroup(doc: dict, b: int, up: bool, size: int = 8) -> dict:
    """Post-hoc whole groups for a plan without per-expert scores (module doc, item 3): the core
    rounded up (filled from the top slice) or down (its highest ids -- unranked -- moved to the
    front of the top slice), the rest re-cut in catalog order. The budget keys are dropped: the
    field plan's core budget has no room for +1 expert per layer (40 x 6 MiB)."""
    out = orjson.loads(orjson.dumps(doc))
    for key in ("core_budget_bytes", "swappable_expert_budget_bytes", "specialist_budget_bytes"):
        out["budget"].pop(key, None)
    for layer in out["perLayer"].values():
        rest = [e for s in layer["sliceCatalog"] for e in s["experts"]]
        core = sorted(layer["coreExperts"])
        if up:
            need = -len(core) % b
            core, rest = [*core, *rest[:need]], rest[need:]
        else:
            drop = len(core) % b
            core, rest = core[: len(core) - drop], [*core[len(core) - drop :], *rest]
        layer["coreExperts"] = sorted(core)
        cut = [rest[k : k + size] for k in range(0, len(rest), size)]
        layer["sliceCatalog"] = [
            {"sliceId": f"{s['sliceId']}", "experts": sorted(c)} for s, c in zip(layer["sliceCatalog"], cut)
        ]
        layer.pop("coreByteCost", None)
    out.pop("summary", None)
    out["groupSize"] = b
    return out


def field_rows() -> list[dict]:
    if not FIELD.exists():
        return []
    doc = orjson.loads(FIELD.read_bytes())
    config = ROOT / "tests/data/qwen3_5_moe_35b_a3b_config.json"
    rows = []
    for fmt_name, quant in (("bf16", None), ("as if FP8 block", FP8)):
        shape = shape_of(config, None, None, quant)
        b = max(group_pricing(shape, "auto").group_size, 2)
        for label, d in (
            ("as shipped", doc),
            (f"regrouped to b = {b}, core up", regroup(doc, b, True)),
            (f"regrouped to b = {b}, core down", regroup(doc, b, False)),
        ):
            rows.append(_row("strict30-v2 (Qwen3.5-35B-A3B)", fmt_name, label, d, shape, b))
    return rows


SETS = ("core", "core+top slice", "core+target slices", "core+last slice")


def markdown(rows: list[dict]) -> str:
    """Table 1: MiB per wanted expert on the grouped engine (passengers); table 2: mini coverage."""
    lines = [
        "| model | format | plan | b | core sizes | slice sizes | ideal | private | "
        + " | ".join(SETS)
        + " |",
        "|---|---|---|---|---|---|---|---|" + "---|" * len(SETS),
    ]
    for r in rows:
        first = next(iter(r["sets"].values()))
        cells = [
            f"{r['sets'][k]['grouped_mib']:.2f} ({r['sets'][k]['passengers']})" if k in r["sets"] else "-"
            for k in SETS
        ]
        lines.append(
            f"| {r['model']} | {r['format']} | {r['plan']} | {r['b']} | "
            f"{','.join(map(str, sorted(set(r['core_sizes']))))} | {','.join(map(str, r['slice_sizes']))} | "
            f"{first['ideal_mib']:.2f} | {first['private_mib']:.2f} | " + " | ".join(cells) + " |"
        )
    lines += [
        "",
        "| format | plan | core experts | core HBM MiB | core + target slices: experts, HBM MiB | "
        "held-out: core | core's groups (+ passengers) | core + slices per request |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "coverage" not in r:
            continue
        t, c = r["sets"]["core+target slices"], r["coverage"]
        lines.append(
            f"| {r['format']} | {r['plan']} | {sum(r['core_sizes'])} | {r['core_hbm_bytes'] / MiB:.0f} | "
            f"{t['wanted']}, {t['hbm_bytes'] / MiB:.0f} | {c['core']:.1%} | {c['core_groups']:.1%} | "
            f"{c['core_plus_slices']:.1%} |"
        )
    return "\n".join(lines)


def main() -> int:
    rows = mini_rows() + field_rows()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "plangroup.json").write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2) + b"\n")
    md = markdown(rows)
    (OUT / "plangroup.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
