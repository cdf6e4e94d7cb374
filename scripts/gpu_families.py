#!/usr/bin/env python3
"""Full-size MoE families on the GPU without checkpoints (issue 15, item 3): vLLM's
`--load-format dummy` builds the model from a config.json alone.

For one config (tests/data/*_config.json): write a model folder (the config, optionally at reduced
depth, and an offline tokenizer covering the whole vocabulary: make_tiny_moe's), a plan (the one
given, e.g. the field plan, or make_family_models.family_plan), then run
  stock      stock vLLM, every expert in HBM (+ the MoE probe alone): greedy text, decode tok/s
  reap       reap-swap with the plan core filled at startup; counters under CUDA graphs (a unique
             prompt's prefill must count prompt tokens x top-k x MoE layers), then phases
             core -> first slice of every layer -> 50 % -> 100 % -> core again, each with greedy
             text, decode tok/s, the MoE probe and the swap's bytes/time
and for each server: startup time, peak host memory in use (MemTotal - MemAvailable, which also
sees the engine's cuMemCreate host backing that no process RSS shows) and HBM in use (nvidia-smi).
A server that drives MemAvailable under --host-guard-gib is killed (recorded) before the kernel's
OOM killer picks a victim.

Comparisons (logged, and in OUT/<name>/gpu_e2e.json): reap's greedy text vs stock's, and every
reap phase's probe digests vs stock's and vs reap's own core phase. vLLM's dummy initialisation
re-seeds every tensor with the same seed (values depend only on the tensor's size, dtype and
device type), and reap-swap's experts are initialised through UVA views (CUDA tensors), so both
servers start from the same weights; the probe vs reap's own core phase holds regardless.

Reuses scripts/gpu_e2e.py (arms, measurements, swaps, probes); only the family-specific parts are
here. Usage (device, kit installed, PYTHONPATH=/tmp/site):
  python3 scripts/gpu_families.py --config tests/data/qwen3_5_moe_35b_a3b_config.json --name qwen35 \\
      --plan ../shared/fixtures/strict30-v2-plan.json --out $OUT/families --arms reap,stock
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))
import gpu_e2e as e2e  # noqa: E402
import make_family_models  # noqa: E402
import make_tiny_moe  # noqa: E402

from reap_swap import serving  # noqa: E402
from reap_swap.model_shape import read_model_shape  # noqa: E402

ENGINE = [
    "--served-model-name", "m", "--dtype", "bfloat16", "--max-model-len", "2048",
    "--max-num-seqs", "8", "--gpu-memory-utilization", "0.90", "--moe-backend", "triton",
    "--load-format", "dummy", "--no-enable-prefix-caching",
]  # fmt: skip
GIB = 2**30


def meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0]) * 1024
    return out


def hbm_used_gib() -> list[float] | None:
    try:
        text = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        return [round(int(x) / 1024, 2) for x in text.split()]
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


class HostMemory:
    """Samples host memory in use every 0.5 s while a server lives; kills it under the guard."""

    def __init__(self, guard_gib: float):
        self.guard = guard_gib * GIB
        self.base = meminfo()
        self.peak_used, self.min_available = 0, self.base["MemAvailable"]
        self.killed, self.server = False, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            m = meminfo()
            self.peak_used = max(self.peak_used, m["MemTotal"] - m["MemAvailable"])
            self.min_available = min(self.min_available, m["MemAvailable"])
            proc = getattr(self.server, "proc", None)
            if m["MemAvailable"] < self.guard and proc is not None and not self.killed:
                self.killed = True
                e2e.log("host memory guard: MemAvailable", m["MemAvailable"] / GIB, "GiB; killing the server")
                serving.kill_group(proc)

    def __enter__(self) -> HostMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def snapshot(self) -> dict:
        total = self.base["MemTotal"]
        return {
            "host_total_gib": round(total / GIB, 2),
            "host_used_before_gib": round((total - self.base["MemAvailable"]) / GIB, 2),
            "host_peak_used_gib": round(self.peak_used / GIB, 2),
            "host_min_available_gib": round(self.min_available / GIB, 2),
            "killed_by_guard": self.killed,
            "hbm_used_gib": hbm_used_gib(),
        }


def text_only_supported(arch: str) -> bool:
    """Does this vLLM register the text-only class (e.g. Qwen3_5MoeForCausalLM)? Not every version
    does; the multimodal class also builds a vision tower and needs an image processor."""
    from vllm.model_executor.models.registry import ModelRegistry

    return arch in ModelRegistry.get_supported_archs()


def text_only(cfg: dict) -> dict:
    """A multimodal wrapper's language model as its own config: text_config at the top level."""
    text = dict(cfg["text_config"])
    arch = cfg["architectures"][0].replace("ForConditionalGeneration", "ForCausalLM")
    return {**text, "architectures": [arch], "tie_word_embeddings": cfg.get("tie_word_embeddings", False)}


def write_model(config: Path, dest: Path, layers: int | None) -> Path:
    """dest/config.json (at `layers` depth if given) + a tokenizer covering the whole vocabulary.

    A multimodal config becomes its text-only model where this vLLM has that class (the plan's
    layers are the language model's); otherwise it stays multimodal and the caller passes
    --limit-mm-per-prompt with zero images and videos."""
    dest.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(config.read_text())
    if isinstance(cfg.get("text_config"), dict):
        candidate = text_only(cfg)
        if text_only_supported(candidate["architectures"][0]):
            cfg = candidate
        else:
            (dest / "preprocessor_config.json").write_text(
                json.dumps(
                    {
                        "image_processor_type": "Qwen2VLImageProcessor",
                        "patch_size": 16,
                        "temporal_patch_size": 2,
                        "merge_size": 2,
                    }
                )  # fmt: skip
            )
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    if layers:
        text["num_hidden_layers"] = layers
        if isinstance(text.get("layer_types"), list):
            text["layer_types"] = text["layer_types"][:layers]
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    if not (dest / "tokenizer.json").exists():
        make_tiny_moe.build_tokenizer(dest, int(text["vocab_size"]))
    return dest


def probe_equal(reference: dict | None, other: dict | None) -> dict | None:
    """compare_probes over rank 0 of two gpu_e2e.moe_probe() answers."""
    from reap_swap.moe_probe import compare_probes

    try:
        return compare_probes(reference["ranks"][0], other["ranks"][0])
    except (TypeError, KeyError, IndexError):
        return None


def counters_under_graphs(srv: serving.Server, shape: dict) -> dict:
    """One unique prompt, prefilled once: every routed selection counted (CUDA graphs on)."""
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
    tokens = r["usage"]["prompt_tokens"]
    got = e2e.misses(srv, "count")["totals"]["observed_selections"]
    want = tokens * shape["top_k"] * shape["layers"]
    e2e.log("counters", got, "of", want, "routed selections (prompt", tokens, "tokens)")
    return {"prompt_tokens": tokens, "observed": got, "expected": want, "equal": got == want}


def phases(plan: dict, shape: dict) -> list[tuple[str, dict]]:
    first_slice = {
        key: [layer["sliceCatalog"][0]["sliceId"]]
        for key, layer in plan["perLayer"].items()
        if layer.get("sliceCatalog")
    }
    half = e2e.first_experts(shape, shape["experts"] // 2)
    every = e2e.first_experts(shape, shape["experts"])
    return [("slices", first_slice), ("50", half), ("100", every), ("core_again", {})]


def reap_phase(srv, label: str, active: dict, res: dict, core_probe, d1) -> None:
    sw = e2e.swap(srv, f"p-{label}", active)
    entry = {"swap": sw, **e2e.measure(srv, f"p-{label}", d1=d1, d8=None)}
    entry["moe_probe"] = e2e.moe_probe(srv, f"reap {label}")
    entry["probe_vs_core"] = probe_equal(core_probe, entry["moe_probe"])
    e2e.log("reap", label, "probe vs core", entry["probe_vs_core"])
    res["reap"]["phases"][label] = entry


def arm_reap(argv: list[str], out: Path, shape: dict, plan_path: Path, res: dict, a, save) -> None:
    plan = json.loads(plan_path.read_text())
    r = res.setdefault("reap", {"phases": {}})
    with HostMemory(a.host_guard_gib) as mem:
        mem.server = srv = serving.Server(
            "reap", argv + ["--reap-plan", str(plan_path)], out, env=e2e.DEV,
            port=serving.free_port(), startup_timeout_s=a.startup_timeout,
        )  # fmt: skip
        try:
            with srv:
                r.update(startup_s=srv.startup_s, argv=srv.command, host_startup=mem.snapshot())
                r["status_start"] = e2e.status(srv)
                r["counters"] = counters_under_graphs(srv, shape)
                e2e.open_request(srv, "p-core")
                core = {**e2e.measure(srv, "p-core", d1=a.decode, d8=None)}
                core["moe_probe"] = e2e.moe_probe(srv, "reap core")
                r["phases"]["core"] = core
                save()
                for label, active in phases(plan, shape):
                    reap_phase(srv, label, active, res, core["moe_probe"], a.decode)
                    save()
                r["status_end"] = e2e.status(srv)
        finally:
            r["host"] = mem.snapshot()


def arm_stock(argv: list[str], out: Path, res: dict, a) -> None:
    with HostMemory(a.host_guard_gib) as mem:
        try:
            e2e.arm_stock(argv, "stock-gpu", out, None, res, d1=a.decode, d8=None)
        finally:
            res.setdefault("stock-gpu", {})["host"] = mem.snapshot()


def compare_with_stock(name: str, res: dict) -> None:
    """Every reap phase's greedy text and probe digests against stock's (both arms run first)."""
    stock = res.get("stock-gpu") or {}
    for label, entry in ((res.get("reap") or {}).get("phases") or {}).items():
        if stock.get("greedy") and entry.get("greedy"):
            entry["greedy_vs_stock"] = serving.compare(stock["greedy"], entry["greedy"])
        entry["probe_vs_stock"] = probe_equal(stock.get("moe_probe"), entry.get("moe_probe"))
        e2e.log(
            name, label, "greedy vs stock", entry.get("greedy_vs_stock"), "probe", entry["probe_vs_stock"]
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plan", type=Path, help="default: family_plan (core 25 %%, budget 100 %%)")
    ap.add_argument("--layers", type=int, help="reduced depth (num_hidden_layers)")
    ap.add_argument("--arms", default="reap,stock")
    ap.add_argument("--models", type=Path, default=Path("/tmp/families"))
    ap.add_argument("--startup-timeout", type=float, default=420.0)
    ap.add_argument("--host-guard-gib", type=float, default=3.0)
    ap.add_argument("--greedy-tokens", type=int, default=24)
    ap.add_argument("--engine", help="replace the engine arguments (a shell-quoted string)")
    a = ap.parse_args()
    # `timeout` (gpu_families.sh's cap) sends SIGTERM: unwind, so each `with Server` kills its
    # server's process group (a setsid group `timeout` would not reach) before the next family
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    a.decode = (128, 1)
    out = a.out / a.name
    out.mkdir(parents=True, exist_ok=True)
    model = write_model(a.config, a.models / a.name, a.layers)
    shape = e2e.model_shape(model)
    plan_path = a.plan or out / "plan.json"
    if not a.plan:
        doc = make_family_models.family_plan(read_model_shape(model), a.name, 0.25, 8, 1.0)
        plan_path.write_text(json.dumps(doc))
    e2e.PROBE, e2e.GREEDY_TOKENS = True, a.greedy_tokens
    engine = shlex.split(a.engine) if a.engine else list(ENGINE)
    if (model / "preprocessor_config.json").exists():  # multimodal class kept: no image/video inputs
        engine += ["--limit-mm-per-prompt", json.dumps({"image": 0, "video": 0})]
    vllm = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), *engine]
    reap = [sys.executable, "-m", "reap_swap.server", str(model), *engine]
    results_path = out / "gpu_e2e.json"
    res: dict = {
        "_meta": {"config": str(a.config), "shape": shape, "engine": engine, "started": time.ctime()}
    }

    def save():
        results_path.write_text(json.dumps(res, indent=1))

    for arm in a.arms.split(","):
        t0 = time.time()
        e2e.log(a.name, "arm", arm)
        try:
            if arm == "stock":
                arm_stock(vllm, out, res, a)
            elif arm == "reap":
                arm_reap(reap, out, shape, plan_path, res, a, save)
            else:
                raise ValueError(f"unknown arm {arm}")
        except Exception as exc:  # noqa: BLE001 - keep going with the next arm, record why
            e2e.log(a.name, arm, "FAILED", repr(exc)[:3000])
            res.setdefault(arm, {})["error"] = repr(exc)[:5000]
        res.setdefault(arm, {})["wall_s"] = time.time() - t0
        save()
    compare_with_stock(a.name, res)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
