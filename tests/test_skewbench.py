"""The skew bench phase (issue 17), on the CPU: the cache arms' device flag and the vLLM-routed trace
(the harness's summary and driver: research/tests/test_skew_bench_harness.py). Nothing here starts a
server."""

import base64
import io
from types import SimpleNamespace

import numpy as np
import pytest

from reap_swap.bench import arms as bench_arms
from reap_swap.bench import config as bench_config
from reap_swap.cache.trace import TraceError, load_trace, save_trace
from reap_swap.cache.trace_served import trace_from_served

# ----------------------------------------------------------------- bench: --reap-cache-device on


def _reap_argv(tmp_path, arm, plat, cache_device="on"):
    return _reap_spec(tmp_path, arm, plat, cache_device).argv


def _reap_spec(tmp_path, arm, plat, cache_device="on", budget=100, core=10, layers=2, top_k=2):
    cfg = bench_config.BenchConfig(
        model="m", plan=tmp_path / "p.json", prompts=tmp_path / "q", out=tmp_path, cache_device=cache_device
    )
    plan = SimpleNamespace(  # per_expert_bytes 1: the core's bytes are its experts, spread evenly
        core_bytes=lambda: core,
        swappable_budget_bytes=budget,
        per_expert_bytes=1,
        layers={i: SimpleNamespace(core=frozenset(range(core // layers))) for i in range(layers)},
    )
    spec = bench_arms.RunSpec(arm=arm, label=arm, budget_bytes=None, budget_dependent=False)
    bench_arms._reap_arm(
        spec, ["py", "-m", "reap_swap.server", "m"], cfg, plan, SimpleNamespace(top_k=top_k), plat
    )
    return spec


@pytest.mark.parametrize("arm", ["plan-cache", "plan-swap+cache"])
def test_cache_arms_engage_the_device_cache_on_cuda(tmp_path, arm):
    argv = _reap_argv(tmp_path, arm, "cuda")
    at = argv.index("--reap-cache")
    assert argv[at : at + 4] == ["--reap-cache", "lfu", "--reap-cache-device", "on"]
    # the CPU build runs the cache in accounting mode: no device flag
    assert "--reap-cache-device" not in _reap_argv(tmp_path, arm, "cpu")
    off = _reap_argv(tmp_path, arm, "cuda", cache_device="off")  # spelled out: the server's default is on
    assert off[off.index("--reap-cache-device") + 1] == "off"


def test_plan_swap_cache_leaves_the_swaps_room_beside_the_tail(tmp_path):
    """plan-swap+cache: with the default --reap-cache-slots auto the tail takes every slot beyond
    the core and the device refuses every swap that adds an expert (research.md "acctail"), so the
    arm gives an explicit tail (min(2 x top_k, half of what lies beyond the core) per layer) and the
    client selects within the swap table K that leaves."""
    from reap_swap.sizing.cache_tail import swap_cache_split

    spec = _reap_spec(tmp_path, "plan-swap+cache", "cuda")  # pool 100, core 10, 2 layers: 45 beyond each
    assert spec.argv[-2:] == ["--reap-cache-slots", "swaps"] and spec.swap_budget_bytes == 92
    assert any(n.startswith("--reap-cache-slots swaps = 8: a tail of 4 per layer") for n in spec.notes)
    assert spec.client_budget_bytes == 92 and spec.budget_bytes is None and spec.skip_reason is None
    assert (
        _reap_spec(tmp_path, "plan-swap+cache", "cpu").swap_budget_bytes == 92
    )  # accounting: the same split
    plain = _reap_spec(tmp_path, "plan-cache", "cuda")  # the plain client never swaps: auto, the whole tail
    assert "--reap-cache-slots" not in plain.argv and plain.client_budget_bytes is None
    # a thin margin beyond the core: half of it for the tail; none left: the arm is skipped, saying why
    assert swap_cache_split(30, 10, 2, 8) == (5, 20, None)
    assert swap_cache_split(64 * 12, 368, 12, 8) == (16, 576, None)  # run 12's skewed model at 50 %
    thin = _reap_spec(tmp_path, "plan-swap+cache", "cuda", budget=12, core=10)
    assert "too few to split" in thin.skip_reason and thin.swap_budget_bytes is None
    assert swap_cache_split(12, 10, 2, 8)[2] is not None


@pytest.mark.parametrize("arm", ["plan-static", "plan-swap"])
def test_non_cache_arms_never_get_the_device_flag(tmp_path, arm):
    argv = _reap_argv(tmp_path, arm, "cuda")
    assert argv[-2:] == ["--reap-cache", "off"] and "--reap-cache-device" not in argv


def test_bench_cli_passes_cache_device():
    import argparse

    from reap_swap.cli.bench import add_arguments

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert ap.parse_args(["--model", "m"]).cache_device == "on"
    assert ap.parse_args(["--cache-device", "off"]).cache_device == "off"
    with pytest.raises(SystemExit):
        ap.parse_args(["--cache-device", "maybe"])


# ----------------------------------------------------------------- the vLLM-routed trace


def _b64(arr):
    buf = io.BytesIO()
    np.save(buf, arr)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _record(rng, prompt, completion, layers=3, top_k=2, experts=8, tag="python"):
    routed = np.stack(
        [
            np.stack([rng.permutation(experts)[:top_k] for _ in range(layers)])
            for _ in range(prompt + completion - 1)
        ]
    ).astype(np.uint8)
    rec = {
        "tag": tag,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "routed_experts": _b64(routed),
    }
    return rec, routed


def test_trace_from_served_builds_prefill_and_decode_steps(tmp_path):
    rng = np.random.default_rng(0)
    (r0, a0), (r1, a1) = _record(rng, 5, 4), _record(rng, 3, 1, tag="c")
    kw = dict(moe_layers=[0, 1, 2], model="m", num_experts=8, top_k=2, per_expert_bytes=7)
    t = trace_from_served([r0, r1], source={"recorder": "x"}, **kw)
    # request 0: one prefill of 5 tokens + 3 decode steps; request 1: a prefill of 3 tokens only
    assert t.num_requests == 2 and t.num_steps == 4 + 1
    assert list(np.diff(t.step_offsets)) == [5, 1, 1, 1, 3]
    assert np.array_equal(t.topk_ids, np.concatenate([a0, a1]))
    assert t.request_tags == ("python", "c")
    save_trace(tmp_path / "t.npz", t)
    back = load_trace(tmp_path / "t.npz")  # what `reap-swap simulate --trace` reads
    assert np.array_equal(back.topk_ids, t.topk_ids) and back.source == {"recorder": "x"}


def test_trace_from_served_refuses_by_name():
    rng = np.random.default_rng(1)
    kw = dict(moe_layers=[0, 1, 2], model="m", num_experts=8, top_k=2, per_expert_bytes=7)
    rec, _ = _record(rng, 5, 4)
    with pytest.raises(TraceError, match=r"request 0 \(python\).*usage says 5 prompt \+ 5"):
        trace_from_served([{**rec, "completion_tokens": 5}], **kw)
    with pytest.raises(TraceError, match="enable-return-routed-experts"):
        trace_from_served([{**rec, "routed_experts": None}], **kw)
    with pytest.raises(TraceError, match="expected \\[tokens, 4 MoE layers"):
        trace_from_served([rec], **{**kw, "moe_layers": [0, 1, 2, 3]})
