"""`reap-swap bench`: is a plan worth it on this machine? One server per arm, same prompts, one report.

Arms (each its own server, started, measured and stopped in turn; never two at once):
  resident     stock vLLM, every expert in GPU memory
  stock-uva    stock vLLM UVA offload giving experts the same GPU memory as the budget:
               --offload-backend uva --cpu-offload-gb <expert GiB - budget GiB>
               --cpu-offload-params w13_weight w2_weight (whole parameters, layer by layer)
  plan-static  python -m reap_swap.server with the plan: core resident, no swaps
  plan-swap    the same with the client's per-request selection (--strategy), swapped in per request
  plan-cache   the plan with the expert cache (--reap-cache lfu), plain client: no set changes
  plan-swap+cache  per-request swaps and the cache (the swapped set pinned, the tail adapting)
  (plan-static and plan-swap run with --reap-cache off, so they keep their meaning)
Several --budget-gib values run stock-uva and plan-swap once per budget (plan-swap with a copy of
the plan whose budget is that value, so the CUDA engine's HBM pool has that size too).

Per arm: one warm-up request (discarded); greedy chat completions of every prompt (outputs compared
with the reference arm per prompt; for the reap arms each prompt is its own request id, so the hit
rate comes from the server's GET /router_misses counters); then, when timing is on, --repeats
single-stream and --batch concurrent streamed requests (TTFT, prefill tok/s, decode tok/s), swap
latency and bytes from the swap responses, peak GPU memory from nvidia-smi sampled while the arm
runs (plus the weights vLLM logs). Medians with min-max; ratios between arms from the same run.
Stock arms have no counters: `resident` hits every expert; `stock-uva`'s hit rate is derived from
the parameters it keeps on the GPU (each MoE layer routes top_k selections per token, so the
fraction of selections served from GPU memory is the resident fraction of expert bytes).

Without CUDA (vLLM's CPU build) timing is off: `resident` and `stock-uva` are skipped with a message
and the reap arms run in accounting mode (real router statistics and outputs, no bytes move).
`--timings on` measures timings anyway (CPU numbers, labelled so).

Output (--out DIR): bench.json (every raw number), bench.md (table), bench.png (plot), the
servers' logs under DIR/logs, derived plans under DIR/plans.

usage: reap-swap bench --model M --plan P --prompts FILE [--arms a,b] [--budget-gib G ...]
       [--batch N] [--repeats R] [--out DIR] [-- vLLM engine args]
"""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reap_swap.bench import server_driver as serving
from reap_swap.bench.arms import RunSpec, plan_runs
from reap_swap.bench.config import REAP_ARMS, BenchConfig, BenchError, flag_value, load_prompts
from reap_swap.bench.env import GpuMemorySampler, MeasureLock, environment, log_numbers
from reap_swap.bench.measure import ArmRunner, arm_strategy, served_model_id
from reap_swap.bench.merge import compare_outputs, write_outputs
from reap_swap.bench.report import GIB, cache_hit_ratio, pooled_hit_rate, summarize_runs, uva_offloaded_bytes


@dataclass
class _Session:
    """What every arm of one bench shares: the config, the model, the platform, the progress bar."""

    cfg: BenchConfig
    shape: Any
    plat: str
    timing_on: bool
    api_key: str | None
    headers: dict[str, str]
    prompts: list[dict]
    bar: Any
    say: Callable[[str], None]


def run_bench(cfg: BenchConfig, argv: Sequence[str] | None = None) -> int:
    """Run every arm in turn and write bench.json / bench.md / bench.png under cfg.out."""
    from reap_swap.plan.document import PlanError, load_plan
    from reap_swap.sizing.model_shape import ModelShapeError, read_model_shape

    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    cfg.out.mkdir(parents=True, exist_ok=True)
    try:
        shape = read_model_shape(cfg.model)
        plan = load_plan(str(cfg.plan), shape)
        prompts = load_prompts(cfg.prompts, cfg.max_prompts, cfg.prompt_chars)
    except (ModelShapeError, PlanError, BenchError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    env = environment()
    timing_on, timing_note = _timing(cfg, env)
    try:
        runs = plan_runs(cfg, plan, shape, shape.total_expert_bytes, env["platform"], timing_on)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = _report_head(cfg, argv, started, env, shape, plan, prompts)
    report["timing"] = {"measured": timing_on, "note": timing_note}
    report["prompts"] = [
        {k: p[k] for k in ("index", "line", "tag", "preview")} | {"messages": p["messages"]} for p in prompts
    ]
    report["runs"] = []
    session = _session(cfg, shape, env["platform"], timing_on, prompts, runs)
    failed, reference = _run_arms(session, runs, report["runs"])
    report["finished_at"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    report["summary"] = summarize_runs(report["runs"], reference)
    write_outputs(report, cfg.out)
    print(
        f"bench: {cfg.out / 'bench.md'}, {cfg.out / 'bench.json'}, {cfg.out / 'bench.png'}"
        + (f"; {failed} arm(s) failed" if failed else ""),
        file=sys.stderr,
    )
    return 1 if failed else 0


def _timing(cfg: BenchConfig, env: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether timings are measured on this machine, and the note that says so in the report."""
    plat = env["platform"]
    timing_on = cfg.timings == "on" or (cfg.timings == "auto" and plat == "cuda")
    timing_note = (
        "measured on " + env["device"]
        if timing_on and plat == "cuda"
        else f"measured on the CPU ({env['device']}): not GPU numbers"
        if timing_on
        else f"not measured: no CUDA device (vLLM {plat} build); hit rates and outputs only"
        if cfg.timings == "auto"
        else "not measured (--timings off)"
    )
    return timing_on, timing_note


def _report_head(cfg: BenchConfig, argv, started: str, env, shape, plan, prompts) -> dict[str, Any]:
    """The report's fixed part: the command, the machine, the model, the plan, the config, the prompts."""
    argv = list(sys.argv if argv is None else argv)
    command = (
        "reap-swap " + shlex.join(argv[1:])
        if argv and (Path(argv[0]).name == "reap-swap" or Path(argv[0]).parent.name == "cli")
        else shlex.join(argv)
    )
    return {
        "schema": "reap-swap-bench/1",
        "command": command,
        "argv": argv,
        "started_at": started,
        "environment": env,
        "model": {
            "path": cfg.model,
            "shape": {
                **shape.__dict__,
                "moe_layers": list(shape.moe_layers),
                "expert_bytes": shape.expert_bytes,
            },
            "total_expert_bytes": shape.total_expert_bytes,
        },
        "plan": {
            "path": str(cfg.plan),
            "identity": plan.identity,
            "core_bytes": plan.core_bytes(),
            "budget_bytes": plan.swappable_budget_bytes,
            "per_expert_bytes": plan.per_expert_bytes,
        },
        "config": {**cfg.model_dump(mode="json"), "prompt_count": len(prompts)},
    }


def _session(cfg: BenchConfig, shape, plat: str, timing_on: bool, prompts, runs) -> _Session:
    """The shared state of the arms, with a progress bar over every step of the arms that run."""
    from tqdm import tqdm

    api_key = flag_value(cfg.engine_args, "--api-key")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    steps_per_run = 2 + len(prompts) + (2 * cfg.repeats if timing_on else 0)
    bar = tqdm(
        total=steps_per_run * len([r for r in runs if r.skip_reason is None]),
        desc="bench",
        unit="step",
        disable=not cfg.progress,
        file=sys.stderr,
        dynamic_ncols=True,
    )

    def say(message: str) -> None:  # above the progress bar, on stderr like the bar
        (tqdm.write if cfg.progress else print)(message, file=sys.stderr)

    return _Session(cfg, shape, plat, timing_on, api_key, headers, prompts, bar, say)


def _run_arms(s: _Session, runs: Sequence[RunSpec], records: list[dict]) -> tuple[int, str | None]:
    """Each arm in turn (one server at a time), recorded into `records`; (failures, reference label)."""
    reference: str | None = None
    ref_outputs: list[dict] | None = None
    failed = 0
    for spec in runs:
        run: dict[str, Any] = {
            "arm": spec.arm,
            "label": spec.label,
            "budget_bytes": spec.budget_bytes,
            "budget_dependent": spec.budget_dependent,
            "reap": spec.arm in REAP_ARMS,
            "notes": spec.notes,
            "plan_path": str(spec.plan_path) if spec.plan_path else None,
        }
        if spec.arm == "plan-static":
            run["budget_note"] = "core"
        records.append(run)
        if spec.skip_reason:
            run.update(status="skipped", reason=spec.skip_reason)
            s.say(f"[bench] {spec.label}: skipped: {spec.skip_reason}")
            continue
        s.bar.set_description(spec.label)
        log_info = _measure_arm(s, spec, run)
        if run.get("status") != "ok":
            failed += 1
            continue
        run["hit_rate"] = _hit_rate(s, spec, run, log_info)
        if ref_outputs is None:
            reference, ref_outputs = spec.label, run["greedy"]
        run["greedy_vs_ref"] = compare_outputs(ref_outputs, run["greedy"])
        s.say(
            f"[bench] {spec.label}: hit rate {run['hit_rate'].get('hit_rate')}, greedy = {reference}: "
            f"{run['greedy_vs_ref']['identical']}/{run['greedy_vs_ref']['of']}"
        )
    s.bar.close()
    return failed, reference


def _measure_arm(s: _Session, spec: RunSpec, run: dict[str, Any]) -> dict:
    """Start the arm's server, measure it, stop it; records into `run`; returns the log's numbers."""
    from reap_swap.client.reap_client import ReapClient

    srv = serving.Server(
        spec.label,
        spec.argv,
        s.cfg.out / "logs",
        port=serving.free_port(),
        startup_timeout_s=s.cfg.startup_timeout_s,
        headers=s.headers,
        announce=lambda m: s.say(f"[bench] {m}"),
    )
    run["server"] = {"argv": srv.command, "command": shlex.join(srv.command), "log": str(srv.log_path)}
    sampler = GpuMemorySampler() if s.plat == "cuda" else None
    client, lock = None, MeasureLock(s.cfg.measure_lock)
    try:
        if sampler:
            sampler.__enter__()
        with srv:
            run["server"]["startup_s"] = srv.startup_s
            if (waited := lock.acquire()) is not None:
                run["server"]["measure_lock_wait_s"] = waited
                s.say(f"[bench] {spec.label}: measuring (waited {waited:.0f}s for {s.cfg.measure_lock})")
            s.bar.update(1)
            model_id = served_model_id(srv.url, s.headers)
            if spec.arm in REAP_ARMS:
                client = ReapClient(
                    srv.url,
                    s.api_key,
                    plan=str(spec.plan_path),
                    strategy=arm_strategy(s.cfg, spec.arm),
                    budget_bytes=spec.budget_bytes,
                    model=model_id,
                )
            runner = ArmRunner(
                s.cfg, spec, srv.url, s.headers, model_id, s.prompts, s.shape.top_k, s.bar.update, client
            )
            runner.warm_up()
            run["greedy"], run["requests"] = runner.greedy()
            if s.timing_on:
                run["timing"] = runner.timing()
            run["swaps"] = runner.swaps
            if client is not None:
                run["reap_status"] = client.status()
        run["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - one arm failing must not lose the others
        run.update(status="failed", reason=f"{type(exc).__name__}: {exc}")
        s.say(f"[bench] {spec.label}: FAILED: {type(exc).__name__}: {str(exc)[:2000]}")
    finally:
        lock.release()  # after the server stopped: the next arm measures on a quiet GPU
        if client is not None:
            client.close()
        if sampler:
            sampler.__exit__(None, None, None)
    log_info = log_numbers(srv.log_path.read_text(errors="replace")) if srv.log_path.exists() else {}
    run["server"]["log_numbers"] = log_info
    run["gpu_memory"] = _gpu_memory(sampler, log_info, shared=s.cfg.measure_lock is not None)
    return log_info


def _gpu_memory(sampler: GpuMemorySampler | None, log_info: Mapping, shared: bool = False) -> dict:
    if sampler is None:
        return {"note": "n/a (no GPU)"}
    return {
        "peak_used_bytes": sampler.peak,
        "baseline_used_bytes": sampler.baseline,
        "source": "nvidia-smi memory.used, visible GPUs, sampled every 0.5 s while the arm ran "
        "(includes vLLM's KV cache reservation"
        + ("; and other benches' servers on the same GPU: --measure-lock" if shared else "")
        + ")",
        **log_info,
    }


def _hit_rate(s: _Session, spec: RunSpec, run: Mapping, log_info: Mapping) -> dict:
    """Reap arms: the server's counters; stock arms: derived from what they keep on the GPU."""
    if spec.arm in REAP_ARMS:
        hit = pooled_hit_rate(run["requests"]) or {}
        mode = (run.get("reap_status") or {}).get("mode")
        cache = (run.get("reap_status") or {}).get("cache") or {}
        if cache.get("engaged"):
            t = cache.get("totals") or {}
            hit["cache_hit_rate"] = cache_hit_ratio(t)
            hit["cache_totals"] = t  # the whole arm, warm-up included (the cache never resets)
        return {**hit, "source": f"server counters (GET /router_misses per request; residency {mode})"}
    return _derived_hit_rate(spec, s.shape, s.shape.total_expert_bytes, log_info)


def _derived_hit_rate(spec: RunSpec, shape, total_expert_bytes: int, log_info: Mapping) -> dict:
    if spec.arm == "resident":
        return {"hit_rate": 1.0, "source": "derived: every expert is resident in GPU memory"}
    layer_bytes = [shape.layer_expert_bytes] * len(shape.moe_layers)
    offload = uva_offloaded_bytes(layer_bytes, max(0, total_expert_bytes - (spec.budget_bytes or 0)))
    resident = 1.0 - offload / total_expert_bytes
    logged = log_info.get("uva_offloaded_gib")
    return {
        "hit_rate": resident,
        "resident_fraction": resident,
        "offloaded_bytes": offload,
        "source": "derived: stock UVA offload is per parameter, layer by layer, and every MoE layer routes "
        f"top_k selections per token, so the hit rate is the resident fraction of expert bytes "
        f"({resident:.3f}; offloaded {offload / GIB:.4f} GiB"
        + (f", vLLM logged {logged} GiB" if logged is not None else "")
        + ")",
    }
