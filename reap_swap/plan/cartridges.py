"""Cartridges (named active sets) of a plan plus those in cartridges.json beside the plan file.

Pure (no vLLM, no HTTP): the launcher validates them before the engine starts and the controller
loads them; neither needs the other for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import orjson

from reap_swap.plan.active_set import ActiveSetError, normalize_active_set
from reap_swap.plan.document import Plan

CARTRIDGES_FILE = "cartridges.json"


def load_cartridges(plan: Plan, plan_file: str | Path | None) -> dict[str, Mapping[str, list]]:
    """Cartridges of the plan plus those in cartridges.json beside the plan file, validated.

    The file holds {"cartridges": {id: {layer: [ids or sliceIds]}}} (or the inner mapping alone).
    A cartridge id defined in both places is an error rather than a silent choice.
    """
    found: dict[str, Mapping[str, list]] = {
        k: {lk: list(v) for lk, v in sel.items()} for k, sel in plan.cartridges.items()
    }
    if plan_file is not None:
        path = Path(plan_file).resolve().parent / CARTRIDGES_FILE
        if path.is_file():
            found.update(_read_file(path, found))
    for cid, sel in found.items():
        try:
            normalize_active_set(plan, sel)
        except ActiveSetError as exc:
            raise ValueError(f"cartridge {cid!r}: {exc}") from None
    return found


def _read_file(path: Path, known: Mapping[str, object]) -> dict[str, Mapping[str, list]]:
    doc = orjson.loads(path.read_bytes())
    doc = doc.get("cartridges", doc) if isinstance(doc, dict) else doc
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected an object of cartridges")
    for cid, sel in doc.items():
        if cid in known:
            raise ValueError(f"{path}: cartridge {cid!r} is also defined in the plan")
        if not isinstance(sel, dict):
            raise ValueError(f"{path}: cartridge {cid!r} must map layers to expert lists")
    return doc
