"""``reap-swap accept``: is reap-swap's output bit-identical to stock vLLM on this machine and card?

Two servers, one at a time (each one's processes are checked gone before the next starts):
  stock  vLLM's own OpenAI server (what ``vllm serve`` runs) with the user's engine arguments:
         the reference, N token-id prompts x T greedy tokens, one request at a time
  reap   ``python -m reap_swap.server`` with the same engine arguments and the plan alone (the
         server's defaults; without a plan, no ``--reap-plan``), the same completions
         (1) quiet, (2) while a thread posts /swap_active_set every few milliseconds, (3) after the
         swaps stopped, (4) after a storm of chats, swaps and malformed payloads, several at a time;
         then GET /reap/status (the cache counters)
Both get ``--no-enable-prefix-caching`` (a prefix cached by an earlier phase would let a later one
skip the prefill it is meant to repeat) and their own VLLM_CACHE_ROOT under the output folder
(every server compiles for itself, as a fresh install does; a shared compile cache can hide a
difference). CUDA graphs stay as the engine arguments leave them (on unless ``--enforce-eager``).

The verdict (accept_verdict.py): every phase's tokens and logprobs equal stock's bit for bit, both
servers ran every phase, and no request got a 5xx or no answer. Writes accept.json (every number,
both commands, the environment) and accept.md under the output folder, server logs under logs/.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from reap_swap.bench import server_driver as serving
from reap_swap.bench.accept_load import Swapper, complete_all, storm, swap_choices, token_prompts
from reap_swap.bench.accept_verdict import judge, summary_markdown, verdict_table
from reap_swap.bench.config import flag_value, has_flag

STEPS = 8  # progress: stock (start, quiet) + reap (start, quiet, during, after, storm, after storm)
PASSED_ENV = ("TORCHINDUCTOR_DETERMINISTIC", "CUDA_VISIBLE_DEVICES", "VLLM_ATTENTION_BACKEND")
OWN_FLAGS = ("--port", "--enable-prefix-caching", "--no-enable-prefix-caching")


@dataclass
class AcceptConfig:
    """One acceptance run, as asked on the command line."""

    model: str
    out: Path
    plan: Path | None = None
    engine_args: list[str] = field(default_factory=list)
    reap_args: list[str] = field(default_factory=list)
    prompts: int = 4
    tokens: int = 192
    storm: int = 240
    storm_concurrency: int = 8
    swap_period_s: float = 0.02
    startup_timeout_s: float = 900.0
    progress: bool = True


class AcceptError(ValueError):
    """Inputs the run refuses before starting anything (exit 2)."""


@dataclass
class Inputs:
    """What the checks found: the prompts, what a swap may name, the plan document."""

    prompts: list[list[int]]
    picks: dict[str, list]
    everything: dict[str, list]
    plan_doc: dict | None


def model_config(model: str) -> dict:
    """config.json of a model folder, else of a hub id (through the hub cache, as vLLM would)."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import hf_hub_download

            path = Path(hf_hub_download(model, "config.json"))
        except Exception as exc:  # noqa: BLE001 - any failure means the same: no config to read
            raise AcceptError(
                f"{model}: not a model folder, and no config.json from the hub ({exc})"
            ) from None
    try:
        return orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise AcceptError(f"{path}: {exc}") from None


def check_inputs(cfg: AcceptConfig) -> Inputs:
    """Refuse what cannot give a meaningful verdict, before any server starts."""
    from reap_swap.plan.document import PlanError, load_plan, read_plan_document
    from reap_swap.sizing.model_shape import ModelShapeError, read_model_shape

    for name, value in (("--prompts", cfg.prompts), ("--tokens", cfg.tokens)):
        if value < 1:
            raise AcceptError(f"{name} must be at least 1, not {value}")
    if cfg.storm < 0 or cfg.storm_concurrency < 1 or cfg.swap_period_s < 0:
        raise AcceptError("--storm must be >= 0, --storm-concurrency >= 1 and --swap-period-ms >= 0")
    taken = [f for f in OWN_FLAGS if has_flag(cfg.engine_args, f)]
    if taken:
        raise AcceptError(
            f"{', '.join(taken)}: set by accept itself (one port per server; prefix caching off)"
        )
    reap = [a for a in cfg.engine_args if a.startswith("--reap-")]
    if reap:
        raise AcceptError(
            f"{', '.join(reap)}: stock vLLM would refuse it; pass reap-swap flags in --reap-args"
        )
    config = model_config(cfg.model)
    vocab = int(config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size") or 0)
    if vocab < 256:
        raise AcceptError(f"{cfg.model}: vocab_size {vocab} is too small for random token-id prompts")
    try:
        shape = read_model_shape(config)
    except ModelShapeError as exc:
        raise AcceptError(f"{cfg.model}: {exc}") from None
    plan_doc = None
    if cfg.plan is not None:
        try:
            plan_doc = read_plan_document(cfg.plan)
            load_plan(str(cfg.plan), shape)
        except PlanError as exc:
            report = getattr(exc, "report", None)
            raise AcceptError(f"{cfg.plan}: {report.format_text() if report else exc}") from None
        except OSError as exc:
            raise AcceptError(f"{cfg.plan}: {exc}") from None
    picks, everything = swap_choices(plan_doc, shape)
    return Inputs(token_prompts(vocab, cfg.prompts), picks, everything, plan_doc)


def server_commands(cfg: AcceptConfig) -> dict[str, list[str]]:
    """arm -> its command line without --port (Server appends one)."""
    from reap_swap.compat.serve import STOCK_SERVER_MODULE

    common = list(cfg.engine_args)
    if not has_flag(common, "--host"):
        common += ["--host", "127.0.0.1"]
    common += ["--no-enable-prefix-caching"]
    plan = ["--reap-plan", str(cfg.plan.resolve())] if cfg.plan is not None else []
    return {
        "stock": [sys.executable, "-m", STOCK_SERVER_MODULE, "--model", cfg.model, *common],
        "reap": [sys.executable, "-m", "reap_swap.server", cfg.model, *common, *plan, *cfg.reap_args],
    }


class _Run:
    """One acceptance run: its report, progress bar and the servers' common settings."""

    def __init__(self, cfg: AcceptConfig, inputs: Inputs, say: Callable[[str], None], bar: Any):
        self.cfg, self.inputs, self.say, self.bar = cfg, inputs, say, bar
        key = flag_value(cfg.engine_args, "--api-key") or os.environ.get("VLLM_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def step(self, arm: str, what: str) -> None:
        self.bar.set_description(f"{arm}: {what}")

    def done(self) -> None:
        self.bar.update(1)

    def arm(self, name: str, argv: list[str], record: dict) -> None:
        """Start the arm's server, run its phases into ``record``, stop it (even on failure)."""
        out = self.cfg.out
        record["command"] = argv
        self.step(name, "starting")
        server = serving.Server(
            name,
            argv,
            out / "logs",
            env={"VLLM_CACHE_ROOT": str(out / "vllm-cache" / name)},
            port=serving.free_port(),
            startup_timeout_s=self.cfg.startup_timeout_s,
            headers=self.headers,
            announce=self.say,
            base_env=serving.environ_without_reap(),
        )
        with server:
            record["startup_s"] = server.startup_s
            self.done()
            model = self.served_model(server.url)
            self.phase(name, "quiet", record, server.url, model)
            if name != "stock":
                self.load_phases(name, record, server.url, model)

    def served_model(self, url: str) -> str:
        r = httpx.get(url + "/v1/models", headers=self.headers, timeout=60)
        r.raise_for_status()
        return r.json()["data"][0]["id"]

    def phase(self, arm: str, phase: str, record: dict, url: str, model: str) -> None:
        self.step(arm, phase.replace("_", " "))
        record[phase] = complete_all(url, self.headers, model, self.inputs.prompts, self.cfg.tokens)
        self.done()

    def load_phases(self, name: str, record: dict, url: str, model: str) -> None:
        cfg, inputs = self.cfg, self.inputs
        swapper = Swapper(url, self.headers, inputs.picks, seed=1, period_s=cfg.swap_period_s)
        swapper.start()
        try:
            deadline = time.monotonic() + 5
            while swapper.posted < 1 and time.monotonic() < deadline:  # swaps in flight before the phase
                time.sleep(0.01)
            self.phase(name, "during", record, url, model)
        finally:
            swapper.halt.set()
            swapper.join()
            record["swaps"] = swapper.report()
        self.phase(name, "after", record, url, model)
        self.step(name, f"storm of {cfg.storm}")
        record["storm"] = storm(
            url, self.headers, model, inputs.picks, inputs.everything, cfg.storm, cfg.storm_concurrency
        )
        self.done()
        self.phase(name, "after_storm", record, url, model)
        r = httpx.get(url + "/reap/status", headers=self.headers, timeout=120)
        record["status"] = (
            r.json() if r.status_code == 200 else {"http_status": r.status_code, "body": r.text}
        )
        cache = record["status"].get("cache") or {}
        record["cache"] = {k: cache[k] for k in ("engaged", "mode", "policy", "totals") if k in cache}


def _write(report: Mapping, out: Path) -> None:
    (out / "accept.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))


def run_accept(cfg: AcceptConfig, command: str) -> int:
    """The whole run: checks (2 if refused), both arms, the verdict (0 pass, 1 fail)."""
    from tqdm import tqdm

    from reap_swap.bench.env import environment

    try:
        inputs = check_inputs(cfg)
    except AcceptError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cfg.out = cfg.out.resolve()
    cfg.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "command": command,
        "started_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "model": cfg.model,
        "plan": str(cfg.plan) if cfg.plan else None,
        "config": {**asdict(cfg), "out": str(cfg.out), "plan": str(cfg.plan) if cfg.plan else None},
        "environment": environment(),
        # what reaches both servers from this shell and moves the bits (docs/accept.md)
        "server_environment": {k: os.environ.get(k) for k in PASSED_ENV},
        "prompts": inputs.prompts,
        "arms": {},
    }
    with tqdm(total=STEPS, disable=not cfg.progress, file=sys.stderr, unit="step") as bar:
        run = _Run(cfg, inputs, lambda m: bar.write(f"accept: {m}", file=sys.stderr), bar)
        for name, argv in server_commands(cfg).items():
            record = report["arms"].setdefault(name, {})
            try:
                run.arm(name, argv, record)
            except (serving.ServerError, httpx.HTTPError, RuntimeError, ValueError, KeyError) as exc:
                record["error"] = f"{type(exc).__name__}: {str(exc)[:4000]}"
                run.say(f"{name} failed: {record['error'][:2000]}")
            _write(report, cfg.out)
            if name == "stock" and "error" in record:
                break  # no reference: nothing to compare the reap arm with
    report["finished_at"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    verdict = report["verdict"] = judge(report)
    _write(report, cfg.out)
    (cfg.out / "accept.md").write_text(summary_markdown(report, verdict))
    print(verdict_table(report, verdict))
    print(f"accept: {cfg.out / 'accept.md'}, {cfg.out / 'accept.json'}", file=sys.stderr)
    return 0 if verdict["pass"] else 1
