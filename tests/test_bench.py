"""Unit tests of `reap-swap bench`'s pure parts: statistics, ratios, derived hit rates, stream timing,
arm commands, the markdown table and the plot, from synthetic numbers (no server)."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest
from script_modules import load_script

from reap_swap.bench import arms as bench_arms
from reap_swap.bench import config as bench_config
from reap_swap.bench import env as bench_env
from reap_swap.bench import markdown as bench_markdown
from reap_swap.bench import merge as bench_merge
from reap_swap.bench import run as bench
from reap_swap.bench import server_driver as serving
from reap_swap.bench.markdown import markdown_report, markdown_table
from reap_swap.bench.plot import plot
from reap_swap.bench.report import (
    GIB,
    pooled_hit_rate,
    ratio,
    ratio_matrix,
    run_stats,
    summarize,
    summarize_runs,
    uva_offloaded_bytes,
)
from reap_swap.plan.document import load_plan
from reap_swap.sizing.model_shape import read_model_shape


def _tiny():
    return load_script("make_tiny_moe")


# ----------------------------------------------------------------------------- statistics


def test_summarize_median_min_max_ignores_none():
    assert summarize([3.0, None, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert summarize([4.0, 1.0, 3.0, 2.0])["median"] == 2.5  # even count: mean of the middle two
    assert summarize([]) is None
    assert summarize([None, None]) is None


def test_ratio_of_medians_and_missing_values():
    a, b = summarize([10.0, 30.0, 20.0]), summarize([5.0, 4.0, 6.0])
    assert ratio(a, b) == pytest.approx(4.0)
    assert ratio(a, None) is None
    assert ratio(None, b) is None
    assert ratio(a, {"median": 0.0}) is None


def test_ratio_matrix_pairwise_from_the_same_run():
    runs = [
        {"label": "x", "stats": {"m": summarize([100.0, 90.0, 110.0])}},
        {"label": "y", "stats": {"m": summarize([50.0])}},
        {"label": "z", "stats": {"m": None}},
    ]
    m = ratio_matrix(runs, "m")
    assert set(m) == {"x", "y"}  # z measured nothing
    assert m["x"]["y"] == pytest.approx(2.0)
    assert m["y"]["x"] == pytest.approx(0.5)
    assert "x" not in m["x"]


def test_pooled_hit_rate_weights_by_selections():
    reqs = [
        {"observed_selections": 100, "missed_selections": 50, "observed_mass": 10.0, "inactive_mass": 4.0},
        {"observed_selections": 300, "missed_selections": 30, "observed_mass": 30.0, "inactive_mass": 3.0},
        {"observed_selections": 0, "missed_selections": 0},
    ]  # no routed tokens: ignored
    hit = pooled_hit_rate(reqs)
    assert hit["hit_rate"] == pytest.approx(1 - 80 / 400)
    assert hit["mass_hit_rate"] == pytest.approx(1 - 7 / 40)
    assert hit["requests"] == 2
    assert hit["per_request"]["min"] == pytest.approx(0.5)
    assert hit["per_request"]["max"] == pytest.approx(0.9)
    assert pooled_hit_rate([]) is None


def test_uva_offload_is_parameter_granular_in_layer_order():
    layer = 300  # w13 = 200, w2 = 100 per layer
    layers = [layer] * 4
    assert uva_offloaded_bytes(layers, 0) == 0
    assert uva_offloaded_bytes(layers, 1) == 200  # one w13 overshoots the limit
    assert uva_offloaded_bytes(layers, 200) == 200
    assert uva_offloaded_bytes(layers, 201) == 300  # then w2 of the same layer
    assert uva_offloaded_bytes(layers, 600) == 600
    assert uva_offloaded_bytes(layers, 10_000) == 1200  # never more than there is


def test_run_stats_from_raw_samples():
    run = {
        "timing": {
            "single": [
                {"ttft_s": 0.02, "prefill_tok_s": 500.0, "decode_tok_s": 100.0, "open_s": 0.01},
                {"ttft_s": 0.04, "prefill_tok_s": 250.0, "decode_tok_s": 80.0, "open_s": 0.03},
                {"ttft_s": 0.03, "prefill_tok_s": 333.0, "decode_tok_s": 90.0, "open_s": 0.02},
            ],
            "batch": [{"decode_tok_s": 300.0, "ttft_median_s": 0.05}, {"decode_tok_s": 280.0}],
        },
        "swaps": [
            {"kind": "swap", "noop": False, "bytes_copied": 1000, "server_seconds": 0.010},
            {"kind": "warm", "noop": True, "bytes_copied": 0, "server_seconds": 0.001},
            {"kind": "refresh", "noop": False, "bytes_copied": 500, "server_seconds": 0.020},
            {"kind": "swap", "noop": True, "bytes_copied": 0, "server_seconds": 0.002},
        ],
    }
    st = run_stats(run)
    assert st["ttft_s"] == {"median": 0.03, "min": 0.02, "max": 0.04, "n": 3}
    assert st["decode_tok_s_1"]["median"] == 90.0
    assert st["decode_tok_s_batch"] == {"median": 290.0, "min": 280.0, "max": 300.0, "n": 2}
    assert st["swap_count"] == 2  # the warm and the no-op swap moved nothing
    assert st["open_count"] == 4
    assert st["bytes_copied_total"] == 1500
    assert st["swap_latency_s"] == {"median": 0.015, "min": 0.010, "max": 0.020, "n": 2}
    assert st["open_latency_s"]["n"] == 4
    assert run_stats({})["bytes_copied_total"] is None  # a stock arm: no swap responses at all


# ----------------------------------------------------------------------------- stream timing


def test_stream_result_uses_running_usage_when_chunks_merge_tokens():
    r = serving.StreamResult(
        t_sent=10.0,
        t_first=10.5,
        t_last=12.5,
        chunks=5,
        usage={"prompt_tokens": 100, "completion_tokens": 41},
        tokens_at_first=1,
        tokens_at_last=41,
    )
    assert r.ttft_s == pytest.approx(0.5)
    assert r.prefill_tok_s == pytest.approx(200.0)
    assert r.decode_tok_s == pytest.approx(40 / 2.0)  # 40 tokens after the first, not 4 chunks
    plain = serving.StreamResult(t_sent=0.0, t_first=1.0, t_last=2.0, chunks=11)
    assert plain.decode_tok_s == pytest.approx(10.0)  # no usage: one token per chunk
    assert serving.StreamResult(t_sent=0.0).decode_tok_s is None


def test_batch_decode_rate_spans_all_streams():
    a = serving.StreamResult(t_sent=0.0, t_first=1.0, t_last=3.0, chunks=21)
    b = serving.StreamResult(t_sent=0.0, t_first=1.5, t_last=4.0, chunks=31)
    assert serving.batch_decode_tok_s([a, b]) == pytest.approx((20 + 30) / 3.0)
    assert serving.batch_decode_tok_s([serving.StreamResult(t_sent=0.0)]) is None


def test_stream_request_parses_sse_chunks_and_usage():
    chunks = [
        {"choices": [{"index": 0, "delta": {"content": "He"}}], "usage": {"completion_tokens": 1}},
        {"choices": [{"index": 0, "delta": {"content": "llo"}}], "usage": {"completion_tokens": 3}},
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}},
    ]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content))
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
            return await serving.stream_request(c, "http://x", "/v1/chat/completions", {"model": "m"})

    res = asyncio.run(go())
    assert seen["stream"] is True
    assert res.chunks == 2  # the usage-only chunk is not a token chunk
    assert "".join(res.text) == "Hello"
    assert (res.tokens_at_first, res.tokens_at_last) == (1, 3)
    assert res.prompt_tokens == 7 and res.completion_tokens == 3


def test_stream_request_raises_on_http_error():
    def handler(request):
        return httpx.Response(400, json={"error": {"message": "bad"}})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
            await serving.stream_request(c, "http://x", "/v1/completions", {})

    with pytest.raises(httpx.HTTPStatusError, match="400"):
        asyncio.run(go())


def test_compare_greedy_per_prompt_and_first_divergence():
    ref = [{"tokens": ["a", "b", "c"]}, {"tokens": ["x", "y"]}, {"tokens": ["p", "q"]}]
    got = [{"tokens": ["a", "b", "c"]}, {"tokens": ["x", "z"]}, {"tokens": ["p"]}]
    cmp = serving.compare(ref, got)
    assert cmp["identical"] == 1 and cmp["of"] == 3
    assert cmp["per_prompt"] == [True, False, False]
    assert cmp["first_divergence"] == [None, 1, 1]  # a shorter output diverges where it stops


def test_bench_compare_falls_back_to_text():
    ref = [{"tokens": [], "text": "abc"}]
    cmp = bench_merge.compare_outputs(ref, [{"tokens": [], "text": "abd"}])
    assert cmp["identical"] == 0 and cmp["first_divergence"] == [2]
    assert cmp["compared_on"].startswith("text")


def test_chat_greedy_record():
    completion = {
        "choices": [
            {
                "message": {"content": "hi there"},
                "finish_reason": "length",
                "logprobs": {
                    "content": [{"token": "hi", "logprob": -0.1}, {"token": " there", "logprob": -0.2}]
                },
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }
    rec = serving.chat_greedy_record(completion)
    assert rec["tokens"] == ["hi", " there"] and rec["logprobs"] == [-0.1, -0.2]
    assert rec["text"] == "hi there" and rec["usage"]["completion_tokens"] == 2


# ----------------------------------------------------------------------------- arms and inputs


def test_log_numbers_take_the_last_value():
    text = (
        "INFO Model loading took 14.17 GiB memory and 30.1 seconds\n"
        "INFO Total CPU offloaded parameters: 6.59\n"
        "INFO Available KV cache memory: 30.5 GiB\n"
        "reap-swap: reserved HBM pool of 512 expert slots (4.50 GiB, unit 9.00 MiB) in 0.2s\n"
        "INFO Model loading took 14.20 GiB memory and 1.0 seconds\n"
    )
    assert bench_env.log_numbers(text) == {
        "model_loading_gib": 14.20,
        "uva_offloaded_gib": 6.59,
        "kv_cache_gib": 30.5,
        "reap_pool_gib": 4.50,
    }
    assert bench_env.log_numbers("nothing here") == {}


def test_flags_in_engine_args():
    args = ["--api-key", "k1", "--max-model-len=512", "--api-key=k2"]
    assert bench_config.flag_value(args, "--api-key") == "k2"
    assert bench_config.flag_value(args, "--max-model-len") == "512"
    assert bench_config.flag_value(args, "--host") is None
    assert bench_config.has_flag(args, "--max-model-len") and not bench_config.has_flag(args, "--max-model")


def test_load_prompts_chat_and_text_records(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(
        '{"text": "' + "x" * 50 + '", "tag": "t"}\n\n'
        '{"messages": [{"role": "user", "content": "hello"}]}\n{"prompt": "abc"}\n'
    )
    prompts = bench_config.load_prompts(f, limit=2, chars=10)
    assert [p["messages"] for p in prompts] == [
        [{"role": "user", "content": "x" * 10}],
        [{"role": "user", "content": "hello"}],
    ]
    assert prompts[0]["tag"] == "t" and prompts[1]["line"] == 3
    (tmp_path / "bad.jsonl").write_text('{"text": 1}\n')
    with pytest.raises(bench_config.BenchError, match="line 1"):
        bench_config.load_prompts(tmp_path / "bad.jsonl", None, 10)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(bench_config.BenchError, match="no prompts"):
        bench_config.load_prompts(tmp_path / "empty.jsonl", None, 10)


@pytest.fixture
def tiny(tmp_path):
    mod = _tiny()
    doc = mod.build_plan(mod.RECIPE, "tiny")
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(doc))
    r = mod.RECIPE
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": r["hidden_size"],
        "moe_intermediate_size": r["moe_intermediate_size"],
        "num_hidden_layers": r["num_hidden_layers"],
        "num_experts": r["num_experts"],
        "num_experts_per_tok": r["num_experts_per_tok"],
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "torch_dtype": r["dtype"],
    }
    shape = read_model_shape(config)
    return plan_path, load_plan(str(plan_path), shape), shape


def _cfg(tmp_path, plan_path, **kw):
    return bench_config.BenchConfig(
        model="/models/m",
        plan=plan_path,
        prompts=tmp_path / "p.jsonl",
        out=tmp_path / "out",
        engine_args=["--max-model-len", "512"],
        **kw,
    )


def test_plan_runs_on_cpu_skips_timing_arms_and_builds_commands(tmp_path, tiny):
    plan_path, plan, shape = tiny
    total = shape.expert_bytes * shape.num_experts * len(shape.moe_layers)
    runs = bench_arms.plan_runs(_cfg(tmp_path, plan_path), plan, shape, total, "cpu", timing_on=False)
    assert [r.label for r in runs] == ["resident", "stock-uva", "plan-static", "plan-swap"]
    by = {r.arm: r for r in runs}
    assert "no CUDA" in by["resident"].skip_reason and "no CUDA" in by["stock-uva"].skip_reason
    assert by["plan-static"].skip_reason is None and by["plan-swap"].skip_reason is None
    assert by["plan-swap"].budget_bytes == plan.swappable_budget_bytes
    assert by["plan-static"].budget_bytes is None
    reap = by["plan-swap"].argv
    assert reap[1:3] == ["-m", "reap_swap.server"] and reap[-4:] == [
        "--reap-plan",
        str(plan_path.resolve()),
        "--reap-cache",
        "off",
    ]
    assert "--no-enable-prefix-caching" in reap and "--max-model-len" in reap and "--moe-backend" not in reap
    uva = by["stock-uva"].argv
    gb = float(uva[uva.index("--cpu-offload-gb") + 1])
    assert gb * GIB == pytest.approx(total - plan.swappable_budget_bytes, abs=GIB * 1e-6)
    assert uva[uva.index("--cpu-offload-params") + 1 :][:2] == ["w13_weight", "w2_weight"]
    assert uva[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    # --timings on: stock vLLM runs on the CPU build too, UVA never does
    on = {
        r.arm: r
        for r in bench_arms.plan_runs(_cfg(tmp_path, plan_path), plan, shape, total, "cpu", timing_on=True)
    }
    assert on["resident"].skip_reason is None and on["stock-uva"].skip_reason is not None


def test_plan_runs_several_budgets_derive_plans(tmp_path, tiny):
    plan_path, plan, shape = tiny
    total = shape.expert_bytes * shape.num_experts * len(shape.moe_layers)
    core_gib = plan.core_bytes() / GIB
    cfg = _cfg(
        tmp_path,
        plan_path,
        budget_gib=[core_gib * 2, core_gib * 3],
        arms=["plan-static", "plan-swap", "stock-uva"],
    )
    runs = bench_arms.plan_runs(cfg, plan, shape, total, "cuda", timing_on=True)
    assert [r.arm for r in runs] == ["plan-static", "plan-swap", "plan-swap", "stock-uva", "stock-uva"]
    assert runs[0].label == "plan-static" and runs[1].label.startswith("plan-swap@")
    assert "--moe-backend" in runs[0].argv  # the same MoE kernels in every arm on CUDA
    for spec in runs[1:3]:
        derived = load_plan(str(spec.plan_path), shape)
        assert derived.swappable_budget_bytes == spec.budget_bytes
        assert derived.core_sets() == plan.core_sets()
        assert spec.argv[-3] == str(spec.plan_path) and spec.argv[-2:] == ["--reap-cache", "off"]
    assert all(r.skip_reason is None for r in runs)
    with pytest.raises(bench_config.BenchError, match="core"):
        bench_arms.plan_runs(
            _cfg(tmp_path, plan_path, budget_gib=[core_gib / 2]), plan, shape, total, "cpu", False
        )


def test_config_rejects_unknown_arms_and_bad_budgets(tmp_path):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="unknown arm"):
        bench_config.BenchConfig(
            model="m", plan=tmp_path, prompts=tmp_path, out=tmp_path, arms=["resident", "nope"]
        )
    with pytest.raises(ValidationError, match="> 0"):
        bench_config.BenchConfig(model="m", plan=tmp_path, prompts=tmp_path, out=tmp_path, budget_gib=[0.0])
    with pytest.raises(ValidationError):
        bench_config.BenchConfig(model="m", plan=tmp_path, prompts=tmp_path, out=tmp_path, strategy="oracle")


def test_derived_stock_hit_rates(tiny):
    _plan_path, plan, shape = tiny
    total = shape.expert_bytes * shape.num_experts * len(shape.moe_layers)
    layer = total // len(shape.moe_layers)
    spec = bench_arms.RunSpec(arm="stock-uva", label="u", budget_bytes=total - layer, budget_dependent=True)
    hit = bench._derived_hit_rate(spec, shape, total, {"uva_offloaded_gib": 0.0})
    assert hit["hit_rate"] == pytest.approx(1 - layer / total)  # exactly one layer (w13 + w2) offloaded
    assert hit["source"].startswith("derived") and "vLLM logged 0.0 GiB" in hit["source"]
    res = bench._derived_hit_rate(
        bench_arms.RunSpec(arm="resident", label="r", budget_bytes=None, budget_dependent=False),
        shape,
        total,
        {},
    )
    assert res["hit_rate"] == 1.0


# ----------------------------------------------------------------------------- rendering


def _synthetic_report(budgets: list[float], timed: bool = True) -> dict:
    runs = [
        {
            "arm": "resident",
            "label": "resident",
            "budget_bytes": None,
            "budget_dependent": False,
            "reap": False,
            "status": "ok",
            "hit_rate": {"hit_rate": 1.0, "source": "derived: all resident"},
            "greedy_vs_ref": {
                "identical": 2,
                "of": 2,
                "per_prompt": [True, True],
                "first_divergence": [None, None],
            },
            "timing": {
                "single": [
                    {"decode_tok_s": 400.0 + i, "ttft_s": 0.02, "prefill_tok_s": 900.0} for i in range(3)
                ],
                "batch": [{"decode_tok_s": 1500.0}],
            }
            if timed
            else {},
            "gpu_memory": {"peak_used_bytes": 40 * GIB, "model_loading_gib": 14.2},
        },
        {
            "arm": "stock-uva",
            "label": "stock-uva",
            "status": "skipped",
            "reason": "no CUDA",
            "budget_bytes": GIB,
            "budget_dependent": True,
        },
    ]
    for i, b in enumerate(budgets):
        label = f"plan-swap@{b:g}GiB" if len(budgets) > 1 else "plan-swap"
        runs.append(
            {
                "arm": "plan-swap",
                "label": label,
                "budget_bytes": int(b * GIB),
                "budget_dependent": True,
                "reap": True,
                "status": "ok",
                "hit_rate": {
                    "hit_rate": 0.8 + 0.05 * i,
                    "per_request": summarize([0.7, 0.9]),
                    "source": "server counters",
                },
                "greedy_vs_ref": {
                    "identical": 1,
                    "of": 2,
                    "per_prompt": [True, False],
                    "first_divergence": [None, 5],
                },
                "timing": {
                    "single": [{"decode_tok_s": 200.0 + 50 * i}, {"decode_tok_s": 220.0 + 50 * i}],
                    "batch": [{"decode_tok_s": 700.0 + 100 * i}],
                }
                if timed
                else {},
                "swaps": [
                    {"kind": "swap", "noop": False, "bytes_copied": 3 * 2**20, "server_seconds": 0.004}
                ],
                "gpu_memory": {"note": "n/a (no GPU)"},
            }
        )
    runs.append(
        {
            "arm": "plan-static",
            "label": "plan-static",
            "status": "failed",
            "reason": "ServerError: boom",
            "budget_bytes": None,
            "budget_dependent": False,
        }
    )
    report = {
        "command": "reap-swap bench --model m",
        "config": {"batch": 4, "prompt_count": 2},
        "environment": {"vllm_version": "0.32.0", "device": "CPU only"},
        "model": {"path": "/m/tiny", "shape": {}},
        "timing": {"note": "measured" if timed else "not measured: no CUDA device"},
        "prompts": [{"preview": "first"}, {"preview": "second"}],
        "runs": runs,
    }
    report["summary"] = summarize_runs(report["runs"], "resident")
    return report


def test_markdown_table_rows_cells_and_ratios():
    report = _synthetic_report([2.0])
    table = markdown_table(report)
    lines = table.splitlines()
    assert lines[0].startswith("| arm | budget GiB | TTFT ms") and "decode tok/s (batch 4)" in lines[0]
    assert len(lines) == 2 + 4
    resident = next(line for line in lines if line.startswith("| resident"))
    assert "401.0 [400.0–402.0]" in resident and "20.0" in resident and "1.000 (derived)" in resident
    assert "reference" in resident and "40.00 GiB (weights 14.20 GiB)" in resident
    swap = next(line for line in lines if line.startswith("| plan-swap"))
    assert "210.0 [200.0–220.0]" in swap and "0.800 [0.700–0.900]" in swap and "3.00 MiB in 1 swap(s)" in swap
    assert "| 4.00 |" in swap and "| 1/2 |" in swap and "n/a (no GPU)" in swap
    assert "| stock-uva | 1 | skipped |" in table and "| plan-static | — | failed |" in table
    full = markdown_report(report)
    assert "**stock-uva** skipped: no CUDA" in full and "**plan-static** failed: ServerError: boom" in full
    assert "| plan-swap | 0.52 | 1 |" in full  # 210 / 401 from the same run
    assert "| 1: second | = | ≠@5 |" in full
    ratios = report["summary"]["ratios"]["decode_tok_s_1"]
    assert ratios["plan-swap"]["resident"] == pytest.approx(210.0 / 401.0)


@pytest.mark.parametrize("budgets,timed", [([2.0], True), ([1.0, 2.0, 4.0], True), ([0.004, 0.006], False)])
def test_plot_writes_a_png(tmp_path, budgets, timed):
    report = _synthetic_report(budgets, timed)
    path = plot(report, tmp_path / "bench.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_write_outputs_json_keeps_raw_numbers(tmp_path):
    report = _synthetic_report([1.0, 2.0])
    bench_merge.write_outputs(report, tmp_path)
    back = json.loads((tmp_path / "bench.json").read_text())
    swap = next(r for r in back["runs"] if r["label"] == "plan-swap@1GiB")
    assert [s["decode_tok_s"] for s in swap["timing"]["single"]] == [200.0, 220.0]
    assert swap["stats"]["decode_tok_s_1"]["median"] == 210.0
    assert (tmp_path / "bench.md").read_text().startswith("# reap-swap bench")
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    assert not math.isnan(back["summary"]["ratios"]["decode_tok_s_1"]["plan-swap@2GiB"]["plan-swap@1GiB"])


def test_bench_command_is_registered_and_parses_engine_args():
    from reap_swap.cli.bench import engine_args
    from reap_swap.cli.main import COMMANDS, build_parser

    assert COMMANDS["bench"][0] == "reap_swap.cli.bench"
    args = build_parser("bench").parse_args(
        [
            "bench",
            "--model",
            "m",
            "--plan",
            "p",
            "--prompts",
            "f",
            "--budget-gib",
            "1",
            "2.5",
            "--",
            "--dtype",
            "float32",
        ]
    )
    assert args.budget_gib == [1.0, 2.5]
    assert engine_args(args.engine_args) == ["--dtype", "float32"]
    assert bench_markdown.fmt_bytes(3 * 2**20) == "3.00 MiB"


def test_cache_arms_run_the_cache_and_plain_clients(tmp_path):
    """plan-cache: --reap-cache lfu with the plain ('static') client; plan-swap+cache: the cache
    with per-request swaps; the older reap arms keep --reap-cache off."""
    from reap_swap.bench.measure import arm_strategy

    assert bench_config.CACHE_ARMS == {
        "plan-static": "off",
        "plan-swap": "off",
        "plan-cache": "lfu",
        "plan-swap+cache": "lfu",
    }
    assert set(bench_config.CACHE_ARMS) == set(bench_config.REAP_ARMS)
    assert {"plan-cache", "plan-swap+cache"} <= set(bench_config.BUDGET_ARMS)
    assert "plan-cache" not in bench_config.DEFAULT_ARMS
    cfg = type("Cfg", (), {"strategy": "probe"})()
    assert arm_strategy(cfg, "plan-cache") == "static" and arm_strategy(cfg, "plan-swap+cache") == "probe"


def test_measure_lock_lets_one_bench_measure_at_a_time(tmp_path):
    import threading
    import time

    from reap_swap.bench.env import MeasureLock

    assert MeasureLock(None).acquire() is None  # no --measure-lock: nothing to wait for
    first, second = MeasureLock(tmp_path / "lock"), MeasureLock(tmp_path / "lock")
    assert first.acquire() is not None
    got = []
    t = threading.Thread(target=lambda: got.append(second.acquire()))
    t.start()
    time.sleep(0.3)
    assert got == []  # flock excludes a second open file description, even in one process
    first.release()
    t.join(5)
    assert got and got[0] >= 0.2
    second.release()
    second.release()  # idempotent
    assert (
        bench_config.BenchConfig(
            model="m",
            plan=tmp_path / "p",
            prompts=tmp_path / "q",
            out=tmp_path,
            measure_lock=tmp_path / "lock",
        ).measure_lock
        == tmp_path / "lock"
    )
