"""selection: static / prior / probe / refresh stay within the budget and the plan, are
deterministic, and pick what their definitions say."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reap_swap.client import selection as S
from reap_swap.client import strategies
from reap_swap.plan.active_set import (
    SwapRequest,
    check_budget,
    normalize_active_set,
    resident_sets,
    signature,
)
from reap_swap.plan.document import load_plan

FIXTURE = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "strict30-v2-plan.json"
PE = 1000
PY = "import os\n\ndef main(argv):\n    if argv is None:\n        return self.run(argv)\n"
PROSE = (
    "The daemon reads its configuration at start-up. It is the only process that can write to "
    "the log, and the administrator should restart it after every change of the file."
)
C_SRC = "#include <stdio.h>\nstatic int count;\nstruct node *next = NULL;\n/* walk */\n"
SHELL = '#!/bin/sh\nif [ -f "$HOME/.rc" ]; then\n  . "$HOME/.rc" 2>&1 >/dev/null\nfi\necho done\n'


def plan_doc(budget_experts: int, max_refreshes: int = 1) -> dict:
    """Two layers of 12 experts: core {0,1}; slices a={2,3} b={4,5,6} c={6,7} d={8}; 9..11 not offered.
    taskPriors: 'python' likes a, 'prose' likes b, global likes c."""

    def layer() -> dict:
        return {
            "numExperts": 12,
            "coreExperts": [0, 1],
            "sliceCatalog": [
                {
                    "sliceId": "a",
                    "experts": [2, 3],
                    "activationMass": 0.1,
                    "taskPriors": {"global": 0.1, "python": 0.5, "prose": 0.01},
                },
                {
                    "sliceId": "b",
                    "experts": [4, 5, 6],
                    "activationMass": 0.1,
                    "taskPriors": {"global": 0.1, "python": 0.01, "prose": 0.6},
                },
                {
                    "sliceId": "c",
                    "experts": [6, 7],
                    "activationMass": 0.3,
                    "taskPriors": {"global": 0.3, "python": 0.02, "prose": 0.02},
                },
                {
                    "sliceId": "d",
                    "experts": [8],
                    "activationMass": 0.0,
                    "taskPriors": {"global": 0.0, "python": 0.0, "prose": 0.0},
                },
            ],
        }

    return {
        "mode": "dynamic_core_specialist",
        "budget": {
            "per_expert_bytes": PE,
            "swappable_expert_budget_bytes": budget_experts * PE,
            "max_refreshes_per_request": max_refreshes,
        },
        "perLayer": {"layer_0": layer(), "layer_5": layer()},
    }


# ----------------------------------------------------------------------------- random plans


@st.composite
def plans(draw):
    """Random valid plans: overlapping slices, slices reaching into the core, missing priors."""
    n_layers = draw(st.integers(1, 4))
    n_experts = draw(st.integers(4, 16))
    families = draw(
        st.lists(
            st.sampled_from(["python", "prose", "c", "shell", "math", "zeta_cluster"]),
            max_size=3,
            unique=True,
        )
    )
    per_layer, total_core, total_candidates = {}, 0, 0
    for li in draw(st.lists(st.integers(0, 40), min_size=n_layers, max_size=n_layers, unique=True)):
        ids = st.integers(0, n_experts - 1)
        core = draw(st.lists(ids, max_size=n_experts // 2, unique=True))
        slices = []
        for s in range(draw(st.integers(0, 6))):
            experts = draw(st.lists(ids, min_size=1, max_size=4, unique=True))
            entry = {"sliceId": f"l{li}s{s}", "experts": experts}
            if draw(st.booleans()):
                # masses are measured shares: 0 or at least 1e-9 (subnormal floats underflow once
                # weighted, which says nothing about the selection logic)
                mass = st.one_of(st.just(0.0), st.floats(1e-9, 1))
                entry["activationMass"] = draw(mass)
                entry["taskPriors"] = {f: draw(mass) for f in families} | {"global": entry["activationMass"]}
            slices.append(entry)
        per_layer[f"layer_{li}"] = {"numExperts": n_experts, "coreExperts": core, "sliceCatalog": slices}
        total_core += len(core)
        total_candidates += len(set(core).union(*[s["experts"] for s in slices]))
    budget = draw(st.integers(total_core, total_candidates + 2)) * PE
    doc = {
        "mode": "dynamic_core_specialist",
        "budget": {
            "per_expert_bytes": PE,
            "swappable_expert_budget_bytes": budget,
            "max_refreshes_per_request": draw(st.integers(0, 2)),
        },
        "perLayer": per_layer,
    }
    return load_plan(doc)


@st.composite
def misses_for(draw, plan):
    out = {}
    for index, layer in plan.layers.items():
        experts = draw(st.lists(st.integers(0, layer.num_experts - 1), max_size=6, unique=True))
        out[index] = {e: draw(st.floats(0.0001, 1)) for e in experts if e not in layer.core}
    return out


PROMPTS = st.sampled_from(["", "hi", PY, PROSE, C_SRC, SHELL, PY + PROSE, "zeta cluster zeta_cluster"])


def _assert_valid(plan, sel, budget):
    assert sel.resident_bytes <= budget <= plan.swappable_budget_bytes
    # the server's own functions accept the payload and arrive at the same keep-set
    body = sel.payload("r1")
    SwapRequest.model_validate(body)
    keep = resident_sets(plan, normalize_active_set(plan, body["active_set"]))
    assert keep == sel.resident
    assert check_budget(plan, keep, body.get("budget_bytes")) >= sel.resident_bytes
    assert signature(keep) == sel.signature
    for index, ids in sel.resident.items():
        assert plan.layers[index].core <= ids <= plan.layers[index].candidates
    for index, sids in sel.slices.items():
        assert set(sids) <= set(plan.layers[index].slice_by_id)
        assert len(set(sids)) == len(sids)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_random_plans_never_over_budget_never_outside_plan_deterministic(data):
    plan = data.draw(plans())
    prompt = data.draw(PROMPTS)
    misses = data.draw(misses_for(plan))
    ask = data.draw(
        st.one_of(st.none(), st.integers(plan.core_bytes(), plan.swappable_budget_bytes + 5 * PE))
    )
    budget = S.effective_budget(plan, ask)
    for name in strategies.STRATEGIES:
        sel = strategies.select(plan, name, prompt, budget_bytes=ask, probe=misses)
        _assert_valid(plan, sel, budget)
        again = strategies.select(
            plan,
            name,
            prompt,
            budget_bytes=ask,
            probe={k: dict(reversed(list(v.items()))) for k, v in reversed(list(misses.items()))},
        )
        assert (again.slices, again.signature, again.values) == (sel.slices, sel.signature, sel.values)
        if name == "static":
            assert sel.slices == {} and sel.resident == plan.core_sets()
        for routed in (None, misses):
            new = S.refresh(plan, sel, misses, 0, prompt, routed=routed)
            if new is not None:
                _assert_valid(plan, new, budget)
                assert new.phase == "decode_refresh" and new.signature != sel.signature
                assert plan.max_refreshes_per_request >= 1
        assert S.refresh(plan, sel, misses, plan.max_refreshes_per_request, prompt) is None


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_greedy_fill_leaves_no_valuable_slice_that_would_still_fit(data):
    """Maximality: after prior/probe, every slice left out either adds nothing, is worth nothing,
    or no longer fits in what is left of the budget."""
    plan = data.draw(plans())
    prompt = data.draw(PROMPTS)
    misses = data.draw(misses_for(plan))
    for name in ("prior", "probe"):
        sel = strategies.select(plan, name, prompt, probe=misses)
        left = sel.budget_bytes - sel.resident_bytes
        priors = S.slice_priors(plan, sel.features.weights)
        for index, layer in plan.layers.items():
            for i, s in enumerate(layer.slices):
                new = set(s.experts) - sel.resident[index]
                if not new:
                    continue
                worth = priors[index][i] > 0 or (
                    name == "probe" and any(misses[index].get(e, 0) > 0 for e in new)
                )
                assert not worth or len(new) * PE > left, (name, index, s.slice_id)


# ----------------------------------------------------------------------------- what each strategy picks


def test_static_is_core_only_and_budget_must_hold_core():
    plan = load_plan(plan_doc(budget_experts=10))
    sel = S.select_static(plan)
    assert (
        sel.slices == {}
        and sel.resident_bytes == 4 * PE
        and sel.payload("r") == {"request_id": "r", "phase": "prefill", "active_set": {}}
    )
    with pytest.raises(S.SelectionError, match="does not hold the plan's core"):
        S.select_static(plan, budget_bytes=3 * PE)


def test_prior_follows_the_prompt_family():
    plan = load_plan(plan_doc(budget_experts=4 + 2 * 2))  # core 2x2 + room for 4 more experts
    py = S.select_prior(plan, PY)
    assert py.features.family == "python"
    assert py.slices == {0: ("a",), 5: ("a",)}  # 2 experts each, 0.5 python prior
    prose = S.select_prior(plan, [{"role": "user", "content": PROSE}])
    assert prose.features.family == "prose"
    # b (3 experts) does not fit twice in 4; the best per byte is taken, then what still fits
    assert prose.slices[0][0] == "b" and prose.resident_bytes <= 8 * PE
    nothing = S.select_prior(plan, "")
    assert nothing.features.family is None and nothing.features.weights == {"global": 1.0}
    assert nothing.slices == {0: ("c",), 5: ("c",)}  # global likes c
    assert "d" not in str(S.select_prior(load_plan(plan_doc(budget_experts=22)), "").slices)  # worth 0


def test_short_prompts_lean_on_the_global_prior():
    plan = load_plan(plan_doc(budget_experts=8))
    short = S.prompt_features(plan, "def f(): return None")
    long_ = S.prompt_features(plan, PY * 6)
    assert short.family == long_.family == "python"
    assert 0 < short.weights["python"] < long_.weights["python"] < 1
    assert sum(short.weights.values()) == pytest.approx(1.0)


def test_classifier_on_the_four_corpus_families():
    families = ("c", "prose", "python", "shell")
    for text, want in ((PY, "python"), (PROSE, "prose"), (C_SRC, "c"), (SHELL, "shell")):
        scores = S.classify(text, families)
        assert max(scores, key=scores.get) == want, scores


def test_rank_only_priors_from_scorer_artifacts():
    """A plan whose slices carry no per-family prior but whose artifacts rank them per cluster."""
    doc = plan_doc(budget_experts=8)
    for layer in doc["perLayer"].values():
        for s in layer["sliceCatalog"]:
            s["taskPriors"] = {"global": s["taskPriors"]["global"]}
    doc["scorerArtifacts"] = {"promptClusterPriors": {"math": {"layer_0": ["a", "c", "b"], "layer_5": ["a"]}}}
    plan = load_plan(doc)
    assert S.plan_families(plan) == ("math",)
    priors = S.slice_priors(plan, {"math": 1.0})
    # rank r gets the layer's r-th largest global prior (0.3, 0.1, 0.1, 0.0); unlisted slices get 0
    assert priors[0] == [0.3, 0.1, 0.1, 0.0]
    assert priors[5] == [0.3, 0.0, 0.0, 0.0]
    sel = S.select_prior(plan, "Solve the equation 3 + 4 = x and prove the theorem about the integral.")
    assert sel.features.family == "math" and sel.slices[0][0] == "a" and sel.slices[5][0] == "a"


def test_probe_covers_missed_mass_per_byte_then_fills_by_prior():
    plan = load_plan(plan_doc(budget_experts=4 + 3))  # room for 3 experts beyond the core
    # layer 0: expert 8 (slice d, 1 expert) missed 0.2; expert 4 (slice b, 3 experts) missed 0.3
    misses = {0: {8: 0.2, 4: 0.3}, 5: {}}
    sel = S.select_probe(plan, misses, "")
    # per byte: d = 0.2/1 beats b = 0.3/3; then 2 experts left: c (global prior 0.3) somewhere
    assert sel.slices[0][0] == "d"
    assert sel.values["d"] == pytest.approx(0.2)
    assert sel.resident_bytes <= 7 * PE
    assert "c" in sel.slices.get(0, ()) + sel.slices.get(5, ())
    with pytest.raises(S.SelectionError, match="needs the router misses"):
        strategies.select(plan, "probe", "x")


def test_missed_mass_from_a_router_misses_payload():
    payload = {
        "layers": {
            "0": {
                "observed_mass": 10.0,
                "observed_selections": 20,
                "inactive_mass": 4.0,
                "missed_selections": 5,
                "inactive_experts": [3, 9],
            },
            "5": {
                "observed_mass": 2.0,
                "observed_selections": 4,
                "inactive_mass": 1.0,
                "inactive_expert_mass": {"6": 0.75, "7": 0.25, "8": 0.0},
            },
            "7": {
                "observed_mass": 0.0,
                "observed_selections": 0,
                "inactive_mass": 0.0,
                "inactive_experts": [],
            },
            "9": {
                "observed_mass": 0.0,
                "observed_selections": 10,
                "inactive_mass": 0.0,
                "missed_selections": 4,
                "inactive_experts": [1, 2],
            },
        }
    }
    m = S.missed_mass(payload)
    assert m[0] == {3: pytest.approx(0.2), 9: pytest.approx(0.2)}  # 4.0 split evenly, / observed 10
    assert m[5] == {6: pytest.approx(0.375), 7: pytest.approx(0.125)}
    assert 7 not in m
    assert m[9] == {1: pytest.approx(0.2), 2: pytest.approx(0.2)}  # no gate weights: selections
    assert S.routed_share(payload) is None


def test_missed_mass_and_routed_share_from_per_expert_counts():
    """The server's expert_counts: exact per-expert shares of the layer's routed selections."""
    counts = [5, 3, 0, 2, 0, 0, 0, 0, 6, 4, 0, 0]  # 20 selections
    payload = {
        "layers": {
            "0": {
                "observed_selections": 20,
                "observed_mass": 10.0,
                "inactive_mass": 5.0,
                "missed_selections": 10,
                "inactive_experts": [3, 8, 9],
                "expert_counts": counts,
            }
        }
    }
    assert S.missed_mass(payload) == {0: {3: 0.1, 8: 0.3, 9: 0.2}}
    assert S.routed_share(payload) == {0: {0: 0.25, 1: 0.15, 3: 0.1, 8: 0.3, 9: 0.2}}


def test_refresh_swaps_in_what_the_running_request_misses_within_the_limit():
    plan = load_plan(plan_doc(budget_experts=4 + 2, max_refreshes=1))
    first = S.select_prior(plan, "")  # global prior: c in one layer
    assert first.slice_count == 1
    layer_with_c = next(iter(first.slices))
    other = 5 if layer_with_c == 0 else 0
    # the running request misses heavily on slice a of the other layer
    new = S.refresh(plan, first, {other: {2: 0.6, 3: 0.6}}, refresh_count=0)
    assert new is not None and new.phase == "decode_refresh"
    assert new.slices == {other: ("a",)}
    assert new.payload("r")["phase"] == "decode_refresh"
    assert S.refresh(plan, first, {other: {2: 0.6, 3: 0.6}}, refresh_count=1) is None  # limit 1 used
    # small misses do not outweigh what is resident (valued at its prior 0.3)
    assert S.refresh(plan, first, {other: {2: 0.01}}, refresh_count=0) is None
    # with every expert's share known, the resident slice is valued by its real use instead
    c_layer = {6: 0.2, 7: 0.2}  # slice c's experts were used: 0.4 of the layer
    kept = S.refresh(
        plan, first, {other: {2: 0.1, 3: 0.1}}, 0, routed={layer_with_c: c_layer, other: {2: 0.1, 3: 0.1}}
    )
    assert kept is None  # c (0.4 of its layer) beats a (0.2 of the other layer): nothing changes
    unused = S.refresh(
        plan, first, {other: {2: 0.1, 3: 0.1}}, 0, routed={layer_with_c: {6: 0.01}, other: {2: 0.1, 3: 0.1}}
    )
    assert unused is not None and unused.slices == {other: ("a",)}  # c was barely used: a replaces it


@pytest.mark.skipif(not FIXTURE.exists(), reason=f"shared fixture missing: {FIXTURE}")
def test_fixture_plan_selection_within_budget_and_deterministic():
    plan = load_plan(FIXTURE)
    for prompt in (PY, PROSE, "", SHELL):
        a = S.select_prior(plan, prompt)
        b = S.select_prior(plan, prompt)
        assert a.signature == b.signature and a.slices == b.slices
        assert a.resident_bytes <= plan.swappable_budget_bytes
        assert a.slice_count > 0
    half = plan.core_bytes() + (plan.swappable_budget_bytes - plan.core_bytes()) // 2
    sel = S.select_prior(plan, PY, budget_bytes=half)
    assert sel.resident_bytes <= half and sel.payload("r")["budget_bytes"] == half


def test_unknown_strategy():
    with pytest.raises(S.SelectionError, match="unknown strategy"):
        strategies.get_strategy("oracle")


# ----------------------------------------------------------------------------- `reap-swap select` (offline)


def _write_plan(tmp_path, budget_experts=8):
    import orjson

    path = tmp_path / "plan.json"
    path.write_bytes(orjson.dumps(plan_doc(budget_experts=budget_experts)))
    return path


def test_cli_select_prior_prints_payload(tmp_path, capsys):
    import orjson

    from reap_swap.cli.main import main

    plan_path = _write_plan(tmp_path)
    assert (
        main(["select", "--plan", str(plan_path), "--prompt", PY, "--payload-only", "--request-id", "q1"])
        == 0
    )
    payload = orjson.loads(capsys.readouterr().out)
    assert payload == {
        "request_id": "q1",
        "phase": "prefill",
        "active_set": {"layer_0": ["a"], "layer_5": ["a"]},
    }
    assert main(["select", "--plan", str(plan_path), "--prompt", PY, "--strategy", "static"]) == 0
    out = capsys.readouterr().out
    assert "strategy static: 0 slice(s)" in out and '"active_set": {}' in out


def test_cli_select_probe_from_saved_misses_and_errors(tmp_path, capsys):
    import orjson

    from reap_swap.cli.main import main

    plan_path = _write_plan(tmp_path, budget_experts=5)  # one expert beyond the core
    misses = tmp_path / "misses.json"
    misses.write_bytes(
        orjson.dumps(
            {
                "layers": {
                    "5": {
                        "observed_mass": 4.0,
                        "observed_selections": 8,
                        "inactive_mass": 1.0,
                        "inactive_experts": [8],
                    }
                }
            }
        )
    )
    messages = tmp_path / "messages.json"
    messages.write_bytes(orjson.dumps({"messages": [{"role": "user", "content": "hello"}]}))
    assert (
        main(
            [
                "select",
                "--plan",
                str(plan_path),
                "--messages",
                str(messages),
                "--strategy",
                "probe",
                "--misses",
                str(misses),
                "--json",
            ]
        )
        == 0
    )
    doc = orjson.loads(capsys.readouterr().out)
    assert doc["selection"]["slices"] == {"layer_5": ["d"]} and doc["payload"]["active_set"] == {
        "layer_5": ["d"]
    }
    assert main(["select", "--plan", str(plan_path), "--prompt", "x", "--strategy", "probe"]) == 2
    assert "needs --misses FILE or --server URL" in capsys.readouterr().err
    assert main(["select", "--plan", str(plan_path), "--prompt", "x", "--budget-bytes", "10"]) == 1
    assert "does not hold the plan's core" in capsys.readouterr().err


def test_selections_fit_each_layers_pin_capacity():
    """With the server's per-layer pin capacity (/reap/status cache.pin_capacity: the seeded device
    cache's slots) a selection never asks a layer for more than it can pin, and spends the budget
    that frees on the other layers; refresh keeps the capacity it was made for."""
    plan = load_plan(plan_doc(budget_experts=4 + 4))  # room for 4 experts beyond the cores
    free = S.select_prior(plan, PY)
    assert free.slices == {0: ("a",), 5: ("a",)} and free.capacity is None
    capped = S.select_prior(plan, PY, capacity={0: 2, 5: 6})  # layer 0 holds its core only
    assert 0 not in capped.slices and len(capped.resident[0]) == 2
    assert len(capped.resident[5]) <= 6 and len(capped.resident[5]) > len(free.resident[5])
    assert capped.capacity == {0: 2, 5: 6}
    assert strategies.select(plan, "prior", PY, capacity={0: 2, 5: 6}).slices == capped.slices
    misses = {0: {4: 5.0, 5: 5.0, 6: 5.0}, 5: {2: 1.0}}
    probe = S.select_probe(plan, misses, PY, capacity={0: 4, 5: 4})
    assert all(len(v) <= 4 for v in probe.resident.values())


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_plans_respect_capacity(data):
    plan = data.draw(plans())
    cap = {l: data.draw(st.integers(len(p.core), len(p.candidates) + 1)) for l, p in plan.layers.items()}
    sel = S.select_prior(plan, data.draw(st.sampled_from(["", PY, PROSE])), capacity=cap)
    assert all(len(sel.resident[l]) <= cap[l] for l in plan.layers)
    check_budget(plan, sel.resident, sel.budget_bytes)
