"""`reap-swap accept`'s judgement without a server: bitwise comparison, the verdict, its texts,
the command line, and the inputs refused before any server starts."""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import time

import httpx
import pytest

from reap_swap.bench.accept import AcceptConfig, AcceptError, check_inputs, server_commands
from reap_swap.bench.accept_load import Stream, stamped_lines, swap_choices, token_prompts
from reap_swap.bench.accept_verdict import (
    compare_phase,
    compare_prompt,
    failed_requests,
    judge,
    same_double,
    summary_markdown,
    verdict_table,
)
from reap_swap.cli import accept as cli_accept
from reap_swap.cli.main import main


def completion(tokens: list[int], logprobs: list[float]) -> dict:
    return {
        "tokens": [f"token_id:{t}" for t in tokens],
        "logprobs": logprobs,
        "decode_tok_s": 100.0,
        "tok_s": 50.0,
    }


REF = [completion([5, 6, 7], [-0.5, -1.25, -0.125]), completion([9, 9], [-2.0, -0.0625])]


def report(**reap_overrides) -> dict:
    reap = {
        "quiet": copy.deepcopy(REF),
        "during": copy.deepcopy(REF),
        "after": copy.deepcopy(REF),
        "after_storm": copy.deepcopy(REF),
        "swaps": {"posted": 12, "codes": {"200": 10, "409": 2}},
        "storm": {"requests": 9, "concurrency": 3, "codes": {"200": 6, "400": 1, "422": 2}},
        "cache": {"engaged": False, "totals": {"hits": 3}},
    }
    reap.update(reap_overrides)
    return {
        "model": "m",
        "plan": "p.json",
        "config": {"prompts": 2, "tokens": 3},
        "arms": {"stock": {"quiet": copy.deepcopy(REF)}, "reap": reap},
    }


def test_same_double_is_bitwise():
    assert same_double(-0.5, -0.5)
    assert not same_double(0.0, -0.0)  # == says equal; the bits differ
    assert same_double(math.nan, math.nan)
    assert not same_double(-1.0, -1.0000000000000002)  # one ulp
    assert same_double(None, None) and not same_double(None, 0.0)


def test_equal_phases_pass():
    v = judge(report())
    assert v["pass"] and v["failures"] == []
    assert all(c["equal"] for c in v["phases"]["reap"].values())
    assert v["phases"]["reap"]["during"]["logprobs_equal"] == 2


def test_one_logprob_one_ulp_off_fails():
    during = copy.deepcopy(REF)
    during[1]["logprobs"][1] = math.nextafter(-0.0625, 0.0)
    v = judge(report(during=during))
    assert not v["pass"]
    c = v["phases"]["reap"]["during"]
    assert not c["equal"] and c["tokens_equal"] == 2 and c["logprobs_equal"] == 1
    assert c["per_prompt"][1]["first_logprob_difference"] == 1
    assert v["failures"] == [
        "reap during swaps: prompt 1's logprobs differ from position 1 (same tokens; at most 6.94e-18 apart)"
    ]
    assert v["phases"]["reap"]["quiet"]["equal"]


def test_a_different_token_and_a_short_completion_fail():
    c = compare_prompt(REF[0], completion([5, 8, 7], [-0.5, -1.25, -0.125]))
    assert not c["equal"] and c["first_token_difference"] == 1 and c["logprobs_equal"]
    short = compare_prompt(REF[0], completion([5, 6], [-0.5, -1.25]))
    assert short["first_token_difference"] == 2 and short["first_logprob_difference"] == 2
    missing = compare_phase(REF, REF[:1])
    assert not missing["equal"] and missing["per_prompt"][1]["missing"]


def test_5xx_and_no_answer_fail_but_4xx_do_not():
    assert failed_requests({"200": 5, "400": 3, "422": 1}) == 0
    assert failed_requests({"200": 5, "503": 2, "no_answer": 1}) == 3
    v = judge(report(storm={"requests": 9, "concurrency": 3, "codes": {"200": 8, "500": 1}}))
    assert not v["pass"] and v["failures"] == ["reap storm: 1 request(s) answered 5xx or not at all"]


def test_missing_phase_arm_error_and_missing_reference_fail():
    r = report()
    del r["arms"]["reap"]["after_storm"]
    r["arms"]["reap"]["error"] = "ServerError: died"
    v = judge(r)
    assert not v["pass"]
    assert "reap: ServerError: died" in v["failures"]
    assert "reap after the storm: not run" in v["failures"]
    no_ref = {"arms": {"stock": {"error": "ServerError: refused"}}}
    v = judge(no_ref)
    assert not v["pass"] and "no reap arm ran" in v["failures"]


def test_table_and_markdown_name_the_verdict():
    r = report()
    v = judge(r)
    table = verdict_table(r, v)
    assert "reap   during swaps" in table and "2/2" in table
    assert table.splitlines()[-1].startswith("PASS")
    assert "reap storm: 200: 6, 400: 1, 422: 2" in table
    during = copy.deepcopy(REF)
    during[0]["tokens"][2] = "token_id:1"
    bad = report(during=during)
    md = summary_markdown(bad, judge(bad))
    assert "**FAIL: reap during swaps: prompt 0's tokens differ from position 2**" in md
    assert "| reap | during swaps | 1/2 | 2/2 | 100.0 | 50.0 | DIFFERS |" in md
    json.dumps(judge(bad))  # the verdict goes into accept.json as it is


def sse(chunks: list[tuple[list[str], list[float]]], delay: float, flushed: bool):
    """An SSE body: every chunk ``delay`` seconds after the previous one, or (``flushed``) all of
    them in one block after ``delay`` (a stream held back, then flushed)."""
    events = [
        b"data: "
        + json.dumps({"choices": [{"text": "x", "logprobs": {"tokens": t, "token_logprobs": lp}}]}).encode()
        + b"\n\n"
        for t, lp in chunks
    ]
    events.append(b'data: {"choices": [{"text": "", "logprobs": null, "finish_reason": "length"}]}\n\n')
    if flushed:
        time.sleep(delay)
        yield b"".join(events)
    else:
        for event in events:
            yield event
            time.sleep(delay)
    yield b"data: [DONE]\n\n"


ONE_PER_CHUNK = [(["token_id:1"], [-0.5]), (["token_id:2"], [-0.25]), (["token_id:3"], [-1.0])]
MERGED = [(["token_id:1"], [-0.5]), (["token_id:2", "token_id:3", "token_id:4", "token_id:5"], [-0.25] * 4)]


@pytest.mark.parametrize(
    "chunks, flushed, timed",
    [
        (ONE_PER_CHUNK, False, True),  # streamed token by token
        (MERGED, False, False),  # the server fell behind: 4 tokens in one chunk
        (ONE_PER_CHUNK, True, False),  # held back, then flushed at once
    ],
)
def test_stream_concatenates_logprobs_and_times_only_a_real_stream(chunks, flushed, timed):
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content))
        return httpx.Response(
            200, content=sse(chunks, 0.02, flushed), headers={"content-type": "text/event-stream"}
        )

    with httpx.Client(base_url="http://test", transport=httpx.MockTransport(handler)) as client:
        out = Stream(client, "m", 3)([7, 8, 9])
    assert seen["prompt"] == [7, 8, 9] and seen["return_tokens_as_token_ids"] and seen["ignore_eos"]
    assert out["tokens"] == [t for c in chunks for t in c[0]]
    assert out["logprobs"] == [x for c in chunks for x in c[1]]
    assert out["chunks"] == len(chunks) and out["tok_s"] > 0
    assert (out["decode_tok_s"] is not None) is timed
    assert out["held_back"] is flushed


def test_prompts_are_deterministic_and_inside_the_vocabulary():
    a, b = token_prompts(512, 3), token_prompts(512, 3)
    assert a == b and [len(p) for p in a] == [24, 32, 40]
    assert all(100 <= t < 512 - 100 for p in a for t in p)


def test_swap_choices_slices_then_experts():
    doc = {
        "perLayer": {
            "layer_0": {"coreExperts": [0, 1], "sliceCatalog": [{"sliceId": "s0", "experts": [2, 3]}]},
            "layer_1": {"coreExperts": [0, 1], "sliceCatalog": []},
        }
    }
    picks, everything = swap_choices(doc, None)
    assert picks == {"layer_0": ["s0"], "layer_1": [0, 1]} == everything

    class Shape:
        num_experts, moe_layers = 4, (1, 2)

    picks, _ = swap_choices(None, Shape())
    assert picks == {"layer_1": [0, 1, 2, 3], "layer_2": [0, 1, 2, 3]}


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser()
    cli_accept.add_arguments(parser)
    args = parser.parse_args(argv)
    return args, cli_accept.split_remainder(args)


@pytest.mark.parametrize(
    "argv",
    [
        ["M", "--plan", "p.json", "--tokens", "16", "--", "--dtype", "float32"],
        ["--plan", "p.json", "--tokens", "16", "M", "--", "--dtype", "float32"],
        ["--plan", "p.json", "M", "--tokens", "16", "--", "--dtype", "float32"],
    ],
)
def test_options_before_or_after_the_model(argv):
    args, engine = parse(argv)
    assert (args.model, str(args.plan), args.tokens, engine) == ("M", "p.json", 16, ["--dtype", "float32"])


def test_commands_add_prefix_caching_off_and_the_plan(tmp_path):
    plan = tmp_path / "p.json"
    cfg = AcceptConfig(model="M", out=tmp_path, plan=plan, engine_args=["--enforce-eager"])
    cmds = server_commands(cfg)
    assert cmds["stock"][3:] == [
        "--model",
        "M",
        "--enforce-eager",
        "--host",
        "127.0.0.1",
        "--no-enable-prefix-caching",
    ]
    assert cmds["reap"][1:4] == ["-m", "reap_swap.server", "M"]
    assert cmds["reap"][-2:] == ["--reap-plan", str(plan.resolve())]
    cfg.plan = None
    assert "--reap-plan" not in server_commands(cfg)["reap"]


@pytest.fixture
def tiny_config(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 512,
        "hidden_size": 128,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_experts": 8,
        "num_experts_per_tok": 2,
    }
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"engine_args": ["--port", "9"]}, "--port: set by accept itself"),
        ({"engine_args": ["--enable-prefix-caching"]}, "--enable-prefix-caching: set by accept itself"),
        ({"engine_args": ["--reap-cache", "off"]}, "pass reap-swap flags in --reap-args"),
        ({"tokens": 0}, "--tokens must be at least 1"),
        ({"plan": "missing.json"}, "missing.json"),
    ],
)
def test_refused_inputs(tiny_config, tmp_path, extra, message):
    if "plan" in extra:
        extra = {"plan": tmp_path / extra["plan"]}
    cfg = AcceptConfig(model=str(tiny_config), out=tmp_path / "out", **extra)
    with pytest.raises(AcceptError, match=re.escape(message)):
        check_inputs(cfg)
    assert not (tmp_path / "out").exists()


def test_cli_refusal_exits_2_before_starting_anything(tmp_path, capsys):
    rc = main(["accept", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out"), "--no-progress"])
    assert rc == 2
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_no_plan_swaps_name_the_models_experts(tiny_config, tmp_path):
    inputs = check_inputs(AcceptConfig(model=str(tiny_config), out=tmp_path))
    assert inputs.plan_doc is None and inputs.picks == {f"layer_{i}": list(range(8)) for i in (0, 1)}
    assert len(inputs.prompts) == 4


def test_lines_carry_the_time_of_the_read_that_completed_them():
    def reads():
        yield b"data: a\r\ndata: "
        time.sleep(0.01)
        yield b"b\n\ndata: c\n"
        yield b"tail"

    got = list(stamped_lines(reads()))
    assert [line for _, line in got] == ["data: a", "data: b", "", "data: c", "tail"]
    (a, _), (b, _), (empty, _), (c, _), _ = got
    assert b - a >= 0.01  # a line split over two reads is stamped by the second
    assert b == empty == c  # lines of one read share its stamp: no parse time between them
