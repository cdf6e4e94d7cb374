"""Helpers for `gpu_quant_e2e.py --reap-group-size` (grouped units, issue 16 Padding).

- `shuffle_plan(path, seed)`: rewrite gpu_e2e.make_plan's plan so its slices are seeded random
  ids (routing does not make hot experts adjacent ids). The plan's physical order then differs
  from the id order, so the e2e's swap sets (ids 0..k-1) are scattered in physical order: groups
  carry passengers and the logical -> physical remap is really exercised.
- `GroupExpect`: the bytes a grouped swap must copy, from the plan's own permutation
  (`group_layout.plan_permutations`) and the server's reported layout (/reap/status
  `workers[0].engine.layouts`): admitted groups x group payload, per layer; a layer reported
  `permuted: false` (INT4 identity order, research.md int4perm) is counted in identity order.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from reap_swap.plan.document import load_plan
from reap_swap.sizing.groups import Permutation, groups_for, plan_permutations


def shuffle_plan(path: Path, seed: int = 0) -> None:
    plan = json.loads(path.read_text())
    rng = random.Random(seed)
    for entry in plan["perLayer"].values():
        core = set(entry["coreExperts"])
        rest = [e for e in range(entry["numExperts"]) if e not in core]
        rng.shuffle(rest)
        at = 0
        for s in entry["sliceCatalog"]:
            n = len(s["experts"])
            s["experts"], at = rest[at : at + n], at + n
    path.write_text(json.dumps(plan))


class GroupExpect:
    """Expected bytes of grouped swaps; `layouts`: /reap/status engine `layouts` (str layer keys)."""

    def __init__(self, plan_path: Path, layouts: dict) -> None:
        self.perms = plan_permutations(load_plan(str(plan_path)))
        self.layouts = {int(k): v for k, v in (layouts or {}).items() if v.get("layout") == "grouped"}
        self.resident: dict[int, frozenset[int]] = {}  # layer -> groups

    @property
    def active(self) -> bool:
        return bool(self.layouts)

    def swap(self, wanted: dict) -> dict:
        """wanted: gpu_e2e's active set ({"layer_3": [ids]}); returns expected groups and bytes."""
        admitted, nbytes, new = 0, 0, {}
        for key, ids in wanted.items():
            layer = int(key.split("_")[1])
            lay = self.layouts.get(layer)
            if lay is None:
                continue
            perm = self.perms[layer]
            if not lay.get("permuted", True):  # identity-order INT4 groups (research.md int4perm)
                perm = Permutation.identity(perm.num_experts)
            groups = groups_for(ids, perm, int(lay["group_size"]))
            fresh = groups - self.resident.get(layer, frozenset())
            admitted += len(fresh)
            nbytes += len(fresh) * int(lay["group_payload_bytes"])
            new[layer] = groups
        self.resident = new
        return {"admitted_groups": admitted, "expected_bytes": nbytes}
