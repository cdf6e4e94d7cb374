"""A vectorised replay of the device kernel's policy family (``dlfu``: integer LFU with decay) for
parameter sweeps (research-notes/olmoe/policy-sweep.md). Same rules and integer arithmetic as
reap_swap.cache.device.DLFU under reap_swap.cache.mechanism.replay_layer (``--check`` compares
every count with ``simulate`` on the given traces), but all layers and all configurations of a
sweep step together as rows of one [rows, E] array, so a sweep of dozens of configurations costs
about one replay.

A configuration (``Config``) is what the CUDA kernel (engine/device_cache/fast_kernel.py) can be
given without a change to the kernel:
- ``decay``: ``decay_num = round(decay * 2**16)`` is a runtime argument of the kernel;
- ``start``: ``cold`` (empty slots), ``seeded`` (the plan core in the slots, evictable:
  ``dlfu-seeded``) or ``pinned`` (the core in its own units, the policy on the rest: ``core+dlfu``);
- ``slots``: per-layer slot counts (a host-side sizing choice: core+tail of the plan, uniform, ...);
- ``init``: optional initial scores [L, E] (int64, 16 fractional bits) written into ``cache.score``
  before the first step (a host write between steps; the engine does not do this today).
and what needs a kernel change:
- ``admit``: ``dlfu-admit`` (one key bit dropped: a miss takes a slot only by outscoring the
  weakest evictable resident; otherwise read through);
- ``table``: ``dlfu-markov`` (rank by score + the routed experts' rows of an [E, E] transition
  table from a calibration trace: prior.DLFUMarkov);
- ``inc_cap``: a step adds ``min(selections, cap)`` per expert instead of its selections.
``foresight`` is a REFERENCE (reads the trace's next k steps), not a policy.

    PYTHONPATH=$PWD .venv/bin/python research/sim/sweep_dlfu.py --check TRACE.npz --plan PLAN.json --budget 0.5 \
        [--decays 0.8 0.96] [--prior CALIBRATION.npz]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

import numpy as np

from reap_swap.cache.device import DECAY_SHIFT, SCORE_FRAC, SCORE_MAX, decay_numerator
from reap_swap.cache.trace import Trace


@dataclass
class Config:
    name: str
    decay: float
    slots: dict[int, int]  # layer -> slots (including a pinned core)
    core: dict[int, frozenset[int]] = field(default_factory=dict)  # layer -> plan core
    start: str = "cold"  # cold | seeded | pinned
    admit: bool = False  # dlfu-admit's decision (kernel change: one key bit dropped)
    init: np.ndarray | None = None  # [L, E] int64 initial scores (layers in trace order)
    table: np.ndarray | None = None  # [L, E, E] int64 transition prior (dlfu-markov: kernel change)
    inc_cap: int = 0  # >0: a step adds min(selections, inc_cap) per expert (kernel change: one min)
    foresight: int = 0  # >0: REFERENCE, not servable: experts routed in the next k steps rank first


COUNTS = (
    "selections",
    "selection_hits",
    "experts",
    "expert_hits",
    "admitted",
    "bypassed",
    "read_through_steps",
    "steps",
)
DECODE = ("decode_selections", "decode_selection_hits", "decode_experts", "decode_expert_hits")


def replay(
    trace: Trace, configs: list[Config], step_counts: dict[int, np.ndarray] | None = None
) -> list[dict]:
    """Every configuration over every layer of ``trace`` (cold start once, as simulate): totals."""
    layers, e = list(trace.layers), trace.num_experts
    if step_counts is None:
        step_counts = {l: trace.step_counts(l) for l in layers}
    nl, nc = len(layers), len(configs)
    b = nl * nc
    id_bits = max(1, (e - 1).bit_length())
    # rows: config-major, then layer
    cap = np.array([c.slots[l] for c in configs for l in layers], dtype=np.int64)
    dn = np.array([decay_numerator(c.decay) for c in configs for _ in layers], dtype=np.int64)[:, None]
    admit = np.array([c.admit for c in configs for _ in layers], dtype=bool)[:, None]
    icap = np.array(
        [c.inc_cap if c.inc_cap > 0 else 1 << 40 for c in configs for _ in layers], dtype=np.int64
    )[:, None]
    res = np.zeros((b, e), dtype=bool)
    pinned = np.zeros((b, e), dtype=bool)
    score = np.zeros((b, e), dtype=np.int64)
    for i, c in enumerate(configs):
        for j, l in enumerate(layers):
            r = i * nl + j
            if c.start in ("seeded", "pinned"):
                core = sorted(c.core[l])
                if len(core) > c.slots[l]:
                    raise ValueError(f"{c.name}: layer {l} core {len(core)} > {c.slots[l]} slots")
                res[r, core] = True
                if c.start == "pinned":
                    pinned[r, core] = True
            elif c.start != "cold":
                raise ValueError(c.start)
            if c.init is not None:
                score[r] = c.init[j]
    # all layers' step counts stacked: [steps, L, E] -> rows repeat per config
    sc = np.stack([step_counts[l] for l in layers], axis=1).astype(np.int64)
    tie = (e - 1) - np.arange(e, dtype=np.int64)
    # transition tables: one prediction per distinct table per step (the routing is the same for
    # every configuration), then each configuration's rows take theirs (zeros: no prior)
    tabs, which = [], []
    for c in configs:
        if c.table is None:
            which.append(-1)
            continue
        k = next((i for i, t in enumerate(tabs) if t is c.table), None)
        if k is None:
            tabs.append(c.table)
            k = len(tabs) - 1
        which.append(k)
    which = np.array(which)
    fk = np.array([c.foresight for c in configs for _ in layers], dtype=np.int64)[:, None]
    if fk.max() > 6:
        raise ValueError("foresight k <= 6 (3 key bits)")
    nxt = None
    if fk.max() > 0:  # steps from t to the next use after t (0: none within the trace)
        nsteps = sc.shape[0]
        nxt = np.zeros((nsteps, nl, e), dtype=np.int64)
        run_ = np.zeros((nl, e), dtype=np.int64)
        for t in range(nsteps - 1, -1, -1):
            nxt[t] = run_
            run_ = np.where(sc[t] > 0, 1, np.where(run_ > 0, run_ + 1, 0))
    tot = np.zeros((b, len(COUNTS) + len(DECODE)), dtype=np.int64)
    start = np.zeros(sc.shape[0], dtype=bool)
    start[trace.request_first_steps()] = True
    for t in range(sc.shape[0]):
        cnt = np.tile(sc[t], (nc, 1))  # [b, E]
        need = cnt > 0
        hit = need & res
        n_need = need.sum(1)
        four = np.stack([cnt.sum(1), np.where(hit, cnt, 0).sum(1), n_need, hit.sum(1)], axis=1)
        tot[:, 0:4] += four
        if not start[t]:
            tot[:, 8:12] += four
        tot[:, 6] += n_need > cap
        score = np.minimum(((score * dn) >> DECAY_SHIFT) + (np.minimum(cnt, icap) << SCORE_FRAC), SCORE_MAX)
        rank = score
        if tabs:  # prior.DLFUMarkov: score + the sum of the routed experts' table rows
            n0 = (sc[t] > 0).astype(np.int64)
            preds = np.stack([np.zeros((nl, e), np.int64)] + [np.einsum("le,lef->lf", n0, tb) for tb in tabs])
            rank = score + preds[which + 1].reshape(b, e)
        forced = (res & need) | pinned
        free = cap - forced.sum(1)
        rest = (res | need) & ~forced
        n_rest = rest.sum(1)
        new = forced | rest
        over = n_rest > np.maximum(free, 0)
        if over.any():
            rows = np.flatnonzero(over)
            key = (rank[rows] << (id_bits + 1)) | (res[rows].astype(np.int64) << id_bits) | tie
            if nxt is not None:  # soonest next use first (within k), then the policy's key
                d = np.tile(nxt[t], (nc, 1))[rows]
                k_ = fk[rows]
                key = key | (np.where((d > 0) & (d <= k_), k_ + 1 - d, 0) << 58)
            key = np.where(admit[rows], key, key | (need[rows].astype(np.int64) << 61))
            key = np.where(rest[rows], key, -1)
            k = np.maximum(free[rows], 0)
            srt = -np.sort(-key, axis=1)
            thr = srt[np.arange(len(rows)), np.maximum(k - 1, 0)]
            keep = rest[rows] & (key >= thr[:, None]) & (k[:, None] > 0)
            new[rows] = forced[rows] | keep
        tot[:, 4] += (new & ~res).sum(1)
        tot[:, 5] += (need & ~res & ~new).sum(1)
        res = new
    tot[:, 7] = sc.shape[0]
    out = []
    for i, c in enumerate(configs):
        s = tot[i * nl : (i + 1) * nl].sum(0)
        d = {k: int(v) for k, v in zip(COUNTS + DECODE, s, strict=True)}
        d["steps"] = int(sc.shape[0]) * nl
        d["layers"] = {l: [int(x) for x in tot[i * nl + j]] for j, l in enumerate(layers)}
        out.append({"name": c.name, **d})
    return out


def add(a: dict, b: dict) -> dict:
    """Sum two results (two traces replayed apart: cold start each); per-layer counts too."""
    out = {k: (a.get(k, 0) + b[k]) for k in b if k not in ("name", "layers")}
    out["name"] = b["name"]
    la = a.get("layers", {})
    out["layers"] = {
        l: [x + y for x, y in zip(la.get(l, [0] * len(v)), v, strict=True)] for l, v in b["layers"].items()
    }
    return out


def rates(d: dict) -> dict:
    return {
        **d,
        "selection_miss": 1 - d["selection_hits"] / d["selections"],
        "expert_miss": 1 - d["expert_hits"] / d["experts"],
        "decode_expert_miss": 1 - d["decode_expert_hits"] / d["decode_experts"]
        if d.get("decode_experts")
        else None,
    }


def _check(args) -> int:
    """Every count of the vectorised replay against simulate (dlfu, dlfu-seeded, core+dlfu,
    dlfu-admit-seeded, with --prior dlfu-markov-seeded) at each decay."""
    from reap_swap.cache.replay import simulate
    from reap_swap.cache.trace import load_trace
    from reap_swap.plan.document import load_plan
    from reap_swap.sizing.cache_tail import layer_slots

    trace = load_trace(args.check)
    plan = load_plan(args.plan)
    core = {l: frozenset(plan.layers[l].core) for l in trace.layers}
    total = len(trace.layers) * trace.num_experts * trace.per_expert_bytes
    bad = 0
    for decay in args.decays:
        rep = simulate(
            trace,
            plan,
            [args.budget],
            ["dlfu", "dlfu-seeded", "core+dlfu", "dlfu-admit-seeded"],
            lfu_decay=decay,
        )
        slots_total = int(float(args.budget) * total) // trace.per_expert_bytes
        slots, _ = layer_slots(slots_total, trace.layers, core, "core+tail", trace.num_experts)
        cfgs = [
            Config("dlfu", decay, slots, core, "cold"),
            Config("dlfu-seeded", decay, slots, core, "seeded"),
            Config("core+dlfu", decay, slots, core, "pinned"),
            Config("dlfu-admit-seeded", decay, slots, core, "seeded", admit=True),
        ]
        rows = rep["rows"]
        if args.prior:  # dlfu-markov-seeded (weight 16) against prior.DLFUMarkov
            from reap_swap.cache.mechanism import LayerSteps
            from reap_swap.cache.prior import transition_table

            prior = load_trace(args.prior)
            st = prior.request_first_steps()
            tab = np.stack(
                [transition_table(LayerSteps.from_counts(l, prior.step_counts(l), st)) for l in trace.layers]
            )
            cfgs.append(Config("dlfu-markov-seeded", decay, slots, core, "seeded", admit=True, table=tab))
            kw = {"lfu_decay": decay, "prior_trace": prior}
            rows = rows + simulate(trace, plan, [args.budget], ["dlfu-markov-seeded"], **kw)["rows"]
        mine = {d["name"]: d for d in replay(trace, cfgs)}
        for row in rows:
            want = row["totals"]
            got = mine[row["policy"]]
            diff = {k: (got[k], want[k]) for k in COUNTS + DECODE if got[k] != want[k]}
            print(f"decay {decay} {row['policy']}: {'EQUAL' if not diff else diff}")
            bad += bool(diff)
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", required=True)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--budget", default="0.5")
    ap.add_argument("--decays", type=float, nargs="+", default=[0.8, 0.95])
    ap.add_argument("--prior", help="calibration trace: also check dlfu-markov-seeded")
    return _check(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
