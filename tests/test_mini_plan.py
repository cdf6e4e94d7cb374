"""The committed mini-MoE plan belongs to the committed checkpoint and calibration split.

Why: plans/reap-mini-moe.plan.json is measured routing of one exact checkpoint. If the model is
retrained and the plan is not re-derived (scripts/build_mini_plan.py), the demo and every
measurement on it would silently use another model's statistics; these digests catch that.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import orjson
import pytest

from reap_swap.plan.document import load_plan
from reap_swap.sizing.model_shape import read_model_shape

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "reap-mini-moe"
PLAN = ROOT / "plans" / "reap-mini-moe.plan.json"
CALIBRATION = ROOT / "data" / "corpus" / "calibration.jsonl"
REBUILD = "re-derive it: .venv/bin/python scripts/build_mini_plan.py"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def plan():
    return load_plan(PLAN, read_model_shape(MODEL))  # raises PlanError if invalid for this model


def test_plan_records_the_committed_checkpoint(plan):
    recorded = plan.document["scorerArtifacts"]["checkpoint"]
    weights = MODEL / "model.safetensors"
    assert recorded["sha256"] == _sha256(weights), f"plan measured on another checkpoint; {REBUILD}"
    assert recorded["bytes"] == weights.stat().st_size


def test_plan_records_the_calibration_split(plan):
    recorded = plan.document["scorerArtifacts"]["calibrationCorpus"]
    assert recorded["path"] == "data/corpus/calibration.jsonl"
    assert recorded["sha256"] == _sha256(CALIBRATION), f"calibration split changed; {REBUILD}"


def test_plan_was_built_by_the_script_with_its_budget(plan):
    artifacts = plan.document["scorerArtifacts"]
    assert artifacts["builtBy"] == "scripts/build_mini_plan.py"
    assert artifacts["parameters"]["budget_ratio"] == 0.5
    shape = read_model_shape(MODEL)
    all_expert_bytes = len(shape.moe_layers) * shape.num_experts * shape.expert_bytes
    assert plan.swappable_budget_bytes == all_expert_bytes // 2
    assert plan.core_bytes() < plan.swappable_budget_bytes  # room left for per-request slices


def test_plan_has_a_slice_prior_per_corpus_domain(plan):
    """The client's `prior` strategy needs one ranking per domain of the calibration split."""
    tags = {
        orjson.loads(line).get("source") for line in CALIBRATION.read_bytes().splitlines() if line.strip()
    }
    priors = plan.document["scorerArtifacts"]["taskFamilySlicePriors"]
    assert tags <= set(priors) and "global" in priors
    assert list(plan.document["scorerArtifacts"]["corpusTags"]) == sorted(tags)
