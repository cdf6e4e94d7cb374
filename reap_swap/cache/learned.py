"""``dlearn``: a device policy whose eviction score is a linear predictor of each expert's reuse,
fitted on a calibration routing trace (the simulator's policy target; research.md, "Policy search
beyond LFU"). Pure (numpy).

The score is ``sum_i w[i] * f[i]`` over eight per-expert features, all int64 with 16 fractional
bits, updated once per layer-step in this order (``share = (selections << 16) // the step's
selections``, i.e. the expert's share of the step's routing):

0. ``fast``: LFU of the shares, decay 0.8 per step (``(x * 52429) >> 16``, then ``+ share``);
1. ``slow``: the same with decay 0.97 (63570);
2. ``request``: the share in the current request's prefill (set at a request start, then held);
3. ``in_request``: LFU of the shares since the request started, decay 0.95 (62259), 0 at a start;
4. ``last``: ``1 << 16`` if routed this step;
5. ``markov``: ``sum over this step's experts f of table[f, e]``, ``table = round(2**16 *
   P(e in the next decode step | f in this one))`` (prior.transition_table), 0 after a prefill;
6. ``global``: ``round(2**16 * P(e routed in a decode step))`` on the calibration trace;
7. ``1 << 16`` (the intercept; it does not change the ranking).

``w`` (int64, ``round(2**16 * w_float)``) is fitted per layer by least squares on the calibration
trace: the target of (step t, expert e) is ``gamma ** (d - 1)`` with ``d`` the steps to e's next
use (0 if none), over decode decisions (t + 1 not a request start), so the score estimates how soon
the expert is wanted again -- the quantity Belady ranks by. The decision is ``dlfu-admit``'s: rank
candidates by (score, resident, lower id), a miss is admitted only if it outranks the weakest
evictable resident. Every operation is integer, so the resident set after each step is determined
by the trace, the table and the weights (numpy = torch, any TP rank).

Request starts: the policy needs to know which steps start a request (``begin_step``; the
simulator and the stepper pass the trace's / the scheduler's flag). On the device that is one
int flag per step in a static input buffer, written by the host when it schedules the step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from reap_swap.cache.mechanism import LayerSteps
from reap_swap.cache.online import _Ranked
from reap_swap.cache.prior import transition_table

FRAC = 16
ONE = 1 << FRAC
DECAYS = {"fast": 52429, "slow": 63570, "in_request": 62259}  # 0.8, 0.97, 0.95 in 2**-16
FEATURES = ("fast", "slow", "request", "in_request", "last", "markov", "global", "one")
REUSE_GAMMA = 0.8  # target discount (flat in 0.5-0.9 on the calibration trace)


class Features:
    """The eight features of one layer, stepped online (int64 [E, 8] after each step)."""

    def __init__(self, table: np.ndarray, glob: np.ndarray):
        self.table = np.asarray(table, dtype=np.int64)
        self.glob = np.asarray(glob, dtype=np.int64)
        e = self.table.shape[0]
        if self.table.shape != (e, e) or self.glob.shape != (e,):
            raise ValueError(f"table {self.table.shape} / global {self.glob.shape}: need [E, E] and [E]")
        self.fast, self.slow, self.req, self.inreq = (np.zeros(e, dtype=np.int64) for _ in range(4))

    def step(self, needed: np.ndarray, counts: np.ndarray, request_start: bool) -> np.ndarray:
        e = len(self.glob)
        needed = np.asarray(needed, dtype=np.int64)
        share = np.zeros(e, dtype=np.int64)
        total = int(np.sum(counts))
        if total:
            share[needed] = (np.asarray(counts, dtype=np.int64) << FRAC) // total
        self.fast = ((self.fast * DECAYS["fast"]) >> FRAC) + share
        self.slow = ((self.slow * DECAYS["slow"]) >> FRAC) + share
        if request_start:
            self.req, self.inreq = share.copy(), np.zeros(e, dtype=np.int64)
            markov = np.zeros(e, dtype=np.int64)
        else:
            self.inreq = ((self.inreq * DECAYS["in_request"]) >> FRAC) + share
            markov = self.table[needed].sum(axis=0) if len(needed) else np.zeros(e, dtype=np.int64)
        last = np.zeros(e, dtype=np.int64)
        last[needed] = ONE
        one = np.full(e, ONE, dtype=np.int64)
        return np.stack([self.fast, self.slow, self.req, self.inreq, last, markov, self.glob, one], axis=1)


def decode_rates(steps: LayerSteps) -> np.ndarray:
    """int64 [E]: ``round(2**16 * P(e routed in a decode step))``."""
    used = np.zeros(steps.num_experts)
    decode = [t for t in range(steps.num_steps) if not steps.request_start[t]]
    for t in decode:
        used[steps.needed[t]] += 1
    return np.rint(used / max(1, len(decode)) * ONE).astype(np.int64)


def reuse_targets(steps: LayerSteps, gamma: float = REUSE_GAMMA) -> np.ndarray:
    """float [steps, E]: ``gamma ** (d - 1)``, d = steps from t to e's next use (0: never again)."""
    n, e = steps.num_steps, steps.num_experts
    nxt = np.full(e, -1, dtype=np.int64)
    out = np.zeros((n, e))
    for t in range(n - 1, -1, -1):
        out[t] = np.where(nxt >= 0, gamma ** (nxt - t - 1.0), 0.0)
        nxt[steps.needed[t]] = t
    return out


def fit_layer(
    steps: LayerSteps, gamma: float = REUSE_GAMMA, features: Sequence[str] = FEATURES
) -> dict[str, np.ndarray]:
    """The per-layer model from a calibration trace: transition table, decode rates, weights
    (int64 [8]; features left out get weight 0). Least squares over decode decisions."""
    unknown = [f for f in features if f not in FEATURES]
    if unknown:
        raise ValueError(f"unknown features {unknown}; choose from {FEATURES}")
    table, glob = transition_table(steps, 1.0), decode_rates(steps)
    cols = [FEATURES.index(f) for f in features]
    feats, target, ys = Features(table, glob), reuse_targets(steps, gamma), []
    xs = []
    for t in range(steps.num_steps):
        f = feats.step(steps.needed[t], steps.counts[t], bool(steps.request_start[t]))
        if t + 1 < steps.num_steps and not steps.request_start[t + 1]:
            xs.append(f[:, cols] / ONE)
            ys.append(target[t])
    weights = np.zeros(len(FEATURES), dtype=np.int64)
    if xs:
        w, *_ = np.linalg.lstsq(np.concatenate(xs), np.concatenate(ys), rcond=None)
        weights[cols] = np.rint(w * ONE).astype(np.int64)
    return {"table": table, "global": glob, "weights": weights}


class DLearn(_Ranked):
    """Learned linear reuse score with admission control (the module docstring is the spec)."""

    def __init__(self, name, model: dict, seed=frozenset(), pinned=frozenset()):
        super().__init__(name, seed, pinned)
        self.model = model
        self.weights = np.asarray(model["weights"], dtype=np.int64)
        if self.weights.shape != (len(FEATURES),):
            raise ValueError(f"weights: need {len(FEATURES)}, got shape {self.weights.shape}")
        self.request_start = False

    def reset(self, num_experts: int) -> None:
        if len(self.model["global"]) != num_experts:
            raise ValueError(f"model is for {len(self.model['global'])} experts, layer {num_experts}")
        self.features = Features(self.model["table"], self.model["global"])
        self.s = np.zeros(num_experts, dtype=np.int64)

    def begin_step(self, t: int, request_start: bool) -> None:
        self.request_start = bool(request_start)

    def observe(self, t, needed, counts) -> None:
        f = self.features.step(needed, counts, self.request_start)
        self.s = f @ self.weights

    def score(self, t, e) -> int:
        return int(self.s[e])

    def rank_key(self, t: int, e: int, need: frozenset[int], resident: frozenset[int]) -> tuple:
        return (self.score(t, e), e in resident, -e)
