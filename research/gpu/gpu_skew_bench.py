#!/usr/bin/env python3
"""Issue 17's skew bench on ONE H200: plan-cache vs plan-swap (and the references) on the skewed model.

  python research/gpu/gpu_skew_bench.py --out DIR [--deadline 660] [--no-25] [--dry-run]

(gpu_run.sh phase `skewbench`.) Steps, each with a cap; every finished arm leaves its own
DIR/b-<n>-<name>/bench.json and DIR/skew_bench.{json,md} is rewritten after each one, so a cut keeps
what was measured:
 1. the model: /tmp/model (the kit's mk_model, made if missing) -> scripts/make_skewed_moe.py ->
    /tmp/skew (bf16, reused when its skew_construction.json exists; ~10 s on the H200, run 3);
 2. plan at 50 %: research-notes/h200-2026-11-30/skew.plan.json (runs 3-4's plan, identity f3bc65de,
    core 48 % of the budget), so the 50 % servers start at once; `reap-swap observe` (calibration,
    eager) runs beside their start-ups and `reap-swap plan --budget-ratio 0.25 --core-fraction 0.48`
    makes the 25 % plan (its own core; the 50 % plan's core alone is 24 % of the experts and would
    leave a 25 % cache ~1 slot per layer);
 3. group A (started together, fixed 2 GiB KV, --gpu-memory-utilization 0.1): plan-cache@50,
    plan-swap@50, resident, the vLLM routing trace (research/gpu/gpu_skew_trace.py), plan-static, stock
    UVA@50; group B (plan 25 %): plan-cache@25, plan-swap@25, stock UVA@25 and resident2 (a second
    stock resident process: stock's own text spread, see skew_bench_summary) and plan-swap+cache@50
    (the issue's "all three" arm: swaps pin their set, the device cache's tail adapts), started once the 25 %
    plan exists and plan-cache@50, plan-swap@50 and resident have finished (host memory: every reap
    server pins all 13.5 GiB of experts); with --no-25 group B is resident2 and plan-swap+cache@50;
 4. measuring strictly in that order, one at a time: each job has its own --measure-lock file that
    this driver holds and releases when every earlier job has ended, its group is up (or the
    group's start-up cap passed) and no server of the other group is starting (guardfix: run 12
    measured trace, plan-static@50 and stock UVA@50 while group B started; --measure-during-startup
    restores that): plan-cache vs plan-swap at 50 % first, on a quiet machine, then resident (text
    reference, t_resident), the trace, the rest. Run 12 took 457 s; the quiet rule waits for group
    B's start-up (~160 s) after resident, and plan-swap+cache@50 measures last (~60 s), so expect
    ~610 s (gpu_run.sh: SKEW_CAP 780, deadline 720; the deadline cuts the last jobs first);
 5. at --deadline every job still running gets SIGTERM (each bench stops its own server) and the
    summary is written from what finished.
--dry-run prints the jobs and their commands (CPU-testable; tests/test_skewbench.py).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLAN50 = ROOT / "research-notes/h200-2026-11-30/skew.plan.json"
ENGINE = [
    "--dtype", "bfloat16", "--max-model-len", "2048", "--max-num-seqs", "8",
    "--gpu-memory-utilization", "0.1", "--kv-cache-memory-bytes", "2147483648", "--moe-backend", "triton",
]  # fmt: skip
# (name, group, kind, arms, budget share or None, plan key)
JOBS = (
    ("cache50", "A", "bench", "plan-cache", 0.5, "p50"),
    ("swap50", "A", "bench", "plan-swap", 0.5, "p50"),
    ("resident", "A", "bench", "resident", None, "p50"),
    ("trace", "A", "trace", None, None, None),
    ("static50", "A", "bench", "plan-static", None, "p50"),
    ("uva50", "A", "bench", "stock-uva", 0.5, "p50"),
    ("cache25", "B", "bench", "plan-cache", 0.25, "p25"),
    ("swap25", "B", "bench", "plan-swap", 0.25, "p25"),
    ("uva25", "B", "bench", "stock-uva", 0.25, "p25"),
    ("resident2", "B", "bench", "resident", None, "p50"),  # stock's own spread (skew_bench_summary)
    ("swapcache50", "B", "bench", "plan-swap+cache", 0.5, "p50"),  # all three: swaps pin, the tail adapts
)
ALWAYS = ("resident2", "swapcache50")  # run with --no-25 too (they need no 25 % plan)
B_AFTER = ("cache50", "swap50", "resident")  # group B starts once these have ended (host memory)


@dataclass
class Job:
    order: int
    name: str
    group: str
    argv: list[str]
    out: Path
    lock: Path
    proc: subprocess.Popen | None = None
    log: Path | None = None
    started: float | None = None
    ended: float | None = None
    released: bool = False
    rc: int | None = None
    extra: dict = field(default_factory=dict)


def job_argv(kind, arms, share, plan_key, a, paths, total_gib, out: Path, lock: Path) -> list[str]:
    py = sys.executable
    if kind == "trace":
        return [py, "research/gpu/gpu_skew_trace.py", "--model", str(a.skew), "--out", str(a.out / "trace"),
                "--measure-lock", str(lock), "--startup-timeout", str(a.startup_cap), "--", *ENGINE]  # fmt: skip
    argv = [py, "-m", "reap_swap.cli", "bench", "--model", str(a.skew), "--plan", str(paths[plan_key]),
            "--prompts", "data/corpus/heldout.jsonl", "--batch", "8", "--repeats", str(a.repeats),
            "--no-progress", "--startup-timeout", str(a.startup_cap), "--measure-lock", str(lock),
            "--out", str(out), "--arms", arms]  # fmt: skip
    if share is not None:
        argv += ["--budget-gib", f"{total_gib * share:.6f}"]
    return argv + ["--", *ENGINE]


def plan_jobs(a, paths, total_gib, with_25: bool = True) -> list[Job]:
    """The jobs in measuring order; a bench's folder DIR/b-<n>-<name> numbers that order."""
    jobs = []
    for i, (name, group, kind, arms, share, plan_key) in enumerate(JOBS):
        if group == "B" and not with_25 and name not in ALWAYS:
            continue
        out = a.out / (f"b-{i + 1}-{name}" if kind == "bench" else "trace")
        lock = a.out / "locks" / f"{name}.lock"
        argv = job_argv(kind, arms, share, plan_key, a, paths, total_gib, out, lock)
        jobs.append(Job(i + 1, name, group, argv, out, lock))
    return jobs


T0 = time.time()


def say(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} +{time.time() - T0:.0f}s {msg}", flush=True)


def run_step(name: str, argv: list[str], log: Path, cap: float) -> bool:
    say(f"[{name}] {' '.join(argv)[:300]}")
    with open(log, "w") as fh:
        try:
            rc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, timeout=cap, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    say(f"[{name}] exit {rc}")
    if rc != 0:
        print(log.read_text(errors="replace")[-3000:], flush=True)
    return rc == 0


def build_model(a) -> bool:
    if a.skew == a.src and (a.src / "config.json").is_file():
        say(f"[model] the kit model itself (near-uniform routing): {a.src}")
        return True
    if (a.skew / "skew_construction.json").is_file():
        say(f"[model] reusing {a.skew}")
        return True
    if not (a.src / "config.json").is_file() and not run_step(
        "mk_model", [sys.executable, "/tmp/kit/tools/mk_model.py", str(a.src)], a.out / "mk_model.log", 300
    ):
        return False
    return run_step(
        "skew", [sys.executable, "scripts/make_skewed_moe.py", str(a.src), str(a.skew), "--workers", "8"],
        a.out / "skew.log", 240,
    )  # fmt: skip


def observe_plan25(a, paths) -> subprocess.Popen:
    """observe (eager) then plan 25 %, in the background; paths['p25'] exists when it succeeded."""
    obs = a.out / "skew.obs.pt"
    cli = f"{sys.executable} -m reap_swap.cli"
    cmd = (
        f"timeout --kill-after=20 240 {cli} observe --model {a.skew} --corpus data/corpus/calibration.jsonl "
        f"--out {obs} --no-progress {' '.join(ENGINE)} --enforce-eager > {a.out}/observe.log 2>&1 && "
        f"{cli} plan --observations {obs} --model {a.skew} --budget-ratio 0.25 --core-fraction 0.48 "
        f"--out {paths['p25']} > {a.out}/plan25.log 2>&1"
    )
    say(f"[plan25] {cmd[:300]}")
    return subprocess.Popen(["bash", "-c", cmd], cwd=ROOT, start_new_session=True)


DETERMINISTIC_ENV = {"TORCHINDUCTOR_DETERMINISTIC": "1"}  # torch._inductor.config.deterministic


def job_env(a) -> dict[str, str]:
    """The jobs' environment: with --inductor-deterministic, Inductor skips on-device benchmarking
    that affects numerics (one reduction config, no per-process timing choice) in EVERY arm alike."""
    return {**os.environ, **(DETERMINISTIC_ENV if getattr(a, "inductor_deterministic", False) else {})}


def start(job: Job, env: dict[str, str] | None = None) -> None:
    job.log = job.out.parent / f"{job.out.name}.log"
    job.log.parent.mkdir(parents=True, exist_ok=True)
    fh = open(job.log, "w")  # noqa: SIM115 - the child's stdout for its lifetime
    job.proc = subprocess.Popen(
        job.argv, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True, env=env
    )
    job.started = time.time()
    say(f"[{job.name}] started pid {job.proc.pid}")


def is_up(job: Job) -> bool:
    if job.proc is None:
        return False
    if job.proc.poll() is not None:
        return True
    text = job.log.read_text(errors="replace") if job.log and job.log.exists() else ""
    return "healthy after" in text


def summarize(a) -> None:
    subprocess.run([sys.executable, "research/gpu/skew_bench_summary.py", str(a.out)], cwd=ROOT,
                   stdout=open(a.out / "summary.log", "w"), stderr=subprocess.STDOUT, timeout=120)  # fmt: skip


def stop_all(jobs: list[Job]) -> None:
    for j in jobs:
        if j.proc is not None and j.proc.poll() is None:
            say(f"[{j.name}] deadline: SIGTERM")
            os.killpg(j.proc.pid, signal.SIGTERM)
    for j in jobs:
        if j.proc is not None:
            try:
                j.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(j.proc.pid, signal.SIGKILL)


def step_loop(a, jobs: list[Job], holders: dict, plan_proc, deadline: float) -> None:
    """Start group B when allowed, release locks in order, record ends; until all ended or deadline."""
    group_start = {"A": time.time()}
    while time.time() < deadline:
        for j in jobs:
            if j.proc is not None and j.ended is None and j.proc.poll() is not None:
                j.ended, j.rc = time.time(), j.proc.returncode
                say(f"[{j.name}] ended rc {j.rc}")
                summarize(a)
        done_a = all(j.ended for j in jobs if j.name in B_AFTER)
        if "B" not in group_start and done_a and plan_proc.poll() is not None:
            group_start["B"] = time.time()
            for j in jobs:
                if j.group == "B":
                    if Path(j.argv[j.argv.index("--plan") + 1]).is_file():
                        start(j, job_env(a))
                    else:
                        j.ended, j.rc = time.time(), -1
                        say(f"[{j.name}] skipped: no 25 % plan (observe/plan failed: {a.out}/observe.log)")
        release_next(a, jobs, holders, group_start)
        if all(j.ended for j in jobs):
            return
        time.sleep(2)


def starting_elsewhere(a, jobs: list[Job], j: Job, group_start: dict) -> list[str]:
    """Servers of another group still starting (within their group's start-up cap): while they load
    weights, compile and capture graphs, nothing measures (run 12: stock UVA@50 measured while group
    B started and its greedy text moved; --measure-during-startup restores the old schedule)."""
    if getattr(a, "measure_during_startup", False):
        return []
    now = time.time()
    return [
        k.name
        for k in jobs
        if k.group != j.group and k.proc is not None and not k.ended and not is_up(k)
        and now - group_start.get(k.group, now) <= a.startup_cap + 30
    ]  # fmt: skip


def release_next(a, jobs: list[Job], holders: dict, group_start: dict) -> None:
    """Let the first job that has not measured yet measure, once every earlier job has ended, its
    group is up (every started server healthy or its bench ended) or the group's cap passed, and no
    server of another group is starting (starting_elsewhere)."""
    for j in jobs:
        if j.released or (j.proc is None and j.ended):
            continue  # measured or measuring, or skipped
        if j.proc is None or not all(k.ended for k in jobs if k.order < j.order):
            return
        group = [k for k in jobs if k.group == j.group and k.proc is not None]
        up = all(is_up(k) or k.ended for k in group)
        late = time.time() - group_start[j.group] > a.startup_cap + 30
        if (up or late) and not starting_elsewhere(a, jobs, j, group_start):
            holders.pop(j.name).close()
            j.released = True
            say(f"[{j.name}] measuring" + ("" if up else " (group start-up cap passed)"))
        return


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/run/skewbench"))
    ap.add_argument("--src", type=Path, default=Path("/tmp/model"))
    ap.add_argument("--skew", type=Path, default=Path("/tmp/skew"))
    ap.add_argument(
        "--plan50", type=Path, default=PLAN50, help="the 50 %% plan (default: runs 3-4's skew plan)"
    )
    ap.add_argument("--deadline", type=float, default=660.0, help="seconds from start to SIGTERM everything")
    ap.add_argument("--startup-cap", type=float, default=300.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--no-25",
        dest="with_25",
        action="store_false",
        help="only the 50 %% group (+ resident2 and plan-swap+cache@50)",
    )
    ap.add_argument(
        "--inductor-deterministic", action="store_true",
        help="TORCHINDUCTOR_DETERMINISTIC=1 for every arm (diagnostic: per-process autotuned numerics)",
    )  # fmt: skip
    ap.add_argument(
        "--measure-during-startup", action="store_true",
        help="let an arm measure while another group's servers start (run 12's schedule)",
    )  # fmt: skip
    ap.add_argument(
        "--all-at-once", action="store_true",
        help="start every job with group A (a short lease; host memory for all of them at once)",
    )  # fmt: skip
    ap.add_argument("--only", help="comma-separated job names to keep (e.g. cache50,resident,static50)")
    ap.add_argument("--dry-run", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    t0 = time.time()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "locks").mkdir(exist_ok=True)
    paths = {"p50": a.out / "skew50.plan.json", "p25": a.out / "skew25.plan.json"}
    total_gib = 13.5  # 12 layers x 128 experts x 9 MiB (the kit model; checked below when it exists)
    if not a.dry_run:
        if not build_model(a):
            return 1
        from reap_swap.sizing.model_shape import read_model_shape

        total_gib = read_model_shape(str(a.skew)).total_expert_bytes / 2**30
        shutil.copy(a.plan50, paths["p50"])
    jobs = plan_jobs(a, paths, total_gib, a.with_25)
    if a.only:
        jobs = [j for j in jobs if j.name in a.only.split(",")]
    if a.all_at_once:
        for j in jobs:
            j.group = "A"
    if a.dry_run:
        for j in jobs:
            print(j.order, j.group, j.name, " ".join(j.argv))
        return 0
    env = {k: v for k, v in job_env(a).items() if k.startswith("TORCHINDUCTOR_")}
    (a.out / "jobs.json").write_text(
        json.dumps([{"name": j.name, "argv": j.argv, "inductor_env": env} for j in jobs], indent=1)
    )
    holders = {}
    for j in jobs:
        holders[j.name] = open(j.lock, "a+")  # noqa: SIM115 - held until this job may measure
        fcntl.flock(holders[j.name], fcntl.LOCK_EX)
    plan_proc = observe_plan25(a, paths) if a.with_25 else subprocess.Popen(["true"])
    for j in jobs:
        if j.group == "A":
            start(j, job_env(a))
    try:
        step_loop(a, jobs, holders, plan_proc, t0 + a.deadline)
    finally:
        stop_all(jobs)
        if plan_proc.poll() is None:
            os.killpg(plan_proc.pid, signal.SIGTERM)
        summarize(a)
    print((a.out / "skew_bench.md").read_text() if (a.out / "skew_bench.md").exists() else "no summary")
    say("all done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
