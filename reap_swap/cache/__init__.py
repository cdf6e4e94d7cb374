"""The expert cache, pure: policies, slot bookkeeping, routing traces, simulation and accounting.

Device-cache policies in simulation: replay a routing trace, count hits, misses and
bytes moved per policy, budget and layer. Pure (numpy; the plan and selection modules).

The device mechanism modelled (one MoE layer; layers are independent):

- The layer has a fixed number of HBM slots C (``sizing.cache_tail.layer_slots``: the budget in experts,
  ``budget bytes // per-expert bytes``, spread over the layers; by default each layer's plan core
  plus an even share of the rest, the "tail beside the pinned set" of the device design).
- Steps run in trace order (requests one at a time; a prefill is one step, each decode token one
  step). Before a step's kernel runs, the step's routed experts N (the distinct experts of all its
  tokens) are known.
- Hits and misses are counted against the resident set D at step start. An expert of N not in D
  is a miss: counted once per routed *selection* (the server's router-miss unit) and once per
  *distinct expert* per step (what crosses the host link: the expert is read once, into a slot
  or straight through). Both are reported; so is the decode-only share.
- Then the policy picks the new resident set D' under three rules (``mechanism._check``): it keeps
  every expert of D that the step needs (a slot the kernel reads is never evicted in that step),
  admits only experts the step routed (a missed expert is copied into a freed slot), and holds
  at most C. A miss not admitted is read through from host memory (``bypassed``). A step with
  |N| > C cannot be served from slots alone: a read-through step (counted).
- Bytes moved = (admitted + prefetched experts) x per-expert bytes. The startup fill (the plan's
  core, for the policies that use it) is not counted as moved. Only per-request swaps
  (``probe``) prefetch: they replace D before a request's prefill, as ``/swap_active_set`` does.

Policies (``replay.POLICIES``): ``static`` (the plan's core, never changed), ``probe`` (core +
the client's per-request ``probe`` slices, reap_swap.client.selection), ``lru``, ``lfu`` (with decay),
``lfru`` (each unseeded, ``-seeded`` starting from the plan core, ``core+`` with the core pinned
and the policy on the tail), the plan-aware device policies of prior.py (``dlfu-admit-seeded``:
admission control; ``dlfu-markov-seeded``: plus a transition prior from a calibration trace),
``probe+lfu`` / ``probe+dlfu`` (all three: the client's ``probe`` set pinned by a per-request swap,
``lfu-seeded`` / ``dlfu-seeded`` in the slots left over, as accounting mode with --reap-cache-seed
seeded; hybrid.py), ``probe+core+dlfu`` (the device's pinned form with swaps: the set pinned beside
a fixed N-slot ``core+dlfu`` tail, as the default accounting mode and DeviceCache.set_pinned)
``probe+core+dlfu-split`` (its servable form, the bench's ``plan-swap+cache``: the tail
cache_tail.swap_cache_split gives, the sets selected within the swap table K it leaves;
probe.servable_split)
``belady``: the offline optimum of distinct misses under the same
rules (belady.py says why, and what it does not bound); and ``belady-admit``: the optimum when every
miss must be admitted, from a cold start (the oracle of published per-layer residency studies).
"""

from reap_swap.cache.mechanism import LayerCounts, LayerSteps, PolicyError, replay_layer
from reap_swap.cache.replay import POLICIES, SimulationError, parse_budget, simulate

__all__ = [
    "POLICIES",
    "LayerCounts",
    "LayerSteps",
    "PolicyError",
    "SimulationError",
    "parse_budget",
    "replay_layer",
    "simulate",
]
