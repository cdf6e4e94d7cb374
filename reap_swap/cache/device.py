"""The device cache's policy in integer arithmetic: ``dlfu``, LFU with decay in fixed point.

Why a policy of its own: the CUDA cache (reap_swap.engine.device_cache.layer) updates its scores on
the device every step, and its misses must equal this simulator's *exactly* on a replayed trace.
``lfu`` (online.py) scores in float64, whose last bits a device would have to reproduce operation
by operation; ``dlfu`` is the same policy in int64, so numpy and torch (CPU or CUDA, any TP rank)
agree bit for bit with no rounding question at all. The specification, shared by both:

- Score per expert, int64, 16 fractional bits (``SCORE_FRAC``). Each step, in this order:
  ``score = (score * decay_num) >> 16`` (floor; ``decay_num = round(decay * 2**16)``, 52429 for
  the default 0.8), then ``score += selections << 16`` for the step's routed selections of each
  expert, then ``score = min(score, SCORE_MAX)`` (2**46 - 1: no overflow of the int64 products).
- The decision is online.py's ``_Ranked.choose`` unchanged: keep what the step needs and the
  pinned experts; rank the rest (residents not needed, misses) by (routed this step, score,
  already resident, lower expert id) descending and keep the best up to the slots. The key is a
  total order, so the resident *set* after every step is determined by the trace alone.
- Which slot an admitted expert lands in is not the simulator's business (it counts sets); the
  device's rule (lowest free slot to the lowest admitted expert id) is in device_cache.py.

Names in replay.POLICIES: ``dlfu`` (unseeded), ``dlfu-seeded`` (startup fill = the plan core,
evictable: on the device, all C slots are cache slots seeded with the core) and ``core+dlfu`` (the
core pinned in its own units, the policy on a tail of C - |core| slots). Hit rates are within a
few hundredths of a point of ``lfu`` (research.md, "The device mechanism on CUDA").
"""

from __future__ import annotations

import numpy as np

from reap_swap.cache.online import LFU_DECAY, _Ranked

SCORE_FRAC = 16
DECAY_SHIFT = 16
SCORE_MAX = (1 << 46) - 1


def decay_numerator(decay: float) -> int:
    """The fixed-point decay factor: ``round(decay * 2**16)``, in [1, 2**16]."""
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"decay must be in (0, 1], got {decay}")
    return max(1, min(1 << DECAY_SHIFT, round(decay * (1 << DECAY_SHIFT))))


def update_scores(score: np.ndarray, step_counts: np.ndarray, decay_num: int) -> np.ndarray:
    """One step of the score arithmetic on a dense [E] int64 ``step_counts`` (numpy reference)."""
    out = (score * np.int64(decay_num)) >> np.int64(DECAY_SHIFT)
    out = out + (step_counts.astype(np.int64) << np.int64(SCORE_FRAC))
    return np.minimum(out, np.int64(SCORE_MAX))


class DLFU(_Ranked):
    """LFU with decay in int64 fixed point (the module docstring is the specification)."""

    def __init__(self, name, seed=frozenset(), pinned=frozenset(), decay: float = LFU_DECAY):
        super().__init__(name, seed, pinned)
        self.decay_num = decay_numerator(decay)

    def reset(self, num_experts: int) -> None:
        self.freq = np.zeros(num_experts, dtype=np.int64)

    def observe(self, t, needed, counts) -> None:
        dense = np.zeros_like(self.freq)
        dense[needed] = counts
        self.freq = update_scores(self.freq, dense, self.decay_num)

    def score(self, t, e) -> int:
        return int(self.freq[e])
