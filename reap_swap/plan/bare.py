"""The plan a server makes for itself when it is started without one: every MoE layer, no core, no
slices, a pool of ``NO_PLAN_POOL_FRACTION`` of the experts' bytes unless ``--reap-budget GIB`` says.

Why a plan document and not a special case in every consumer: the workers, the controller, the
pool and the device cache all read one validated :class:`Plan`; a bare plan is an ordinary one
(checked against the model's shape like any other) with ``bare: true``, which only widens what a
swap may name by id (every expert) and turns slice and cartridge requests into "a plan is needed".
With no core the device cache starts empty and learns every layer's set from the routing.

Why a fixed fraction and not ``--reap-budget auto``: the device cache's slot tables are captured
in CUDA graphs, so its pool must be sized before the engine starts, while ``auto`` measures and
grows after; with ``--reap-budget auto`` the server keeps the static path, as it does with a plan.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from reap_swap.plan.model import MODE, canonical_json
from reap_swap.sizing.model_shape import ModelShape

# The operating point the project's measurements use (half the expert bytes in HBM).
NO_PLAN_POOL_FRACTION = 0.5

NO_PLAN_HINT = "this server was started without a plan; start it with --reap-plan PLAN"


def bare_pool_bytes(shape: ModelShape, budget: str | float) -> int:
    """The pool of a server without a plan: ``--reap-budget GIB`` (at most every expert), else
    ``NO_PLAN_POOL_FRACTION`` of the experts, in whole experts per layer."""
    per_layer = shape.num_experts
    if isinstance(budget, float):
        slots = int(budget * 2**30) // max(shape.expert_bytes, 1)
    else:
        slots = int(per_layer * NO_PLAN_POOL_FRACTION) * len(shape.moe_layers)
    return min(slots, per_layer * len(shape.moe_layers)) * shape.expert_bytes


def bare_plan_document(shape: ModelShape, model: str, pool_bytes: int) -> dict:
    """A valid plan document for ``shape`` with no core and no slices (``bare: true``)."""
    return {
        "mode": MODE,
        "bare": True,
        "model": model,
        "budget": {"per_expert_bytes": shape.expert_bytes, "swappable_expert_budget_bytes": int(pool_bytes)},
        "perLayer": {
            f"layer_{i}": {"numExperts": shape.num_experts, "coreExperts": []} for i in shape.moe_layers
        },
    }


def write_bare_plan(doc: dict, directory: str | os.PathLike) -> Path:
    """Write ``doc`` where the workers can read it, named by its content (the same model and pool
    give the same file, so restarts do not pile up files)."""
    data = canonical_json(doc)
    path = Path(directory) / f"reap-swap-no-plan-{hashlib.sha256(data).hexdigest()[:16]}.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)  # atomic: a second server starting at once never reads half a file
    return path
