"""`reap-swap bench`: is a plan worth it on this machine? One server per arm, same prompts, one report.

Arms (each its own server, started, measured and stopped in turn; never two at once):
  resident     stock vLLM, every expert in GPU memory
  stock-uva    stock vLLM UVA offload giving experts the same GPU memory as the budget:
               --offload-backend uva --cpu-offload-gb <expert GiB - budget GiB>
               --cpu-offload-params w13_weight w2_weight (whole parameters, layer by layer)
  plan-static  python -m reap_swap.server with the plan: core resident, no swaps
  plan-swap    the same with the client's per-request selection (--strategy), swapped in per request
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

import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import httpx
import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator

from reap_swap import __version__, serving
from reap_swap.bench_report import (
    GIB,
    markdown_report,
    plot,
    pooled_hit_rate,
    summarize_runs,
    uva_offloaded_bytes,
)

ARMS = ("resident", "stock-uva", "plan-static", "plan-swap")
REAP_ARMS = ("plan-static", "plan-swap")
BUDGET_ARMS = ("stock-uva", "plan-swap")
NO_CUDA = (
    "no CUDA device (vLLM {platform} build): {what} needs a GPU; the accounting arms still report "
    "router hit rates and greedy outputs"
)


class BenchConfig(BaseModel):
    """What one `reap-swap bench` invocation measures (validated before any server starts)."""

    model_config = ConfigDict(extra="forbid")
    model: str
    plan: Path
    prompts: Path
    out: Path
    arms: list[str] = Field(default_factory=lambda: list(ARMS))
    budget_gib: list[float] | None = None
    batch: int = Field(default=4, ge=1)
    repeats: int = Field(default=3, ge=1)
    max_tokens: int = Field(default=32, ge=1)
    decode_tokens: int = Field(default=128, ge=2)
    max_prompts: int | None = Field(default=8, ge=1)
    prompt_chars: int = Field(default=2000, ge=1)
    strategy: str = "prior"
    refresh_every: int | None = Field(default=None, ge=1)
    timings: Literal["auto", "on", "off"] = "auto"
    startup_timeout_s: float = Field(default=900.0, gt=0)
    prefix_caching: bool = False
    progress: bool = True
    engine_args: list[str] = Field(default_factory=list)

    @field_validator("arms")
    @classmethod
    def _known_arms(cls, arms: list[str]) -> list[str]:
        unknown = [a for a in arms if a not in ARMS]
        if unknown or not arms:
            raise ValueError(f"unknown arm(s) {unknown}; known: {', '.join(ARMS)}")
        return list(dict.fromkeys(arms))

    @field_validator("budget_gib")
    @classmethod
    def _positive(cls, values: list[float] | None) -> list[float] | None:
        if values is not None and any(v <= 0 for v in values):
            raise ValueError("every --budget-gib must be > 0")
        return sorted(set(values)) if values else None

    @field_validator("strategy")
    @classmethod
    def _strategy(cls, name: str) -> str:
        from reap_swap.selection import get_strategy

        get_strategy(name)
        return name


class BenchError(ValueError):
    """A bench that cannot run as asked (bad plan, budget, prompts); nothing was started."""


# ----------------------------------------------------------------------------- inputs


def load_prompts(path: Path, limit: int | None, chars: int) -> list[dict]:
    """Chat records as they are; prompt/text records become one user message (cut to ``chars``)."""
    from reap_swap.observe import read_corpus

    records, issues = read_corpus(path)
    if issues:
        raise BenchError(f"{path}: " + "; ".join(str(i) for i in issues[:5]))
    out = []
    for rec in records[:limit]:
        if rec.messages is not None:
            messages = rec.messages
        else:
            text = rec.text if len(rec.text) <= chars else rec.text[:chars]
            messages = [{"role": "user", "content": text}]
        preview = " ".join(str(messages[-1].get("content") or "").split())[:40]
        out.append(
            {"index": len(out), "line": rec.line, "tag": rec.tag, "messages": messages, "preview": preview}
        )
    if not out:
        raise BenchError(f"{path}: no prompts")
    return out


def flag_value(args: Sequence[str], name: str) -> str | None:
    """The value of ``--name X`` or ``--name=X`` in an argv list (the last one wins)."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def has_flag(args: Sequence[str], *names: str) -> bool:
    return any(a == n or a.startswith(n + "=") for a in args for n in names)


# ----------------------------------------------------------------------------- environment


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def visible_gpu_ids() -> list[str]:
    """nvidia-smi `--id` arguments for the GPUs this process may use (CUDA_VISIBLE_DEVICES), or []
    for all: a bench pinned to one GPU of several must not count the others' memory."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    return [f"--id={','.join(ids)}"] if ids and all(i.isdigit() or i.startswith("GPU-") for i in ids) else []


def gpu_names() -> list[str]:
    out = _run(
        [
            "nvidia-smi",
            *visible_gpu_ids(),
            "--query-gpu=name,memory.total,driver_version",
            "--format=csv,noheader",
        ]
    )
    return [line.strip() for line in out.splitlines() if line.strip()] if out else []


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def environment() -> dict:
    """vLLM version and build, platform, GPUs (or CPU), versions; imports vLLM (a few seconds)."""
    from reap_swap.compat import offline as vllm_offline
    from reap_swap.compat import serve as vllm_serve

    dists = vllm_offline.distributions()
    plat = vllm_serve.platform_name()
    gpus = gpu_names() if plat == "cuda" else []
    commit = _run(["git", "-C", str(Path(__file__).resolve().parent.parent), "rev-parse", "--short", "HEAD"])
    return {
        "vllm_version": vllm_serve.vllm_version_string(),
        "vllm_distribution": ", ".join(dists) or "unknown",
        "platform": plat,
        "gpus": gpus,
        "cpu": cpu_name(),
        "device": ("; ".join(gpus) if gpus else f"GPU ({plat})")
        if plat == "cuda"
        else f"CPU only: {cpu_name()}",
        "python": platform.python_version(),
        "reap_swap_version": __version__,
        "git_commit": commit,
        "hostname": socket.gethostname(),
    }


class GpuMemorySampler:
    """Peak nvidia-smi memory.used over the visible GPUs while an arm runs (0.5 s period), minus
    nothing: the baseline before the server started is recorded next to it."""

    def __init__(self, period_s: float = 0.5):
        self.period_s = period_s
        self.baseline: int | None = None
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def used_bytes() -> int | None:
        out = _run(
            ["nvidia-smi", *visible_gpu_ids(), "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        )
        if not out:
            return None
        return sum(int(float(x)) for x in out.split()) * 2**20

    def _loop(self) -> None:
        while not self._stop.is_set():
            used = self.used_bytes()
            if used is not None:
                self.peak = used if self.peak is None else max(self.peak, used)
            self._stop.wait(self.period_s)

    def __enter__(self) -> GpuMemorySampler:
        self.baseline = self.used_bytes()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


_LOG_NUMBERS = {
    "model_loading_gib": re.compile(r"Model loading took ([\d.]+) ?GiB"),
    "kv_cache_gib": re.compile(r"Available KV cache memory: ([\d.]+) ?GiB"),
    "uva_offloaded_gib": re.compile(r"Total CPU offloaded parameters: ([\d.]+)"),
    "reap_pool_gib": re.compile(r"reserved HBM pool of \d+ expert slots \(([\d.]+) GiB"),
}


def log_numbers(log_text: str) -> dict:
    """Memory figures vLLM (and the reap engine) print while loading: last occurrence of each."""
    found = {}
    for key, pattern in _LOG_NUMBERS.items():
        hits = pattern.findall(log_text)
        if hits:
            found[key] = float(hits[-1])
    return found


# ----------------------------------------------------------------------------- plans and arms


def derived_plan(plan_path: Path, budget_bytes: int, outdir: Path, shape) -> Path:
    """A copy of the plan whose swappable budget is ``budget_bytes`` (validated), for one budget.

    Cartridges are dropped from the copy (the bench never uses them and they may not fit)."""
    from reap_swap.plan import PlanError, load_plan, read_plan_document

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


def plan_runs(
    cfg: BenchConfig, plan, shape, total_expert_bytes: int, plat: str, timing_on: bool
) -> list[RunSpec]:
    """The servers to start, in order, each with its exact command (or why it is skipped)."""
    budgets = [int(g * GIB) for g in cfg.budget_gib] if cfg.budget_gib else [plan.swappable_budget_bytes]
    several = len(budgets) > 1
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
    from reap_swap.compat.serve import STOCK_SERVER_MODULE

    stock = [sys.executable, "-m", STOCK_SERVER_MODULE, "--model", cfg.model, *common]
    reap = [sys.executable, "-m", "reap_swap.server", cfg.model, *common]
    layer_bytes = [shape.layer_expert_bytes] * len(shape.moe_layers)
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
                offload = max(0, total_expert_bytes - budget)
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
                moved = uva_offloaded_bytes(layer_bytes, offload)
                spec.notes.append(
                    f"asks to offload {offload / GIB:.4f} GiB of {total_expert_bytes / GIB:.4f} GiB "
                    f"of experts; whole parameters move: {moved / GIB:.4f} GiB"
                )
            else:
                if budget is not None and budget < plan.core_bytes():
                    raise BenchError(
                        f"budget {budget / GIB:.4g} GiB ({budget:,} bytes) does not hold the "
                        f"plan's core ({plan.core_bytes():,} bytes)"
                    )
                if budget is not None and budget != plan.swappable_budget_bytes:
                    spec.plan_path = derived_plan(cfg.plan, budget, cfg.out / "plans", shape)
                else:
                    spec.plan_path = cfg.plan.resolve()
                spec.argv = reap + ["--reap-plan", str(spec.plan_path)]
                if arm == "plan-static":
                    spec.budget_bytes = None
            runs.append(spec)
    return runs


# ----------------------------------------------------------------------------- measuring one arm


def _model_id(url: str, headers: Mapping[str, str]) -> str:
    r = httpx.get(url + "/v1/models", headers=headers, timeout=60)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def _join_prompts(prompts: Sequence[Mapping]) -> list[dict]:
    """One user message with every prompt's text: what a batch's single active set is chosen for."""
    from reap_swap.selection import prompt_text

    return [{"role": "user", "content": "\n\n".join(prompt_text(p["messages"]) for p in prompts)}]


def _miss_totals(misses: Mapping) -> dict:
    t = misses.get("totals") or {}
    return {
        k: t.get(k) for k in ("observed_selections", "missed_selections", "observed_mass", "inactive_mass")
    }


def _swap_record(rid: str, kind: str, summary: Mapping, client_ms: float | None = None) -> dict:
    return {
        "request_id": rid,
        "kind": kind,
        "noop": summary.get("noop"),
        "bytes_copied": summary.get("bytes_copied"),
        "server_seconds": summary.get("server_seconds"),
        "client_ms": client_ms if client_ms is not None else summary.get("client_ms"),
        "signature": summary.get("signature"),
        "mode": summary.get("mode"),
    }


def arm_strategy(cfg: BenchConfig, arm: str) -> str:
    """plan-static is the core only (the 'static' selection: no swaps); plan-swap uses --strategy."""
    return "static" if arm == "plan-static" else cfg.strategy


class ArmRunner:
    """Measures one started server; ``client`` is a ReapClient for the reap arms, else None."""

    def __init__(
        self,
        cfg: BenchConfig,
        spec: RunSpec,
        url: str,
        headers: Mapping[str, str],
        model: str,
        prompts: list[dict],
        top_k: int,
        tick,
        client=None,
    ):
        self.cfg, self.spec, self.url, self.headers, self.model = cfg, spec, url, dict(headers), model
        self.prompts, self.top_k, self.tick, self.client = prompts, top_k, tick, client
        self.swaps: list[dict] = []

    @property
    def strategy(self) -> str:
        return arm_strategy(self.cfg, self.spec.arm)

    def _body(self, messages, max_tokens: int, **extra) -> dict:
        return {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            **extra,
        }

    def warm_up(self) -> None:
        """One streamed request, discarded (compiles/allocates what the first request would)."""
        body = self._body(self.prompts[0]["messages"], min(16, self.cfg.decode_tokens), ignore_eos=True)

        serving.stream_all(self.url, "/v1/chat/completions", [body], self.headers)
        self.tick()

    # -- greedy outputs + hit rates ----------------------------------------------------------
    def greedy(self) -> tuple[list[dict], list[dict]]:
        outputs, requests = [], []
        for p in self.prompts:
            rid = f"bench-{self.spec.label}-g{p['index']}"
            if self.client is None:
                r = httpx.post(
                    self.url + "/v1/chat/completions",
                    headers=self.headers,
                    timeout=600,
                    json=self._body(p["messages"], self.cfg.max_tokens, logprobs=True),
                )
                r.raise_for_status()
                outputs.append(serving.chat_greedy_record(r.json()))
            else:
                refresh = self.cfg.refresh_every if self.spec.arm == "plan-swap" else None
                res = self.client.chat(
                    p["messages"],
                    strategy=self.strategy,
                    request_id=rid,
                    budget_bytes=self.spec.budget_bytes,
                    refresh_every=refresh,
                    max_tokens=self.cfg.max_tokens,
                    temperature=0.0,
                    logprobs=True,
                )
                rec = serving.chat_greedy_record(res.completion)
                outputs.append(rec)
                kind = "warm" if str(res.swap.get("opened_with", "")).startswith("warm") else "swap"
                self.swaps.append(_swap_record(rid, kind, res.swap))
                for ref in res.refreshes:
                    if ref.get("swap"):
                        self.swaps.append(_swap_record(rid, "refresh", ref["swap"]))
                requests.append(self._request_row(rid, res, rec))
            self.tick()
        return outputs, requests

    def _request_row(self, rid: str, res, rec: Mapping) -> dict:
        usage = rec.get("usage") or res.completion.get("usage") or {}
        routed_tokens = (usage.get("prompt_tokens") or 0) + (usage.get("completion_tokens") or 0) - 1
        layers = (res.router_misses or {}).get("layers") or {}
        expected = routed_tokens * self.top_k
        return {
            "request_id": rid,
            **_miss_totals(res.router_misses),
            "hit_rate": res.hit_rate,
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "selection": {
                k: v
                for k, v in res.selection.to_dict().items()
                if k in ("strategy", "signature", "resident_bytes", "budget_bytes", "slices")
            },
            "probe": res.probe,
            "refreshes": res.refreshes,
            "timings_ms": res.timings_ms,
            # each layer routes (prompt + completion - 1) x top_k selections (the last token is never fed back)
            "counter_check": {
                "expected_per_layer": expected,
                "ok": all(v.get("observed_selections") == expected for v in layers.values()),
            },
            "router_misses": res.router_misses,
        }

    # -- timing ------------------------------------------------------------------------------
    def _open(self, messages, rid: str) -> float | None:
        """Select and open ``rid`` (swap, or warm when already resident); seconds it took on the client."""
        if self.client is None:
            return None
        t0 = time.perf_counter()
        selection, _probe = self.client.select(
            messages,
            strategy=self.strategy,
            budget_bytes=self.spec.budget_bytes,
            request_id=rid,
            model=self.model,
            max_tokens=self.cfg.decode_tokens,
        )
        summary = self.client.open(selection, rid)
        elapsed = time.perf_counter() - t0
        self.swaps.append(
            _swap_record(rid, "warm" if summary["opened_with"].startswith("warm") else "swap", summary)
        )
        return elapsed

    def _misses(self, rid: str) -> dict | None:
        return self.client.router_misses(rid) if self.client is not None else None

    def timing(self) -> dict:
        single, batch = [], []
        n = len(self.prompts)
        body_extra = {
            "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        for rep in range(self.cfg.repeats):
            p = self.prompts[rep % n]
            rid = f"bench-{self.spec.label}-s{rep}"
            open_s = self._open(p["messages"], rid)
            body = self._body(p["messages"], self.cfg.decode_tokens, **body_extra)

            res = serving.stream_all(self.url, "/v1/chat/completions", [body], self.headers)[0]
            misses = self._misses(rid)
            single.append(
                {
                    "request_id": rid,
                    "prompt": p["index"],
                    "open_s": open_s,
                    **res.to_dict(),
                    "misses": _miss_totals(misses) if misses else None,
                }
            )
            self.tick()

            group = [self.prompts[(rep + j) % n] for j in range(self.cfg.batch)]
            rid = f"bench-{self.spec.label}-b{rep}"
            open_s = self._open(_join_prompts(group), rid)
            bodies = [self._body(q["messages"], self.cfg.decode_tokens, **body_extra) for q in group]

            results = serving.stream_all(self.url, "/v1/chat/completions", bodies, self.headers)
            ttfts = sorted(r.ttft_s for r in results if r.ttft_s is not None)
            misses = self._misses(rid)
            batch.append(
                {
                    "request_id": rid,
                    "prompts": [q["index"] for q in group],
                    "open_s": open_s,
                    "decode_tok_s": serving.batch_decode_tok_s(results),
                    "ttft_median_s": ttfts[len(ttfts) // 2] if ttfts else None,
                    "streams": [r.to_dict() for r in results],
                    "misses": _miss_totals(misses) if misses else None,
                }
            )
            self.tick()
        return {"single": single, "batch": batch}


# ----------------------------------------------------------------------------- the bench


def _compare(ref: Sequence[Mapping], got: Sequence[Mapping]) -> dict:
    """Token-by-token when both sides have tokens, else character-by-character on the text."""
    if all(r.get("tokens") for r in ref) and all(g.get("tokens") for g in got):
        return {**serving.compare(ref, got), "compared_on": "tokens"}

    def chars(outputs):
        return [{"tokens": list(x.get("text") or "")} for x in outputs]

    return {
        **serving.compare(chars(ref), chars(got)),
        "compared_on": "text characters (no token logprobs in this mode)",
    }


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


def run_bench(cfg: BenchConfig, argv: Sequence[str] | None = None) -> int:
    """Run every arm in turn and write bench.json / bench.md / bench.png under cfg.out."""
    from tqdm import tqdm

    from reap_swap.client import ReapClient
    from reap_swap.model_shape import ModelShapeError, read_model_shape
    from reap_swap.plan import PlanError, load_plan

    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    cfg.out.mkdir(parents=True, exist_ok=True)
    try:
        shape = read_model_shape(cfg.model)
        plan = load_plan(str(cfg.plan), shape)
        prompts = load_prompts(cfg.prompts, cfg.max_prompts, cfg.prompt_chars)
    except (ModelShapeError, PlanError, BenchError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    total_expert_bytes = shape.total_expert_bytes
    env = environment()
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
    try:
        runs = plan_runs(cfg, plan, shape, total_expert_bytes, plat, timing_on)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    api_key = flag_value(cfg.engine_args, "--api-key")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    argv = list(sys.argv if argv is None else argv)
    command = (
        "reap-swap " + shlex.join(argv[1:])
        if argv and Path(argv[0]).name in ("reap-swap", "cli.py")
        else shlex.join(argv)
    )
    report: dict[str, Any] = {
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
            "total_expert_bytes": total_expert_bytes,
        },
        "plan": {
            "path": str(cfg.plan),
            "identity": plan.identity,
            "core_bytes": plan.core_bytes(),
            "budget_bytes": plan.swappable_budget_bytes,
            "per_expert_bytes": plan.per_expert_bytes,
        },
        "config": {**cfg.model_dump(mode="json"), "prompt_count": len(prompts)},
        "timing": {"measured": timing_on, "note": timing_note},
        "prompts": [
            {k: p[k] for k in ("index", "line", "tag", "preview")} | {"messages": p["messages"]}
            for p in prompts
        ],
        "runs": [],
    }
    steps_per_run = 2 + len(prompts) + (2 * cfg.repeats if timing_on else 0)
    todo = [r for r in runs if r.skip_reason is None]
    bar = tqdm(
        total=steps_per_run * len(todo),
        desc="bench",
        unit="step",
        disable=not cfg.progress,
        file=sys.stderr,
        dynamic_ncols=True,
    )

    def say(message: str) -> None:  # above the progress bar, on stderr like the bar
        (tqdm.write if cfg.progress else print)(message, file=sys.stderr)

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
        report["runs"].append(run)
        if spec.skip_reason:
            run.update(status="skipped", reason=spec.skip_reason)
            say(f"[bench] {spec.label}: skipped: {spec.skip_reason}")
            continue
        bar.set_description(spec.label)
        srv = serving.Server(
            spec.label,
            spec.argv,
            cfg.out / "logs",
            port=serving.free_port(),
            startup_timeout_s=cfg.startup_timeout_s,
            headers=headers,
            announce=lambda m: say(f"[bench] {m}"),
        )
        run["server"] = {"argv": srv.command, "command": shlex.join(srv.command), "log": str(srv.log_path)}
        sampler = GpuMemorySampler() if plat == "cuda" else None
        client = None
        try:
            if sampler:
                sampler.__enter__()
            with srv:
                run["server"]["startup_s"] = srv.startup_s
                bar.update(1)
                model_id = _model_id(srv.url, headers)
                if spec.arm in REAP_ARMS:
                    client = ReapClient(
                        srv.url,
                        api_key,
                        plan=str(spec.plan_path),
                        strategy=arm_strategy(cfg, spec.arm),
                        budget_bytes=spec.budget_bytes,
                        model=model_id,
                    )
                runner = ArmRunner(
                    cfg, spec, srv.url, headers, model_id, prompts, shape.top_k, bar.update, client
                )
                runner.warm_up()
                outputs, requests = runner.greedy()
                run["greedy"] = outputs
                run["requests"] = requests
                if timing_on:
                    run["timing"] = runner.timing()
                run["swaps"] = runner.swaps
                if client is not None:
                    run["reap_status"] = client.status()
            run["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 - one arm failing must not lose the others
            failed += 1
            run.update(status="failed", reason=f"{type(exc).__name__}: {exc}")
            say(f"[bench] {spec.label}: FAILED: {type(exc).__name__}: {str(exc)[:2000]}")
        finally:
            if client is not None:
                client.close()
            if sampler:
                sampler.__exit__(None, None, None)
        log_info = log_numbers(srv.log_path.read_text(errors="replace")) if srv.log_path.exists() else {}
        run["server"]["log_numbers"] = log_info
        run["gpu_memory"] = (
            {
                "peak_used_bytes": sampler.peak,
                "baseline_used_bytes": sampler.baseline,
                "source": "nvidia-smi memory.used, visible GPUs, sampled every 0.5 s while the arm ran "
                "(includes vLLM's KV cache reservation)",
                **log_info,
            }
            if sampler
            else {"note": "n/a (no GPU)"}
        )
        if run.get("status") != "ok":
            continue
        if spec.arm in REAP_ARMS:
            hit = pooled_hit_rate(run["requests"]) or {}
            mode = (run.get("reap_status") or {}).get("mode")
            run["hit_rate"] = {
                **hit,
                "source": f"server counters (GET /router_misses per request; residency {mode})",
            }
        else:
            run["hit_rate"] = _derived_hit_rate(spec, shape, total_expert_bytes, log_info)
        if ref_outputs is None:
            reference, ref_outputs = spec.label, run["greedy"]
        run["greedy_vs_ref"] = _compare(ref_outputs, run["greedy"])
        say(
            f"[bench] {spec.label}: hit rate {run['hit_rate'].get('hit_rate')}, greedy = {reference}: "
            f"{run['greedy_vs_ref']['identical']}/{run['greedy_vs_ref']['of']}"
        )
    bar.close()
    report["finished_at"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    report["summary"] = summarize_runs(report["runs"], reference)
    write_outputs(report, cfg.out)
    print(
        f"bench: {cfg.out / 'bench.md'}, {cfg.out / 'bench.json'}, {cfg.out / 'bench.png'}"
        + (f"; {failed} arm(s) failed" if failed else ""),
        file=sys.stderr,
    )
    return 1 if failed else 0


def merge_reports(reports: Sequence[Mapping], command: str) -> dict:
    """Several bench.json of the same model, plan and prompts -> one report (table, ratios, plot).

    Why: on a machine with several GPUs an operator may run one bench per GPU at once (say one
    budget each, with CUDA_VISIBLE_DEVICES); each bench still starts one server at a time. The
    merged report relabels budget-dependent runs with their budget when there are several,
    re-compares every greedy output with one reference (the first `resident` run, else the first
    successful run) and recomputes the cross-run ratios. Each source's command is kept.
    """
    if not reports:
        raise BenchError("nothing to merge")
    first = reports[0]
    for key, get in (
        ("model", lambda r: (r.get("model") or {}).get("path")),
        ("plan identity", lambda r: (r.get("plan") or {}).get("identity")),
        ("prompts", lambda r: orjson.dumps(r.get("prompts"))),
    ):
        values = {get(r) for r in reports}
        if len(values) != 1:
            raise BenchError(f"cannot merge reports with different {key}")
    runs = [dict(run) for r in reports for run in r.get("runs", [])]
    budgets = {
        run.get("budget_bytes") for run in runs if run.get("budget_dependent") and run.get("budget_bytes")
    }
    for run in runs:
        if len(budgets) > 1 and run.get("budget_dependent") and run.get("budget_bytes"):
            run["label"] = f"{run['arm']}@{run['budget_bytes'] / GIB:.4g}GiB"
    labels = [run["label"] for run in runs]
    if len(set(labels)) != len(labels):
        raise BenchError(f"runs with the same label in the merged reports: {sorted(labels)}")
    ok = [run for run in runs if run.get("status") == "ok"]
    ref = next((run for run in ok if run["arm"] == "resident"), ok[0] if ok else None)
    for run in ok:
        run["greedy_vs_ref"] = _compare(ref["greedy"], run["greedy"])
    merged = {k: v for k, v in first.items() if k not in ("runs", "summary")}
    merged.update(
        command=command,
        argv=None,
        runs=runs,
        merged_from=[
            {k: r.get(k) for k in ("command", "started_at", "finished_at", "environment")} for r in reports
        ],
        started_at=min(str(r.get("started_at")) for r in reports),
        finished_at=max(str(r.get("finished_at")) for r in reports),
    )
    merged["summary"] = summarize_runs(runs, ref["label"] if ref else None)
    return merged


def write_outputs(report: Mapping, out: Path) -> None:
    (out / "bench.json").write_bytes(
        orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS)
    )
    (out / "bench.md").write_text(markdown_report(report) + "\n")
    plot(report, out / "bench.png")
