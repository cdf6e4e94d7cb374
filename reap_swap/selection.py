"""Which slices a request gets: the plan's core plus slices chosen per prompt, within the budget.

Pure (no torch, no vLLM, no HTTP): the client feeds it prompts and the server's miss counters.

Every strategy ends in the same greedy fill: each (layer, slice) has a value; slices are taken in
order of value per *marginal* byte (experts already resident cost nothing) while the keep-set
still fits the budget, across all layers at once, because one byte spent on a flat layer buys
less than one spent on a peaked one. A slice worth nothing is never taken. Ties are broken by
(layer, catalog position), so equal inputs give equal selections. The result is checked with the
server's own functions (active_set.normalize_active_set / resident_sets / check_budget), so "fits
here" means "the server accepts it".

Strategies:
- ``static``: the core only (no slices); the baseline every other choice is measured against.
- ``prior``: prompt features, a keyword classifier's task family and the prompt's length, weigh
  the plan's per-slice ``taskPriors`` (or, for plans that only rank slices per family, the
  ``scorerArtifacts`` lists ``taskFamilySlicePriors`` / ``promptClusterPriors``) against the
  ``global`` prior; a short or ambiguous prompt leans on the global prior.
- ``probe``: from the router misses of a prefill-only pass (``max_tokens=1``) run with only the
  core resident, slices ranked by the missed mass they would have covered per byte; budget left
  after every slice with a miss goes by the prior.
- decode refresh (:func:`refresh`): re-select from the running request's misses, at most
  ``max_refreshes_per_request`` times.

Router-miss payloads give each layer's ``inactive_experts`` and per-expert ``expert_counts``;
the values are shares of the layer's routed selections (see :func:`missed_mass`).
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from reap_swap.active_set import (
    ResidentSets,
    SwapRequest,
    check_budget,
    normalize_active_set,
    resident_bytes,
    resident_sets,
    signature,
)
from reap_swap.plan import Plan, Slice

STRATEGIES = ("static", "prior", "probe")
GLOBAL = "global"
MissedMass = dict[int, dict[int, float]]  # layer -> expert -> routed mass that missed (share of the layer)


class SelectionError(ValueError):
    """A selection that cannot be made (e.g. the budget does not even hold the core)."""


# ----------------------------------------------------------------------------- prompt features

# Keyword detectors: (pattern, weight). Scores are weighted hits per whitespace token, so a long
# document with a few incidental matches does not outvote a short, dense one. Weights were set on
# data/corpus/calibration.jsonl (never on the held-out split the measurements use).
_M = re.MULTILINE
_DETECTORS: dict[str, tuple[tuple[re.Pattern[str], float], ...]] = {
    "python": tuple(
        (re.compile(p, f), w)
        for p, f, w in (
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
        )
    ),
    "c": tuple(
        (re.compile(p, f), w)
        for p, f, w in (
            (r"^\s*#\s*(?:include|define|ifn?def|endif|if|undef|pragma)\b", _M, 2.0),
            (r"\b(?:struct|typedef|unsigned|const|static|extern|enum|union|sizeof|void)\b", 0, 1.0),
            (r"\b(?:int|char|long|size_t|uint\d+_t|int\d+_t)\b\s*\**\s*\w+", 0, 1.0),
            (r"\bNULL\b|/\*|\*/", 0, 1.0),
            (r"->", 0, 0.3),
            (r";\s*$", _M, 0.5),
            (r"\b\w+\.h\b", 0, 1.0),
            (r"^\s\*(?:\s|$)", _M, 0.5),
        )
    ),
    "shell": tuple(
        (re.compile(p, f), w)
        for p, f, w in (
            (r"^#!\s*/(?:usr/)?bin/(?:env\s+)?(?:ba|da|k|z)?sh\b", _M, 5.0),
            (r"\$\{?\w+|\$\(|\$@|\$#|\$\?", 0, 1.0),
            (r"\b(?:fi|esac|done|then|elif|echo|export|local|shift|exit|case|in)\b", 0, 0.6),
            (r"\[\[? -[a-z] |2>&1|>\s*/dev/null|\|\s*(?:grep|sed|awk|sort|cut|tr|xargs)\b", 0, 2.0),
            (r"\b(?:bash|shell|sudo|apt(?:-get)?|chmod|mkdir|systemctl)\b", 0, 1.0),
        )
    ),
    "prose": tuple(
        (re.compile(p, f), w)
        for p, f, w in (
            (
                r"\b(?:the|and|of|to|is|are|was|for|that|with|this|which|be|it|or|by|an|as|on|can|not|you|your)\b",
                0,
                0.35,
            ),
            (r"^(?:NAME|SYNOPSIS|DESCRIPTION|OPTIONS|SEE ALSO|EXAMPLES?|AUTHORS?|BUGS)\s*$", _M, 3.0),
            (r"[a-z]{3,}[.!?]\s+[A-Z]", 0, 1.0),
        )
    ),
    "math": tuple(
        (re.compile(p, f), w)
        for p, f, w in (
            (
                r"\b(?:solve|equation|integral|derivative|prove|theorem|lemma|matrix|probability|sum of)\b",
                re.IGNORECASE,
                2.0,
            ),
            (r"\d\s*[-+*/^=]\s*\d", 0, 1.0),
            (r"\\(?:frac|sum|int|sqrt)\b", 0, 2.0),
        )
    ),
    "writing": tuple(
        (re.compile(p, f), w)
        for p, f, w in (
            (
                r"\b(?:write|rewrite|essay|story|poem|email|letter|draft|summari[sz]e|paragraph|tone)\b",
                re.IGNORECASE,
                2.0,
            ),
        )
    ),
    "research": tuple(
        (re.compile(p, f), w)
        for p, f, w in (
            (
                r"\b(?:paper|study|survey|literature|citation|hypothesis|experiment|findings|arxiv)\b",
                re.IGNORECASE,
                2.0,
            ),
        )
    ),
    "ops": tuple(
        (re.compile(p, f), w)
        for p, f, w in (
            (
                r"\b(?:docker|kubectl|kubernetes|deploy|nginx|systemd|systemctl|terraform|ansible|cron|logs?)\b",
                re.IGNORECASE,
                2.0,
            ),
        )
    ),
    "code": tuple(
        (re.compile(p, f), w)
        for p, f, w in (
            (r"```|\b(?:function|compile|bug|stack trace|refactor|variable|api)\b", re.IGNORECASE, 2.0),
        )
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


# ----------------------------------------------------------------------------- slice priors


def _global_prior(layer_slices: Sequence[Slice]) -> list[float]:
    """Per slice: its ``global`` task prior, else its activation mass; all zero -> catalog rank."""
    values = [s.task_priors.get(GLOBAL, s.activation_mass) for s in layer_slices]
    if not any(v > 0 for v in values):
        n = len(layer_slices)
        values = [(n - i) / (n * (n + 1) / 2) for i in range(n)]  # shares summing to 1, catalog order
    return values


def _ranked_lists(plan: Plan, family: str, layer_key: str) -> list[str] | None:
    artifacts = plan.document.get("scorerArtifacts") or {}
    for key in ("taskFamilySlicePriors", "promptClusterPriors"):
        ranked = artifacts.get(key)
        if isinstance(ranked, Mapping) and isinstance(ranked.get(family), Mapping):
            ids = ranked[family].get(layer_key)
            if isinstance(ids, Sequence) and not isinstance(ids, str):
                return [str(i) for i in ids]
    return None


def slice_priors(plan: Plan, weights: Mapping[str, float]) -> dict[int, list[float]]:
    """Layer -> per-slice (catalog order) prior value: Σ weight[f] · prior_f(slice).

    prior_f is the slice's ``taskPriors[f]``. A plan that only *ranks* slices for f (scorer
    artifact lists) gives the slice at rank r the r-th largest global prior of its layer, so
    the layer keeps its mass scale and f its order; slices missing from the list get 0.
    """
    out: dict[int, list[float]] = {}
    for index, layer in plan.layers.items():
        glob = _global_prior(layer.slices)
        total = [0.0] * len(layer.slices)
        for name, w in weights.items():
            if w == 0.0:
                continue
            if name == GLOBAL:
                values = glob
            elif all(name in s.task_priors for s in layer.slices):
                values = [s.task_priors[name] for s in layer.slices]
            else:
                ranked = _ranked_lists(plan, name, layer.key)
                by_mass = sorted(glob, reverse=True)
                rank = {sid: r for r, sid in enumerate(ranked or ())}
                values = [
                    s.task_priors[name]
                    if name in s.task_priors
                    else (
                        by_mass[rank[s.slice_id]]
                        if s.slice_id in rank and rank[s.slice_id] < len(by_mass)
                        else (glob[i] if ranked is None else 0.0)
                    )
                    for i, s in enumerate(layer.slices)
                ]
            total = [t + w * v for t, v in zip(total, values)]
        out[index] = total
    return out


# ----------------------------------------------------------------------------- misses


def missed_mass(router_misses: Mapping[str, Any]) -> MissedMass:
    """GET /router_misses/{id} -> layer -> expert -> share of the layer's routing that missed on it.

    With the payload's per-expert ``expert_counts`` (the server's routed selections per expert),
    an inactive expert's share is its count over the layer's ``observed_selections``: the unit
    the hit rate is measured in, and the unit of the planner's priors (shares of selections).
    Without them: a per-expert ``inactive_expert_mass`` if present, else each of the layer's
    ``inactive_experts`` gets an equal part of its ``inactive_mass`` (over ``observed_mass``).
    """
    out: MissedMass = {}
    for key, row in (router_misses.get("layers") or {}).items():
        layer = int(str(key).removeprefix("layer_"))
        inactive = [int(e) for e in row.get("inactive_experts") or ()]
        counts = row.get("expert_counts")
        selections = int(row.get("observed_selections") or 0)
        if isinstance(counts, Sequence) and not isinstance(counts, str) and selections > 0:
            shares = {e: counts[e] / selections for e in inactive if 0 <= e < len(counts) and counts[e] > 0}
            if shares:
                out[layer] = dict(sorted(shares.items()))
            continue
        observed = float(row.get("observed_mass") or 0.0) or float(selections)
        if observed <= 0.0:
            continue
        per_expert = row.get("inactive_expert_mass")
        masses: dict[int, float] = {}
        if isinstance(per_expert, Mapping):
            masses = {int(e): float(m) for e, m in per_expert.items() if float(m) > 0}
        elif isinstance(per_expert, Sequence) and not isinstance(per_expert, str):
            masses = {e: float(m) for e, m in enumerate(per_expert) if float(m) > 0}
        else:
            total = float(row.get("inactive_mass") or 0.0)
            if total <= 0.0 and inactive:  # no gate weights counted: fall back to selections
                total = float(row.get("missed_selections") or 0) * (observed / max(1, selections))
            masses = {e: total / len(inactive) for e in inactive} if inactive else {}
        if masses:
            out[layer] = {e: m / observed for e, m in sorted(masses.items())}
    return out


def routed_share(router_misses: Mapping[str, Any]) -> MissedMass | None:
    """layer -> expert -> share of the layer's routed selections, resident or not (from the
    payload's ``expert_counts``); None when the server does not report per-expert counts."""
    out: MissedMass = {}
    found = False
    for key, row in (router_misses.get("layers") or {}).items():
        counts = row.get("expert_counts")
        if not isinstance(counts, Sequence) or isinstance(counts, str):
            continue
        found = True
        total = sum(counts)
        if total > 0:
            out[int(str(key).removeprefix("layer_"))] = {e: c / total for e, c in enumerate(counts) if c > 0}
    return out if found else None


# ----------------------------------------------------------------------------- the greedy fill


@dataclass(frozen=True)
class Selection:
    """Core ∪ chosen slices: the payload for /swap_active_set and what it will cost."""

    strategy: str
    phase: Literal["prefill", "decode_refresh"]
    slices: Mapping[int, tuple[str, ...]]  # layer -> chosen sliceIds, in the order taken
    keep: ResidentSets  # what will be resident: core | chosen, every plan layer
    resident_bytes: int
    budget_bytes: int  # the budget the selection was made for
    request_budget_bytes: int | None  # what goes into the payload's budget_bytes (None: the plan's)
    signature: str  # active_set.signature(keep): what the server will report
    values: Mapping[str, float] = field(default_factory=dict)  # sliceId -> value it was taken for
    features: PromptFeatures | None = None

    @property
    def slice_count(self) -> int:
        return sum(len(v) for v in self.slices.values())

    def active_set(self) -> dict[str, list[str]]:
        """{"layer_N": [sliceIds]} for the layers with chosen slices (the core is implied)."""
        return {f"layer_{layer}": list(ids) for layer, ids in sorted(self.slices.items()) if ids}

    def payload(self, request_id: str, *, phase: str | None = None, reset_router_stats: bool = False) -> dict:
        """A SwapRequest body (validated here, so a bad one fails before it reaches the server)."""
        body: dict[str, Any] = {
            "request_id": request_id,
            "phase": phase or self.phase,
            "active_set": self.active_set(),
        }
        if self.request_budget_bytes is not None:  # as applied: never above the plan's (the pool)
            body["budget_bytes"] = self.budget_bytes
        if reset_router_stats:
            body["reset_router_stats"] = True
        SwapRequest.model_validate(body)
        return body

    def to_dict(self) -> dict:
        return {
            "strategy": self.strategy,
            "phase": self.phase,
            "signature": self.signature,
            "slices": {f"layer_{k}": list(v) for k, v in sorted(self.slices.items()) if v},
            "slice_count": self.slice_count,
            "resident_experts": sum(len(v) for v in self.keep.values()),
            "resident_bytes": self.resident_bytes,
            "budget_bytes": self.budget_bytes,
            "values": {k: round(v, 8) for k, v in self.values.items()},
            "features": self.features.to_dict() if self.features else None,
        }


def effective_budget(plan: Plan, budget_bytes: int | None) -> int:
    """The request's budget, never above the plan's; must hold the core."""
    budget = (
        plan.swappable_budget_bytes
        if budget_bytes is None
        else min(int(budget_bytes), plan.swappable_budget_bytes)
    )
    if budget < plan.core_bytes():
        raise SelectionError(
            f"budget {budget:,} bytes does not hold the plan's core ({plan.core_bytes():,} bytes)"
        )
    return budget


Value = tuple[float, ...]  # compared lexicographically, per marginal byte


def _greedy(plan: Plan, budget: int, value: Any) -> tuple[dict[int, list[str]], dict[str, float]]:
    """Take slices by value per marginal byte while they fit. ``value(layer, i, new_experts)`` ->
    a tuple (all zero: worthless). Lazy heap: a popped slice whose marginal cost or value changed
    since it was pushed (an overlapping slice was taken) is re-scored and pushed again."""
    pe = plan.per_expert_bytes
    keep = {index: set(layer.core) for index, layer in plan.layers.items()}
    used = resident_bytes(plan, keep)
    chosen: dict[int, list[str]] = {}
    values: dict[str, float] = {}
    heap: list = []

    def score(index: int, i: int) -> tuple[Value, int, frozenset[int]]:
        new = frozenset(plan.layers[index].slices[i].experts) - keep[index]
        if not new:
            return (), 0, new
        v = tuple(value(index, i, new))
        return v, len(new) * pe, new

    def push(index: int, i: int) -> None:
        """Score slice i of the layer now and queue it if it is worth anything."""
        v, cost, _ = score(index, i)
        if cost and any(x > 0 for x in v):
            heapq.heappush(heap, (tuple(-x / cost for x in v), index, i, v, cost))

    for index, layer in plan.layers.items():
        for i in range(len(layer.slices)):
            push(index, i)
    deferred: list[tuple[int, int]] = []
    while heap:
        _key, index, i, v, cost = heapq.heappop(heap)
        v2, cost2, new = score(index, i)
        if not cost2 or not any(x > 0 for x in v2):
            continue
        if (v2, cost2) != (v, cost):
            push(index, i)
            continue
        if used + cost > budget:
            deferred.append((index, i))  # may fit later if an overlapping slice makes it cheaper
            continue
        keep[index] |= new
        used += cost
        sid = plan.layers[index].slices[i].slice_id
        chosen.setdefault(index, []).append(sid)
        values[sid] = v[0]
        for dl, di in [d for d in deferred if d[0] == index]:
            deferred.remove((dl, di))
            push(dl, di)
    return chosen, values


def _finish(
    plan: Plan,
    strategy: str,
    phase: str,
    chosen: Mapping[int, Sequence[str]],
    budget: int,
    request_budget: int | None,
    values: Mapping[str, float],
    features: PromptFeatures | None,
) -> Selection:
    """Build the keep-set exactly as the server will and check it against the budget."""
    slices = {index: tuple(ids) for index, ids in sorted(chosen.items()) if ids}
    requested = normalize_active_set(plan, {f"layer_{k}": list(v) for k, v in slices.items()})
    keep = resident_sets(plan, requested)
    check_budget(plan, keep, budget)
    return Selection(
        strategy=strategy,
        phase=phase,
        slices=slices,
        keep=keep,
        resident_bytes=resident_bytes(plan, keep),
        budget_bytes=budget,
        request_budget_bytes=request_budget,
        signature=signature(keep),
        values=dict(values),
        features=features,
    )


def _share_value(priors: Mapping[int, Sequence[float]], plan: Plan):
    """A slice's prior, pro rata for the part of it not yet resident."""

    def value(index: int, i: int, new: frozenset[int]) -> tuple[float]:
        s = plan.layers[index].slices[i]
        return (priors[index][i] * len(new) / len(set(s.experts)),)

    return value


def select_static(plan: Plan, budget_bytes: int | None = None) -> Selection:
    budget = effective_budget(plan, budget_bytes)
    return _finish(plan, "static", "prefill", {}, budget, budget_bytes, {}, None)


def select_prior(
    plan: Plan, prompt: str | Sequence[Mapping[str, Any]], budget_bytes: int | None = None
) -> Selection:
    budget = effective_budget(plan, budget_bytes)
    features = prompt_features(plan, prompt)
    chosen, values = _greedy(plan, budget, _share_value(slice_priors(plan, features.weights), plan))
    return _finish(plan, "prior", "prefill", chosen, budget, budget_bytes, values, features)


def _miss_then_prior(
    plan: Plan,
    misses: MissedMass,
    priors: Mapping[int, Sequence[float]],
    current: Mapping[int, frozenset[int]] | None = None,
):
    """(missed mass of the new experts, prior share of them): misses first, the prior fills.

    ``current`` (refresh): experts resident during the measurement show no misses however much
    they were used, so their part counts at its prior share in the first component too.
    """
    prior_value = _share_value(priors, plan)

    def value(index: int, i: int, new: frozenset[int]) -> tuple[float, float]:
        row = misses.get(index, {})
        mass = sum(row.get(e, 0.0) for e in new)
        (p,) = prior_value(index, i, new)
        if current is not None:
            s = plan.layers[index].slices[i]
            was = new & current.get(index, frozenset())
            mass += priors[index][i] * len(was) / len(set(s.experts))
        return mass, p

    return value


def select_probe(
    plan: Plan,
    misses: MissedMass,
    prompt: str | Sequence[Mapping[str, Any]] = "",
    budget_bytes: int | None = None,
) -> Selection:
    """``misses``: :func:`missed_mass` of a prefill-only pass run with only the core resident."""
    budget = effective_budget(plan, budget_bytes)
    features = prompt_features(plan, prompt)
    chosen, values = _greedy(
        plan, budget, _miss_then_prior(plan, misses, slice_priors(plan, features.weights))
    )
    return _finish(plan, "probe", "prefill", chosen, budget, budget_bytes, values, features)


def refresh(
    plan: Plan,
    current: Selection,
    misses: MissedMass,
    refresh_count: int,
    prompt: str | Sequence[Mapping[str, Any]] = "",
    routed: MissedMass | None = None,
) -> Selection | None:
    """Decode-time re-selection from what the running request has routed so far.

    With ``routed`` (:func:`routed_share`: every expert's share, resident or not) slices are
    valued by the request's own demand, the prior breaking ties. With only ``misses`` (measured
    against ``current``), the slices resident now showed no misses however much they were used, so
    they are valued at their prior and stay unless measured misses outweigh it. None when the
    request already used ``max_refreshes_per_request`` refreshes or nothing would change.
    """
    if refresh_count >= plan.max_refreshes_per_request:
        return None
    budget = current.budget_bytes
    features = current.features or prompt_features(plan, prompt)
    priors = slice_priors(plan, features.weights)
    if routed is not None:
        value = _miss_then_prior(plan, routed, priors)
    else:
        chosen_now = {index: frozenset(ids) - plan.layers[index].core for index, ids in current.keep.items()}
        value = _miss_then_prior(plan, misses, priors, chosen_now)
    chosen, values = _greedy(plan, budget, value)
    new = _finish(
        plan,
        current.strategy,
        "decode_refresh",
        chosen,
        budget,
        current.request_budget_bytes,
        values,
        features,
    )
    return None if new.signature == current.signature else new


# ----------------------------------------------------------------------------- one interface


class Strategy(Protocol):
    name: str
    needs_probe: bool  # True: select() wants the misses of a core-only prefill pass

    def select(
        self,
        plan: Plan,
        prompt: str | Sequence[Mapping[str, Any]],
        *,
        budget_bytes: int | None = None,
        probe: MissedMass | None = None,
    ) -> Selection: ...


@dataclass(frozen=True)
class _Static:
    name: str = "static"
    needs_probe: bool = False

    def select(self, plan, prompt, *, budget_bytes=None, probe=None) -> Selection:
        return select_static(plan, budget_bytes)


@dataclass(frozen=True)
class _Prior:
    name: str = "prior"
    needs_probe: bool = False

    def select(self, plan, prompt, *, budget_bytes=None, probe=None) -> Selection:
        return select_prior(plan, prompt, budget_bytes)


@dataclass(frozen=True)
class _Probe:
    name: str = "probe"
    needs_probe: bool = True

    def select(self, plan, prompt, *, budget_bytes=None, probe=None) -> Selection:
        if probe is None:
            raise SelectionError("strategy 'probe' needs the router misses of a core-only prefill pass")
        return select_probe(plan, probe, prompt, budget_bytes)


_REGISTRY: dict[str, Strategy] = {"static": _Static(), "prior": _Prior(), "probe": _Probe()}


def get_strategy(name: str) -> Strategy:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise SelectionError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}") from None


def select(
    plan: Plan,
    strategy: str,
    prompt: str | Sequence[Mapping[str, Any]],
    *,
    budget_bytes: int | None = None,
    probe: MissedMass | None = None,
) -> Selection:
    return get_strategy(strategy).select(plan, prompt, budget_bytes=budget_bytes, probe=probe)


def core_probe_payload(request_id: str) -> dict:
    """The swap that leaves only the core resident, for the probe pass."""
    body = {"request_id": request_id, "active_set": {}}
    SwapRequest.model_validate(body)
    return body


__all__ = [
    "STRATEGIES",
    "MissedMass",
    "PromptFeatures",
    "Selection",
    "SelectionError",
    "Strategy",
    "classify",
    "core_probe_payload",
    "effective_budget",
    "get_strategy",
    "missed_mass",
    "plan_families",
    "prompt_features",
    "prompt_text",
    "refresh",
    "routed_share",
    "select",
    "select_prior",
    "select_probe",
    "select_static",
    "slice_priors",
]
