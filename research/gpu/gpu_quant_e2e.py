#!/usr/bin/env python3
"""Quantized checkpoints end to end on one GPU (issue 16): stock vLLM vs reap-swap, per format.

For each case it writes (once) a seeded checkpoint with scripts/make_quant_checkpoint.py
(Qwen3-30B-A3B layer shape, `--layers` layers, attention unquantized), then, in its own process
with a hard timeout, runs
  stock   stock vLLM, every expert in HBM (+ the reap_moe_probe worker extension): greedy text and
          the MoE-layer digests, the reference;
  reap    python -m reap_swap.server with a plan whose pool holds every expert and whose core is
          empty: greedy text and reap_moe_probe at 0 / 25 / 50 / 100 % resident, back at 0 % and
          at a different 50 % set after the swaps; each swap's bytes actually copied (against
          admitted experts x the served payload) and GB/s; /reap/status (HBM unit per resident
          expert, kept-whole bytes, per-layer refusals).
Both servers of a case get the same vLLM arguments (CUDA graphs on, prefix caching off, requests
one at a time), with `--moe-backend triton` only where the engine binds the format: for the formats
it refuses (AWQ, GPTQ, CT W4A16 at --reap-group-size 1, MXFP4; quant_budget.py) the launcher leaves
vLLM's arguments alone and the server must come up on the stock path with the refusals recorded (/reap/status: each
worker's `engine`, swap_report.engine_summary). For refused formats stock is served a second time
in its own process (`--stock-twice`): if stock differs from itself (tokens, logprobs or MoE digests)
a reap difference is reported as STOCK-NONDET, not FAIL. Cases run `--jobs` at a time and the arms
of a case at once (`--serial-arms`: one after the other), each server with a small fixed KV cache;
checkpoints are written `--ckpt-jobs` processes at a time and reused when complete (their recipe
names the format and depth). Run 9a: nine cases, arms serial, 5 jobs: 396 s.
Helpers are research/gpu/gpu_e2e.py's (plan, swaps, greedy, probe, status), imported, not copied.

  python3 research/gpu/gpu_quant_e2e.py --out DIR [--cases bf16,awq] [--jobs 6] [--case-timeout 330]
  python3 research/gpu/gpu_quant_e2e.py --out DIR --dry-run --tiny     # CPU: checkpoints + commands only
Writes DIR/checkpoints/<fmt>/, DIR/cases/<case>.json, DIR/<case>/*.server.log, DIR/quant_e2e.json
and DIR/quant_e2e.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # make_quant_checkpoint
sys.path.insert(0, str(Path(__file__).resolve().parent))  # research/gpu/ (gpu_e2e, group_e2e, quant_cases)
import gpu_e2e  # noqa: E402
import group_e2e  # noqa: E402
import make_quant_checkpoint as mqc  # noqa: E402
from quant_cases import (  # noqa: E402  (pure parts: case list, summary; re-exported)
    CASES,
    GPT_OSS_SHAPE,
    KV_BYTES,
    STOCK_TWICE_WORDS,
    SWAPS,
    TINY,
    case_row,
    checkpoint_ready,
    engine_facts,
    listed,
    markdown,
)

from reap_swap.bench import server_driver as serving  # noqa: E402
from reap_swap.bench.server_driver import Server, free_port, log  # noqa: E402
from reap_swap.compat import mxfp4  # noqa: E402
from reap_swap.sizing.model_shape import quantization_config, read_model_shape  # noqa: E402
from reap_swap.sizing.quant.budget import served_quant_of  # noqa: E402
from reap_swap.sizing.quant.padding import expert_format  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=5, help="cases at a time (one H200 holds 5 at 0.1)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.1)
    ap.add_argument("--case-timeout", type=float, default=330.0, help="seconds per case, both servers")
    ap.add_argument("--greedy-tokens", type=int, default=24)
    ap.add_argument("--tiny", action="store_true", help="tiny checkpoints (CPU dry runs)")
    ap.add_argument(
        "--gpt-oss-shape",
        action="store_true",
        help="the GPT-OSS layer shape (hidden = expert width 2880, 128 experts, top-4, 64 x 64 heads): "
        "MXFP4's 12 MiB units pad 1.1 %% there, but 78 %% at the default Qwen3-30B-A3B shape (refused)",
    )
    ap.add_argument("--dry-run", action="store_true", help="write checkpoints, plans and commands only")
    ap.add_argument(
        "--stock-twice",
        default="refused,fp8-online",
        help="cases (comma list; also the words refused, all, none) whose stock is served a second time in "
        "its own process, compiling afresh (VLLM_DISABLE_COMPILE_CACHE=1), to tell stock's own "
        "nondeterminism from a reap difference",
    )
    ap.add_argument(
        "--eager-pair",
        default="fp8-online",
        help="cases (comma list, or none) also served stock and reap-swap with --enforce-eager (no "
        "torch.compile, no CUDA graphs): reap vs stock without Inductor's per-process choices",
    )
    ap.add_argument("--serial-arms", action="store_true", help="one server per case at a time")
    ap.add_argument(
        "--decode-tokens",
        type=int,
        default=0,
        help="also time 1-stream decode (N tokens, 3 repeats) on stock and at every reap phase, with the "
        "phase's router hit rate, for the bound t_resident + (1 - h) t_all_missed; 0 = off. Time it "
        "with --jobs 1 --serial-arms",
    )
    ap.add_argument("--ckpt-jobs", type=int, default=4, help="checkpoints written at a time (processes)")
    ap.add_argument(
        "--reap-group-size",
        choices=["auto", "1", "2", "4", "8"],
        help="EXPERIMENTAL grouped units: pass --reap-group-size to the reap-swap servers; the plan's "
        "slices become seeded random ids (research/gpu/group_e2e.py) and expected bytes count groups",
    )
    ap.add_argument("--one-case", help=argparse.SUPPRESS)  # the per-case child process
    a = ap.parse_args(argv)
    bad = sorted(set(a.cases.split(",")) - set(CASES))
    if bad:
        ap.error(f"--cases: unknown {bad}; known: {', '.join(CASES)}")
    for flag, words in (("stock_twice", STOCK_TWICE_WORDS), ("eager_pair", ("none",))):
        bad = sorted(set(getattr(a, flag).split(",")) - set(CASES) - set(words) - {""})
        if bad:
            ap.error(f"--{flag.replace('_', '-')}: unknown {bad}; known: {', '.join((*words, *CASES))}")
    return a


def writer_argv(a: argparse.Namespace, fmt: str) -> list[str]:
    """make_quant_checkpoint.py's arguments for one format under DIR/checkpoints/."""
    shape = TINY if a.tiny else (GPT_OSS_SHAPE if a.gpt_oss_shape else [])
    out = str(a.out / "checkpoints")
    return ["--out", out, "--format", fmt, "--layers", str(a.layers), "--plain-attention", "1", *shape]


def checkpoint(a: argparse.Namespace, fmt: str) -> Path:
    folder = a.out / "checkpoints" / fmt
    if not checkpoint_ready(folder, fmt, a.layers):
        mqc.main(writer_argv(a, fmt))
    return folder


def case_info(name: str, model: Path, group_size: str | None = None) -> dict:
    """What the launcher does with the case (bound or refused; INT4: quant_budget) and its payload."""
    cfg = json.loads((model / "config.json").read_text())
    extra = CASES[name][1]
    cli = extra[extra.index("--quantization") + 1] if "--quantization" in extra else None
    qc = quantization_config(cfg.get("text_config") or cfg, cfg)
    s = read_model_shape(cfg)
    oai_mxfp4 = mxfp4.served_here(s.architecture)  # the launcher's rule
    served = served_quant_of(qc, cli, group_size or "1", oai_mxfp4)
    fmt = expert_format(served.scheme, s.hidden_size, s.moe_intermediate_size, s.dtype_bytes, s.expert_bias)
    return {
        "binds": served.engine_refusal is None,
        "triton": served.engine_refusal is None and served.triton,
        "engine_refusal": served.engine_refusal,
        "served_method": served.method,
        "payload_bytes": fmt.ideal,
        "plan_per_expert_bytes": s.expert_bytes,
        "kept_bytes_per_expert_model": fmt.kept,
        "dtype": cfg.get("torch_dtype", "bfloat16"),
    }


def common_args(name: str, info: dict, a: argparse.Namespace) -> list[str]:
    cc = {"cudagraph_capture_sizes": [1, 2, 4]}  # CUDA graphs on, few captures (start-up time)
    args = ["--served-model-name", "m", "--dtype", info["dtype"], "--max-model-len", "1024"]
    args += ["--max-num-seqs", "4", "--gpu-memory-utilization", str(a.gpu_memory_utilization)]
    args += ["--kv-cache-memory-bytes", str(KV_BYTES), "--no-enable-prefix-caching"]
    args += ["--compilation-config", json.dumps(cc)]
    return args + (["--moe-backend", "triton"] if info.get("triton", info["binds"]) else []) + CASES[name][1]


def commands(name: str, model: Path, info: dict, a: argparse.Namespace) -> dict:
    common = common_args(name, info, a)
    py = sys.executable
    stock = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), *common]
    reap = [py, "-m", "reap_swap.server", str(model), *common]
    reap += ["--reap-group-size", a.reap_group_size] if getattr(a, "reap_group_size", None) else []
    return {"stock": stock + gpu_e2e.PROBE_EXTENSION, "reap": reap}


DECODE_TOKENS = 0  # --decode-tokens (set in the case's child process)


def sample(srv: Server, label: str, rid: str | None = None) -> dict:
    """Greedy text and MoE digests; with --decode-tokens also decode tok/s and (reap-swap: `rid`,
    the request the phase's swap opened) the router misses of everything the phase served."""
    got = {"greedy": gpu_e2e.greedy(srv.url), "moe_probe": gpu_e2e.moe_probe(srv, label)}
    if DECODE_TOKENS:
        got["decode_1"] = gpu_e2e.decode_speed(srv.url, 1, n=DECODE_TOKENS, repeats=3)
        if rid is not None:
            got["router_misses"] = gpu_e2e.misses(srv, rid)
    return got


# the second stock server compiles on its own: with the same arguments it would otherwise load the
# first one's torch.compile artifacts (same config hash, same cache dir), Inductor's benchmarked
# choices included, and could not show that a fresh compile changes numerics (research.md, qcount)
FRESH_COMPILE = {"VLLM_DISABLE_COMPILE_CACHE": "1"}


def run_stock(
    argv: list[str], out: Path, deadline: float, name: str = "stock", env: dict | None = None
) -> dict:
    # VLLM_SERVER_DEV_MODE=1 opens /collective_rpc, which reap_moe_probe goes through (as in
    # gpu_e2e.py's stock arms; without it the probe answers 404 and no digest is comparable)
    timeout = max(30.0, deadline - time.time())
    env = {**gpu_e2e.DEV, **(env or {})}
    with Server(name, argv, out, env=env, port=free_port(), startup_timeout_s=timeout) as srv:
        return {"startup_s": srv.startup_s, "env": env, **sample(srv, name)}


def run_reap(
    argv: list[str], model: Path, out: Path, info: dict, deadline: float, name: str = "reap"
) -> dict:
    plan_path = out / ("plan.json" if name == "reap" else f"plan-{name}.json")
    gpu_e2e.make_plan(model, 0.0, 8, plan_path)  # empty core, a pool slot for every expert
    grouped_run = "--reap-group-size" in argv
    if grouped_run:  # slices of random ids: the physical order differs from the id order
        group_e2e.shuffle_plan(plan_path, seed=0)
    shape = gpu_e2e.model_shape(model)
    r: dict = {"phases": {}}
    timeout = max(30.0, deadline - time.time())
    argv = argv + ["--reap-plan", str(plan_path)]
    with Server(name, argv, out, env=gpu_e2e.DEV, port=free_port(), startup_timeout_s=timeout) as srv:
        r["startup_s"], r["status_start"] = srv.startup_s, gpu_e2e.status(srv)
        facts = engine_facts(r["status_start"])
        expect = group_e2e.GroupExpect(plan_path, facts.get("layouts") or {}) if grouped_run else None
        r["group_layout"] = {k: facts.get(k) for k in ("layout", "group_size", "layouts")} if expect else None
        gpu_e2e.open_request(srv, "p0")
        r["phases"]["0"] = sample(srv, "reap 0", "p0")
        resident: set[tuple[int, int]] = set()
        for label, pct, start in SWAPS:
            k = shape["experts"] * pct // 100
            wanted = gpu_e2e.first_experts(shape, k, start=min(start, shape["experts"] - k))
            want = {(int(lk.split("_")[1]), e) for lk, ids in wanted.items() for e in ids}
            sw = gpu_e2e.swap(srv, f"p{label}", wanted)
            sw["admitted_experts"] = len(want - resident)
            sw["expected_bytes"] = len(want - resident) * info["payload_bytes"] if info["binds"] else 0
            if expect is not None and expect.active:  # grouped: admitted groups x group payload
                sw.update(expect.swap(wanted))
            resident = want
            r["phases"][label] = {"swap": sw, **sample(srv, f"reap {label}", f"p{label}")}
            if grouped_run:  # router statistics stay in logical ids (0 % misses at 100 %)
                r["phases"][label]["misses"] = gpu_e2e.misses(srv, f"p{label}")
        r["status_end"] = gpu_e2e.status(srv)
    return r


def one_case(a: argparse.Namespace, name: str) -> dict:
    """The child process: stock then reap for one case, within the case's deadline."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # servers stop in their __exit__
    deadline = time.time() + a.case_timeout - 15
    global DECODE_TOKENS
    gpu_e2e.PROBE, gpu_e2e.GREEDY_TOKENS, DECODE_TOKENS = True, a.greedy_tokens, a.decode_tokens
    model = checkpoint(a, CASES[name][0])
    info = case_info(name, model, a.reap_group_size)
    out = a.out / name
    out.mkdir(parents=True, exist_ok=True)
    cmds = commands(name, model, info, a)
    res = {"case": name, "model": str(model), **info, "commands": cmds}
    arms = {
        "stock": lambda: run_stock(cmds["stock"], out, deadline),
        "reap": lambda: run_reap(cmds["reap"], model, out, info, deadline),
    }
    if listed(a.stock_twice, name, info["binds"]):
        # a second stock server, compiled afresh: is stock reproducible across processes?
        arms["stock2"] = lambda: run_stock(cmds["stock"], out, deadline, name="stock2", env=FRESH_COMPILE)
    if a.eager_pair != "none" and name in a.eager_pair.split(","):
        eager = ["--enforce-eager"]
        arms["stock_eager"] = lambda: run_stock(cmds["stock"] + eager, out, deadline, name="stock_eager")
        arms["reap_eager"] = lambda: run_reap(
            cmds["reap"] + eager, model, out, info, deadline, name="reap_eager"
        )

    def run_arm(arm: str) -> None:
        t0 = time.time()
        try:
            res[arm] = arms[arm]()
        except Exception as exc:  # noqa: BLE001 - record and go on with the other arms
            log(name, arm, "FAILED", repr(exc)[:2000])
            res[arm] = {"error": repr(exc)[:5000]}
        res[arm]["wall_s"] = time.time() - t0
        write_case(a, name, res)

    # the arms are independent (compared only in the summary): served at once unless --serial-arms
    with ThreadPoolExecutor(max_workers=1 if a.serial_arms else len(arms)) as pool:
        list(pool.map(run_arm, arms))
    return res


def write_case(a: argparse.Namespace, name: str, res: dict) -> None:
    path = a.out / "cases" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))


def child_argv(a: argparse.Namespace, name: str) -> list[str]:
    """The per-case child's command line: every option of the parent's, so a flag cannot be lost on
    the way to the servers (run 15: an INT4 opt-in flag, since retired, was, and the INT4 servers refused)."""
    argv = [sys.executable, __file__, "--one-case", name, "--out", str(a.out), "--layers", str(a.layers)]
    argv += ["--gpu-memory-utilization", str(a.gpu_memory_utilization), "--case-timeout", str(a.case_timeout)]
    argv += [
        "--greedy-tokens",
        str(a.greedy_tokens),
        "--stock-twice",
        a.stock_twice,
        "--eager-pair",
        a.eager_pair,
        "--decode-tokens",
        str(a.decode_tokens),
    ]
    argv += (["--tiny"] if a.tiny else []) + (["--serial-arms"] if a.serial_arms else [])
    argv += ["--gpt-oss-shape"] if a.gpt_oss_shape else []
    argv += ["--reap-group-size", a.reap_group_size] if a.reap_group_size else []
    return argv


def spawn(a: argparse.Namespace, name: str) -> dict:
    """Run one case in a child process with a hard timeout; its JSON (or the timeout) back."""
    argv = child_argv(a, name)
    t0 = time.time()
    with open(a.out / f"{name}.case.log", "w") as logf:
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=a.case_timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # SIGTERM: the child stops its servers
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    path = a.out / "cases" / f"{name}.json"
    res = json.loads(path.read_text()) if path.exists() else {"case": name}
    res.update(case_wall_s=time.time() - t0, case_rc=proc.returncode, timed_out=proc.returncode == 124)
    return res


def write_checkpoints(a: argparse.Namespace, names: list[str]) -> None:
    """Each missing checkpoint once, before any server starts, `--ckpt-jobs` processes at a time;
    complete ones (their recipe matches) are reused."""
    todo = [f for f in dict.fromkeys(CASES[n][0] for n in names)]
    todo = [f for f in todo if not checkpoint_ready(a.out / "checkpoints" / f, f, a.layers)]
    log("checkpoints: reused", len(set(CASES[n][0] for n in names)) - len(todo), "to write", todo)
    if len(todo) <= 1 or a.ckpt_jobs <= 1:
        for fmt in todo:
            checkpoint(a, fmt)
        return

    def write(fmt: str) -> int:  # its own interpreter: no fork of a process that ran torch
        logf = a.out / f"checkpoint-{fmt}.log"
        with open(logf, "w") as f:
            rc = subprocess.call([sys.executable, mqc.__file__, *writer_argv(a, fmt)], stdout=f, stderr=f)
        log("checkpoint", fmt, "rc", rc, "log", logf)
        return rc

    with ThreadPoolExecutor(max_workers=a.ckpt_jobs) as pool:
        rcs = dict(zip(todo, pool.map(write, todo)))
    bad = [f for f in todo if rcs[f] != 0 or not checkpoint_ready(a.out / "checkpoints" / f, f, a.layers)]
    if bad:
        raise SystemExit(f"checkpoint writer failed for {bad}; logs: {a.out}/checkpoint-<format>.log")


def main(argv=None) -> int:
    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.one_case:
        one_case(a, a.one_case)
        return 0
    names = a.cases.split(",")
    write_checkpoints(a, names)
    if a.dry_run:
        plans = {}
        for n in names:
            model = checkpoint(a, CASES[n][0])
            info = case_info(n, model, a.reap_group_size)
            plans[n] = {**info, "commands": commands(n, model, info, a)}
            gpu_e2e.make_plan(model, 0.0, 8, a.out / f"plan-{n}.json")
        (a.out / "dry_run.json").write_text(json.dumps(plans, indent=1))
        print(json.dumps(plans, indent=1))
        return 0
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    t0 = time.time()
    results: dict[str, dict] = {}
    pool = ThreadPoolExecutor(max_workers=a.jobs)
    try:
        for name, res in zip(names, pool.map(lambda n: spawn(a, n), names)):
            results[name] = res
    finally:  # also when gpu_run.sh's cap SIGTERMs this driver (its case processes get it too):
        pool.shutdown(wait=True, cancel_futures=True)  # no queued case starts after the cap (map's too)
        write_summary(a, names, results, time.time() - t0)  # what the cases wrote
    return 0


def write_summary(a: argparse.Namespace, names: list[str], results: dict, wall_s: float) -> None:
    """quant_e2e.json / .md; a case that never returned (the driver was cut) from its own
    cases/<case>.json, as far as its arms got, marked timed out."""
    for name in names:
        if name not in results:
            path = a.out / "cases" / f"{name}.json"
            try:
                res = json.loads(path.read_text()) if path.exists() else {"case": name}
            except ValueError:  # cut mid-write
                res = {"case": name}
            results[name] = {**res, "timed_out": True, "cut": "the driver stopped before this case returned"}
    doc = {"wall_s": wall_s, "cases": {n: results[n] for n in names}}
    doc["rows"] = [case_row(r) for r in doc["cases"].values()]
    (a.out / "quant_e2e.json").write_text(json.dumps(doc, indent=1))
    (a.out / "quant_e2e.md").write_text(markdown(doc))
    print(markdown(doc))


if __name__ == "__main__":
    serving.stop_servers_on_sigterm()
    sys.exit(main())
