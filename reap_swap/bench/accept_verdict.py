"""The judgement of ``reap-swap accept``: each phase's greedy tokens and logprobs against the stock
reference, bit for bit, and the status codes of the load; the verdict table and the summary.

Pure (no server, no HTTP): the unit tests judge hand-made records, and the report one run wrote
(accept.json) can be judged again with ``judge(report)``.

Equal means, for every prompt: the same number of tokens, the same token at every position (token
ids, asked as ``return_tokens_as_token_ids``), and every logprob the same IEEE double. ``==`` on
floats is not quite that (0.0 == -0.0; NaN != NaN), so the doubles' bytes are compared. A phase
passes only if every prompt is equal; the run passes only if every phase of every reap arm passes,
every arm ran to the end and no request of the swap thread or the storm got a 5xx or no answer.
"""

from __future__ import annotations

import statistics
import struct
from collections.abc import Mapping, Sequence
from itertools import zip_longest
from typing import Any

PHASES = ("quiet", "during", "after", "after_storm")
PHASE_TEXT = {
    "quiet": "quiet",
    "during": "during swaps",
    "after": "after swaps",
    "after_storm": "after the storm",
}
REFERENCE = "stock"
NO_ANSWER = "no_answer"  # a request that got no HTTP response at all (refused connection, timeout)


def same_double(a: float | None, b: float | None) -> bool:
    """The same IEEE double, bit for bit (None only equals None)."""
    if a is None or b is None:
        return a is None and b is None
    return struct.pack("<d", float(a)) == struct.pack("<d", float(b))


def _first_difference(a: Sequence, b: Sequence, same=lambda x, y: x == y) -> int | None:
    """Index of the first position where the sequences differ (a length difference counts)."""
    for i, (x, y) in enumerate(zip_longest(a, b, fillvalue=_MISSING)):
        if x is _MISSING or y is _MISSING or not same(x, y):
            return i
    return None


_MISSING = object()


def compare_prompt(ref: Mapping | None, got: Mapping | None) -> dict:
    """One prompt's completion against the reference's: where tokens and logprobs first differ."""
    if ref is None or got is None:
        return {"equal": False, "tokens_equal": False, "logprobs_equal": False, "missing": True}
    tok = _first_difference(ref["tokens"], got["tokens"])
    lp = _first_difference(ref["logprobs"], got["logprobs"], same_double)
    out: dict[str, Any] = {
        "equal": tok is None and lp is None,
        "tokens_equal": tok is None,
        "logprobs_equal": lp is None,
        "first_token_difference": tok,
        "first_logprob_difference": lp,
    }
    if lp is not None and tok is None:  # same tokens: how far apart the logprobs drifted
        out["max_abs_logprob_difference"] = max(
            abs(float(x) - float(y))
            for x, y in zip(ref["logprobs"], got["logprobs"])
            if x is not None and y is not None
        )
    return out


def compare_phase(ref: Sequence[Mapping], got: Sequence[Mapping]) -> dict:
    """Every prompt of a phase against the reference: counts and the per-prompt records."""
    per = [compare_prompt(a, b) for a, b in zip_longest(ref, got)]
    return {
        "equal": bool(per) and all(p["equal"] for p in per),
        "prompts": len(per),
        "tokens_equal": sum(p["tokens_equal"] for p in per),
        "logprobs_equal": sum(p["logprobs_equal"] for p in per),
        "per_prompt": per,
    }


def failed_requests(codes: Mapping[str, int] | None) -> int:
    """Requests answered 5xx or not answered at all, in a {status code: count} map."""
    return sum(
        n for code, n in (codes or {}).items() if code == NO_ANSWER or (code.isdigit() and int(code) >= 500)
    )


def median_rate(records: Sequence[Mapping], key: str = "decode_tok_s") -> float | None:
    """Median of a per-request rate (``decode_tok_s`` or ``tok_s``) over the requests that have one."""
    rates = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(rates) if rates else None


def _describe(arm: str, phase: str, c: Mapping) -> str:
    """The first differing prompt of a phase, in words."""
    for i, p in enumerate(c["per_prompt"]):
        if p.get("missing"):
            return f"{arm} {PHASE_TEXT[phase]}: prompt {i} has no completion on one side"
        if not p["tokens_equal"]:
            return f"{arm} {PHASE_TEXT[phase]}: prompt {i}'s tokens differ from position {p['first_token_difference']}"
        if not p["logprobs_equal"]:
            return (
                f"{arm} {PHASE_TEXT[phase]}: prompt {i}'s logprobs differ from position "
                f"{p['first_logprob_difference']} (same tokens; at most "
                f"{p.get('max_abs_logprob_difference', 0):.3g} apart)"
            )
    return f"{arm} {PHASE_TEXT[phase]}: not equal"


def _first_line(error: str) -> str:
    """An arm's error in the verdict: its first line (a server's names its log; the log tail that
    follows stays in accept.json)."""
    return error.strip().splitlines()[0] if error.strip() else "failed"


def judge(report: Mapping) -> dict:
    """The verdict of a report: per reap arm and phase the comparison, the load's failures, and
    ``pass`` with every reason it did not."""
    arms = report.get("arms") or {}
    failures: list[str] = []
    ref = (arms.get(REFERENCE) or {}).get("quiet")
    if arms.get(REFERENCE, {}).get("error"):
        failures.append(f"{REFERENCE}: {_first_line(arms[REFERENCE]['error'])}")
    if not ref:
        failures.append(f"{REFERENCE}: no reference completions")
    phases: dict[str, dict[str, dict]] = {}
    for name, arm in arms.items():
        if name == REFERENCE:
            continue
        if arm.get("error"):
            failures.append(f"{name}: {_first_line(arm['error'])}")
        phases[name] = {}
        for phase in PHASES:
            if phase not in arm:
                failures.append(f"{name} {PHASE_TEXT[phase]}: not run")
                continue
            if ref:
                c = phases[name][phase] = compare_phase(ref, arm[phase])
                if not c["equal"]:
                    failures.append(_describe(name, phase, c))
        for load in ("swaps", "storm"):
            bad = failed_requests((arm.get(load) or {}).get("codes"))
            if bad:
                failures.append(f"{name} {load}: {bad} request(s) answered 5xx or not at all")
    if not phases:
        failures.append("no reap arm ran")
    return {"pass": not failures, "failures": failures, "phases": phases}


def _codes_text(codes: Mapping[str, int] | None) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted((codes or {}).items())) or "none"


def verdict_rows(report: Mapping, verdict: Mapping) -> list[list[str]]:
    """[arm, phase, tokens equal, logprobs equal, decode tok/s, end-to-end tok/s, result] per phase
    (rates: medians over the phase's requests)."""
    arms = report.get("arms") or {}
    rows = []
    if REFERENCE in arms:
        ref = arms[REFERENCE].get("quiet") or []
        rows.append([REFERENCE, "quiet", "reference", "reference", *_rates(ref), ""])
    for name, compared in verdict["phases"].items():
        arm = arms.get(name) or {}
        for phase in PHASES:
            c = compared.get(phase)
            if c is None:
                rows.append([name, PHASE_TEXT[phase], "-", "-", "-", "-", "NOT RUN"])
                continue
            rows.append(
                [
                    name,
                    PHASE_TEXT[phase],
                    f"{c['tokens_equal']}/{c['prompts']}",
                    f"{c['logprobs_equal']}/{c['prompts']}",
                    *_rates(arm.get(phase) or []),
                    "equal" if c["equal"] else "DIFFERS",
                ]
            )
    return rows


def _rates(records: Sequence[Mapping]) -> list[str]:
    return ["n/a" if x is None else f"{x:.1f}" for x in (median_rate(records), median_rate(records, "tok_s"))]


HEADER = ["arm", "phase", "tokens equal", "logprobs equal", "decode tok/s", "end-to-end tok/s", "result"]


def verdict_table(report: Mapping, verdict: Mapping) -> str:
    """The table ``reap-swap accept`` prints, then the load's status codes and the verdict line."""
    rows = [HEADER, *verdict_rows(report, verdict)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    for name, arm in (report.get("arms") or {}).items():
        for load in ("swaps", "storm"):
            if arm.get(load):
                lines.append(f"{name} {load}: {_codes_text(arm[load].get('codes'))}")
    lines.append(verdict_line(verdict))
    return "\n".join(lines)


def verdict_line(verdict: Mapping) -> str:
    if verdict["pass"]:
        return "PASS: every phase equals stock vLLM bit for bit; no 5xx"
    return "FAIL: " + "; ".join(verdict["failures"])


def summary_markdown(report: Mapping, verdict: Mapping) -> str:
    """accept.md: the verdict, the table, the load, the cache counters, the commands."""
    rows = verdict_rows(report, verdict)
    out = [
        "# reap-swap accept",
        "",
        f"**{verdict_line(verdict)}**",
        "",
        f"Model `{report.get('model')}`, plan `{report.get('plan') or 'none'}`; "
        f"{report.get('config', {}).get('prompts')} prompts x {report.get('config', {}).get('tokens')} "
        f"greedy tokens; {(report.get('environment') or {}).get('device', '')}, "
        f"vLLM {(report.get('environment') or {}).get('vllm_version', '?')}.",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
    ]
    for name, arm in (report.get("arms") or {}).items():
        if arm.get("swaps"):
            s = arm["swaps"]
            out.append(
                f"- {name} swaps during the run: {s.get('posted')} posted ({_codes_text(s.get('codes'))})"
            )
        if arm.get("storm"):
            s = arm["storm"]
            out.append(
                f"- {name} storm: {s.get('requests')} requests, {s.get('concurrency')} at a time "
                f"({_codes_text(s.get('codes'))})"
            )
        cache = arm.get("cache")
        if cache:
            out.append(f"- {name} cache: {_cache_text(cache)}")
        if arm.get("command"):
            out.append(f"- {name} command: `{' '.join(arm['command'])}`")
    return "\n".join(out) + "\n"


def _cache_text(cache: Mapping) -> str:
    head = ", ".join(f"{k} {cache[k]}" for k in ("engaged", "mode", "policy") if cache.get(k) is not None)
    totals = cache.get("totals") or {}
    tail = ", ".join(f"{k} {v}" for k, v in totals.items())
    return "; ".join(x for x in (head, tail) if x) or "no counters"
