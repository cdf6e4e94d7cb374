"""Device policies that use what the plan's calibration run saw (the simulator's policy target):
``dlfu`` with admission control, and with a next-step transition prior. Pure (numpy).

Both are ``dlfu`` (device.py: int64 scores, 16 fractional bits, the same decay and clamp) with
one change each to the decision, so the device kernel changes little:

- ``DLFUAdmit`` ("TinyLFU"-style admission): ``_Ranked.choose`` ranks the candidates it may keep
  (residents the step did not need, the step's misses) by (routed this step, score, resident,
  lower id), so every miss is admitted while evictable slots are left. Here the first key is
  dropped: candidates rank by (score, resident, lower id) and a miss is admitted only if its
  score (this step's selections included) beats the weakest evictable resident; otherwise it is
  read through (``bypassed``). The rules of mechanism.py allow this (Belady bypasses too).
- ``DLFUMarkov``: the ranking score is ``score + pred`` where ``pred[e] = sum over the step's
  routed experts f of table[f, e]``, an int64 [E, E] table built once on the host from a
  calibration routing trace (:func:`transition_table`): ``round(weight * 2**16 * P(e routed in
  the next decode step | f routed in this one))``. ``pred`` is recomputed each step (not decayed
  into the score). On the device: one gather of the step's rows and a sum, integer only.

Ties are broken as in dlfu (resident first, then the lower expert id): the key is a total order,
so the resident set after each step is determined by the trace and the table alone.
"""

from __future__ import annotations

import numpy as np

from reap_swap.cache.device import DLFU, SCORE_FRAC
from reap_swap.cache.mechanism import LayerSteps
from reap_swap.cache.online import LFU_DECAY

TRANSITION_SMOOTHING = 0.1  # pseudo-count per (f, e) pair: an unseen pair is not impossible
MARKOV_WEIGHT = 16.0  # chosen on the calibration trace (research.md, "Policy target")


def transition_table(steps: LayerSteps, weight: float = MARKOV_WEIGHT) -> np.ndarray:
    """int64 [E, E]: ``round(weight * 2**16 * P(e in step t + 1 | f in step t))`` over consecutive
    decode steps of one request (a prefill, and the step before it, are not counted)."""
    if weight < 0:
        raise ValueError(f"transition weight must be >= 0, got {weight}")
    e = steps.num_experts
    pairs = np.full((e, e), TRANSITION_SMOOTHING, dtype=np.float64)
    for t in range(steps.num_steps - 1):
        if steps.request_start[t] or steps.request_start[t + 1]:
            continue
        cur = np.zeros(e)
        cur[steps.needed[t]] = 1.0
        nxt = np.zeros(e)
        nxt[steps.needed[t + 1]] = 1.0
        pairs += np.outer(cur, nxt)
    prob = pairs / pairs.sum(axis=1, keepdims=True)
    return np.rint(prob * weight * (1 << SCORE_FRAC)).astype(np.int64)


class DLFUAdmit(DLFU):
    """dlfu with admission control: a miss displaces a resident only by outscoring it."""

    def rank_key(self, t: int, e: int, need: frozenset[int], resident: frozenset[int]) -> tuple:
        """No priority for needed experts: a miss is admitted only if it outscores a resident."""
        return (self.score(t, e), e in resident, -e)


class DLFUMarkov(DLFUAdmit):
    """dlfu with admission control, ranked by score + the transition prior of the step's experts."""

    def __init__(
        self, name, table: np.ndarray, seed=frozenset(), pinned=frozenset(), decay: float = LFU_DECAY
    ):
        super().__init__(name, seed, pinned, decay)
        self.table = np.asarray(table, dtype=np.int64)
        if self.table.ndim != 2 or self.table.shape[0] != self.table.shape[1]:
            raise ValueError(f"transition table must be square, got shape {self.table.shape}")

    def reset(self, num_experts: int) -> None:
        if self.table.shape[0] != num_experts:
            raise ValueError(f"transition table is {self.table.shape[0]} experts, layer {num_experts}")
        super().reset(num_experts)
        self.pred = np.zeros(num_experts, dtype=np.int64)

    def observe(self, t, needed, counts) -> None:
        super().observe(t, needed, counts)
        self.pred = self.table[np.asarray(needed, dtype=np.int64)].sum(axis=0)

    def score(self, t, e) -> int:
        return int(self.freq[e] + self.pred[e])
