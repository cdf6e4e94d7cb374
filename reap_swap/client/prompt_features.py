"""What ``prior`` knows about a prompt: a keyword classifier's task family, its confidence, the length.

Pure (no torch, no vLLM, no HTTP). A short or ambiguous prompt leans on the plan's ``global``
prior; a long, dense one on its family's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reap_swap.plan.document import Plan

GLOBAL = "global"


def _detector(*rules: tuple[str, int, float]) -> tuple[tuple[re.Pattern[str], float], ...]:
    """(pattern, re flags, weight) rules -> (compiled pattern, weight)."""
    return tuple((re.compile(p, f), w) for p, f, w in rules)


# Keyword detectors: (pattern, weight). Scores are weighted hits per whitespace token, so a long
# document with a few incidental matches does not outvote a short, dense one. Weights were set on
# data/corpus/calibration.jsonl (never on the held-out split the measurements use).
_M = re.MULTILINE
_DETECTORS: dict[str, tuple[tuple[re.Pattern[str], float], ...]] = {
    "python": _detector(
        (r"^\s*def \w+\(", _M, 3.0),
        (r"^\s*class \w+[(:]", _M, 3.0),
        (r"^\s*(?:from [\w.]+ )?import \w+", _M, 2.0),
        (r"\bself\.", 0, 1.0),
        (r"\b__\w+__\b", 0, 1.0),
        (r"^\s*(?:elif|except|try:|with |raise |return\b|yield\b)", _M, 1.0),
        (r"\b(?:None|True|False|lambda|isinstance|kwargs)\b", 0, 1.0),
        (r":\s*$", _M, 0.5),
        (r'"""|\'\'\'', 0, 1.0),
        (r"\bpython\b|\.py\b", re.IGNORECASE, 1.0),
        (r"'\\[xu][0-9a-fA-F]{2,4}'", 0, 1.0),
        (r"^\s*#(?!\s*(?:include|define|if|endif|undef|pragma)\b|!)", _M, 0.3),
    ),
    "c": _detector(
        (r"^\s*#\s*(?:include|define|ifn?def|endif|if|undef|pragma)\b", _M, 2.0),
        (r"\b(?:struct|typedef|unsigned|const|static|extern|enum|union|sizeof|void)\b", 0, 1.0),
        (r"\b(?:int|char|long|size_t|uint\d+_t|int\d+_t)\b\s*\**\s*\w+", 0, 1.0),
        (r"\bNULL\b|/\*|\*/", 0, 1.0),
        (r"->", 0, 0.3),
        (r";\s*$", _M, 0.5),
        (r"\b\w+\.h\b", 0, 1.0),
        (r"^\s\*(?:\s|$)", _M, 0.5),
    ),
    "shell": _detector(
        (r"^#!\s*/(?:usr/)?bin/(?:env\s+)?(?:ba|da|k|z)?sh\b", _M, 5.0),
        (r"\$\{?\w+|\$\(|\$@|\$#|\$\?", 0, 1.0),
        (r"\b(?:fi|esac|done|then|elif|echo|export|local|shift|exit|case|in)\b", 0, 0.6),
        (r"\[\[? -[a-z] |2>&1|>\s*/dev/null|\|\s*(?:grep|sed|awk|sort|cut|tr|xargs)\b", 0, 2.0),
        (r"\b(?:bash|shell|sudo|apt(?:-get)?|chmod|mkdir|systemctl)\b", 0, 1.0),
    ),
    "prose": _detector(
        (
            r"\b(?:the|and|of|to|is|are|was|for|that|with|this|which|be|it|or|by|an|as|on|can|not|you|your)\b",
            0,
            0.35,
        ),
        (r"^(?:NAME|SYNOPSIS|DESCRIPTION|OPTIONS|SEE ALSO|EXAMPLES?|AUTHORS?|BUGS)\s*$", _M, 3.0),
        (r"[a-z]{3,}[.!?]\s+[A-Z]", 0, 1.0),
    ),
    "math": _detector(
        (
            r"\b(?:solve|equation|integral|derivative|prove|theorem|lemma|matrix|probability|sum of)\b",
            re.IGNORECASE,
            2.0,
        ),
        (r"\d\s*[-+*/^=]\s*\d", 0, 1.0),
        (r"\\(?:frac|sum|int|sqrt)\b", 0, 2.0),
    ),
    "writing": _detector(
        (
            r"\b(?:write|rewrite|essay|story|poem|email|letter|draft|summari[sz]e|paragraph|tone)\b",
            re.IGNORECASE,
            2.0,
        ),
    ),
    "research": _detector(
        (
            r"\b(?:paper|study|survey|literature|citation|hypothesis|experiment|findings|arxiv)\b",
            re.IGNORECASE,
            2.0,
        ),
    ),
    "ops": _detector(
        (
            r"\b(?:docker|kubectl|kubernetes|deploy|nginx|systemd|systemctl|terraform|ansible|cron|logs?)\b",
            re.IGNORECASE,
            2.0,
        ),
    ),
    "code": _detector(
        (r"```|\b(?:function|compile|bug|stack trace|refactor|variable|api)\b", re.IGNORECASE, 2.0),
    ),
}
# plan family name -> detectors whose best score it takes; a name not listed is matched literally
_ALIASES: dict[str, tuple[str, ...]] = {
    "python": ("python",),
    "py": ("python",),
    "c": ("c",),
    "cpp": ("c",),
    "c++": ("c",),
    "shell": ("shell",),
    "bash": ("shell",),
    "sh": ("shell",),
    "ops": ("ops", "shell"),
    "prose": ("prose",),
    "docs": ("prose",),
    "writing": ("writing", "prose"),
    "math": ("math",),
    "research": ("research",),
    "code": ("code", "python", "c", "shell"),
    "general": (),
}
_LENGTH_HALF = 8  # tokens at which length alone halves the trust in the classified family
_TOKEN = re.compile(r"\S+")


@dataclass(frozen=True)
class PromptFeatures:
    """What ``prior`` knows about a prompt: family scores, the chosen family, its weight, length."""

    length_tokens: int  # whitespace-separated tokens
    scores: Mapping[str, float]  # plan family -> weighted keyword hits per token
    family: str | None  # best-scoring plan family (None: no evidence, or the plan has no families)
    weights: Mapping[str, float]  # prior name -> weight in the slice value; sums to 1

    def to_dict(self) -> dict:
        return {
            "length_tokens": self.length_tokens,
            "family": self.family,
            "scores": {k: round(v, 6) for k, v in self.scores.items()},
            "weights": {k: round(v, 6) for k, v in self.weights.items()},
        }


def prompt_text(prompt: str | Sequence[Mapping[str, Any]]) -> str:
    """A prompt string, or OpenAI chat messages (content as a string or a list of text parts)."""
    if isinstance(prompt, str):
        return prompt
    parts: list[str] = []
    for message in prompt:
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, Sequence):
            parts.extend(
                p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text"
            )
    return "\n".join(parts)


def plan_families(plan: Plan) -> tuple[str, ...]:
    """Every task family / prompt cluster the plan has priors for (without ``global``), sorted."""
    names: set[str] = set()
    for layer in plan.layers.values():
        for s in layer.slices:
            names.update(s.task_priors)
    artifacts = plan.document.get("scorerArtifacts") or {}
    for key in ("taskFamilySlicePriors", "promptClusterPriors"):
        ranked = artifacts.get(key)
        if isinstance(ranked, Mapping):
            names.update(str(k) for k in ranked)
    names.discard(GLOBAL)
    return tuple(sorted(names))


def _detector_score(name: str, text: str, tokens: int) -> float:
    hits = sum(w * len(p.findall(text)) for p, w in _DETECTORS[name])
    return hits / tokens


def classify(text: str, families: Iterable[str]) -> dict[str, float]:
    """Family -> score (weighted keyword hits per token) for the given family names."""
    tokens = max(1, len(_TOKEN.findall(text)))
    cache: dict[str, float] = {}
    out = {}
    for family in families:
        detectors = _ALIASES.get(family.lower())
        if detectors is None:  # a family we have no detector for: its name, literally
            literal = re.compile(r"\b" + re.escape(family.replace("_", " ")) + r"\b", re.IGNORECASE)
            out[family] = len(literal.findall(text)) / tokens
            continue
        for d in detectors:
            if d not in cache:
                cache[d] = _detector_score(d, text, tokens)
        out[family] = max((cache[d] for d in detectors), default=0.0)
    return out


def prompt_features(plan: Plan, prompt: str | Sequence[Mapping[str, Any]]) -> PromptFeatures:
    """Classify the prompt into one of the plan's families; weigh it against the global prior.

    The family's weight is its margin over the runner-up (an ambiguous prompt earns little) times
    ``n / (n + 8)`` for an n-token prompt (a few tokens are weak evidence); the rest goes to
    ``global``.
    """
    text = prompt_text(prompt)
    n = len(_TOKEN.findall(text))
    scores = classify(text, plan_families(plan))
    ranked = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))
    if not ranked or ranked[0][1] <= 0.0:
        return PromptFeatures(n, scores, None, {GLOBAL: 1.0})
    family, top = ranked[0]
    second = ranked[1][1] if len(ranked) > 1 else 0.0
    confidence = (top - second) / top * n / (n + _LENGTH_HALF)
    weights = {family: confidence, GLOBAL: 1.0 - confidence} if confidence < 1.0 else {family: 1.0}
    return PromptFeatures(n, scores, family, weights)
