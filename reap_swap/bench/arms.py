"""The servers one bench starts: an arm at a budget (RunSpec), with its exact command line.

Several budgets run the budget-dependent arms once each; plan-swap at a budget other than the
plan's gets a copy of the plan with that budget, so the CUDA engine's HBM pool has that size too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import orjson
from pydantic import BaseModel, Field

from reap_swap.bench.config import BUDGET_ARMS, CACHE_ARMS, NO_CUDA, BenchConfig, BenchError, has_flag
from reap_swap.bench.report import GIB, uva_offloaded_bytes
from reap_swap.sizing.cache_tail import plan_swap_split


def derived_plan(plan_path: Path, budget_bytes: int, outdir: Path, shape) -> Path:
    """A copy of the plan whose swappable budget is ``budget_bytes`` (validated), for one budget.

    Cartridges are dropped from the copy (the bench never uses them and they may not fit)."""
    from reap_swap.plan.document import PlanError, load_plan, read_plan_document

    doc = read_plan_document(plan_path)
    doc.pop("cartridges", None)
    budget = dict(doc.get("budget") or {})
    budget["swappable_expert_budget_bytes"] = int(budget_bytes)
    if "core_budget_bytes" in budget and "specialist_budget_bytes" in budget:
        budget["specialist_budget_bytes"] = max(0, int(budget_bytes) - int(budget["core_budget_bytes"]))
    for key in ("core_budget_fraction", "specialist_budget_fraction"):
        budget.pop(key, None)
    doc["budget"] = budget
    outdir.mkdir(parents=True, exist_ok=True)
    path = outdir / f"{plan_path.stem}-budget-{budget_bytes}.json"
    path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
    try:
        load_plan(str(path), shape)
    except PlanError as exc:
        raise BenchError(
            f"the plan with a budget of {budget_bytes:,} bytes is invalid:\n{exc.report.format_text()}"
        ) from None
    return path


class RunSpec(BaseModel):
    """One server to start: an arm at a budget."""

    arm: str
    label: str
    budget_bytes: int | None
    budget_dependent: bool
    argv: list[str] = Field(default_factory=list)
    plan_path: Path | None = None
    skip_reason: str | None = None
    notes: list[str] = Field(default_factory=list)
    swap_budget_bytes: int | None = None  # plan-swap+cache: the client's selection budget (K slots)

    @property
    def client_budget_bytes(self) -> int | None:
        """What the swapping client selects within: the swap table's K where the cache takes a tail
        (plan-swap+cache), else the arm's budget (None: the plan's)."""
        return self.swap_budget_bytes if self.swap_budget_bytes is not None else self.budget_bytes


def plan_runs(
    cfg: BenchConfig, plan, shape, total_expert_bytes: int, plat: str, timing_on: bool
) -> list[RunSpec]:
    """The servers to start, in order, each with its exact command (or why it is skipped)."""
    budgets = [int(g * GIB) for g in cfg.budget_gib] if cfg.budget_gib else [plan.swappable_budget_bytes]
    several = len(budgets) > 1
    common = _common_engine_args(cfg, plat)
    from reap_swap.compat.serve import STOCK_SERVER_MODULE

    stock = [sys.executable, "-m", STOCK_SERVER_MODULE, "--model", cfg.model, *common]
    reap = [sys.executable, "-m", "reap_swap.server", cfg.model, *common]
    runs: list[RunSpec] = []
    for arm in cfg.arms:
        for budget in budgets if arm in BUDGET_ARMS else [None]:
            label = f"{arm}@{budget / GIB:.4g}GiB" if several and budget is not None else arm
            spec = RunSpec(arm=arm, label=label, budget_bytes=budget, budget_dependent=arm in BUDGET_ARMS)
            if arm == "resident":
                spec.argv = stock
                if plat != "cuda" and not timing_on:
                    spec.skip_reason = NO_CUDA.format(platform=plat, what="the timing arm 'resident'")
            elif arm == "stock-uva":
                _stock_uva(spec, stock, shape, total_expert_bytes, plat)
            else:
                _reap_arm(spec, reap, cfg, plan, shape, plat)
            runs.append(spec)
    return runs


def _common_engine_args(cfg: BenchConfig, plat: str) -> list[str]:
    """The engine args every arm gets: the user's, plus what makes the arms comparable."""
    common = list(cfg.engine_args)
    if not has_flag(common, "--host"):
        common += ["--host", "127.0.0.1"]
    if not cfg.prefix_caching and not has_flag(
        common, "--enable-prefix-caching", "--no-enable-prefix-caching"
    ):
        # the same prompts are sent many times: a cached prefix would shorten prefills and router counts
        common += ["--no-enable-prefix-caching"]
    if plat == "cuda" and not has_flag(common, "--moe-backend"):
        common += [
            "--moe-backend",
            "triton",
        ]  # what the reap launcher uses on CUDA: same kernels in every arm
    return common


def _stock_uva(spec: RunSpec, stock: list[str], shape, total_expert_bytes: int, plat: str) -> None:
    """Stock UVA offload of whatever expert bytes do not fit the budget."""
    offload = max(0, total_expert_bytes - spec.budget_bytes)
    spec.argv = stock + [
        "--offload-backend",
        "uva",
        "--cpu-offload-gb",
        f"{offload / GIB:.6f}",
        "--cpu-offload-params",
        "w13_weight",
        "w2_weight",
    ]
    if plat != "cuda":
        spec.skip_reason = NO_CUDA.format(platform=plat, what="UVA offload ('stock-uva')")
    else:  # vLLM 0.26.0's Model Runner V2 ignores --cpu-offload-gb (compat/runner.py)
        from reap_swap.compat.runner import offload_ignored_reason

        ignored = offload_ignored_reason([shape.architecture])
        if ignored:
            spec.skip_reason = f"stock-uva refused: {ignored}, so this arm would not hold the budget's VRAM"
    moved = uva_offloaded_bytes([shape.layer_expert_bytes] * len(shape.moe_layers), offload)
    spec.notes.append(
        f"asks to offload {offload / GIB:.4f} GiB of {total_expert_bytes / GIB:.4f} GiB "
        f"of experts; whole parameters move: {moved / GIB:.4f} GiB"
    )


def _split_for_swaps(spec: RunSpec, plan, shape) -> None:
    """plan-swap+cache: ``--reap-cache-slots swaps`` (cache_tail.plan_swap_split) and the client's selection
    budget cut to the swap table K that leaves, so the per-request swaps fit (with the default
    ``--reap-cache-slots auto`` the tail takes everything beyond the core and the device refuses
    every swap that adds an expert: research.md "acctail")."""
    per_expert = int(plan.per_expert_bytes)
    split = plan_swap_split(plan, int(shape.top_k), spec.budget_bytes)
    if split.why:
        spec.skip_reason = f"plan-swap+cache: {split.why}"
        return
    spec.argv += ["--reap-cache-slots", "swaps"]  # the server resolves it to the same split (launcher)
    spec.swap_budget_bytes = split.kept * per_expert
    spec.notes.append(
        f"--reap-cache-slots swaps = {split.cache_slots}: a tail of {split.per_layer} per layer; the client selects "
        f"within the swap table's {split.kept} of {split.pool} slots ({split.kept * per_expert / GIB:.3f} GiB)"
    )


def _reap_arm(spec: RunSpec, reap: list[str], cfg: BenchConfig, plan, shape, plat: str) -> None:
    """A reap arm: the plan (or its copy at this budget); refused when the budget lacks the core.

    A cache arm on CUDA also gets --reap-cache-device as configured (cfg.cache_device), spelled out
    so the arm measures what it names whatever the server's default."""
    budget = spec.budget_bytes
    if budget is not None and budget < plan.core_bytes():
        raise BenchError(
            f"budget {budget / GIB:.4g} GiB ({budget:,} bytes) does not hold the "
            f"plan's core ({plan.core_bytes():,} bytes)"
        )
    if budget is not None and budget != plan.swappable_budget_bytes:
        spec.plan_path = derived_plan(cfg.plan, budget, cfg.out / "plans", shape)
    else:
        spec.plan_path = cfg.plan.resolve()
    spec.argv = reap + ["--reap-plan", str(spec.plan_path), "--reap-cache", CACHE_ARMS[spec.arm]]
    if CACHE_ARMS[spec.arm] != "off" and plat == "cuda":
        spec.argv += ["--reap-cache-device", cfg.cache_device]
        if cfg.cache_device == "on":
            spec.notes.append("--reap-cache-device on: the device cache (CUDA)")
    if spec.arm == "plan-swap+cache":
        _split_for_swaps(spec, plan, shape)
    if spec.arm == "plan-static":
        spec.budget_bytes = None
