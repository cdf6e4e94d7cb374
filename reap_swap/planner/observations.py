"""Observation files on disk <-> the numpy dataclasses the pure planner and evaluator read.

Layout (one ``torch.save`` file, so one SHA-256 names everything a plan was built from):

- Top level, exactly CerebrasResearch/reap's observer layout: ``{layer_idx (int): {field: tensor}}``
  with REAP's names where the meaning is the same: ``total_tokens`` (0-d long),
  ``expert_frequency`` [E] long, ``weighted_expert_frequency_sum`` [E] float64 (summed routed
  gate weight). Our own field ``coactivation`` [E, E] long is the true co-activation (tokens on
  which both experts were routed; diagonal = expert_frequency); REAP's
  ``pairwise_expert_frequency`` is freq[i] + freq[j] and is read but never used as co-activation.
- One extra top-level key, ``"__reap_swap__"`` (a string, never a layer index), holding
  ``{"format", "version", "model", "top_k", "records", "corpus", "skipped",
  "tags": {tag: {layer_idx: {field: tensor}}}, "per_record": {...}}``. ``per_record`` (written by
  ``observe --per-request``) is ``{"layers": long [L], "counts": int [R, L, E], "tags": [str] * R,
  "tokens": long [R], "lines": long [R]}``. REAP's own readers index layers by int, so they read
  our files; a tool that iterates every top-level key must skip non-int keys (or use
  ``observe --reap-layout-only``, which writes no extra key).

REAP files are read as written by its observer (``total_tokens``, ``expert_frequency``,
``pairwise_expert_frequency``, ``ean_sum``, ``weighted_ean_sum``, ``ean_mean``, ``reap``,
``weighted_expert_frequency_sum``, ``max_activations``, and any others, which are ignored).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reap_swap.planner.observation_types import LayerStats, Observations, RecordCounts

META_KEY = "__reap_swap__"
FORMAT = "reap-swap-observations"
VERSION = 1
_TRAILING_INT = re.compile(r"(\d+)\D*$")


class ObservationError(ValueError):
    """An observation file that cannot be read as REAP's layout; the message names file and field."""


def file_digest(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _layer_index(key: Any) -> int | None:
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key != META_KEY:
        m = _TRAILING_INT.search(key)
        return int(m.group(1)) if m else None
    return None


def _array(value: Any, where: str, dtype, ndim: int, experts: int | None = None) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        arr = value.detach().to("cpu").numpy()
    else:
        arr = np.asarray(value)
    if arr.ndim != ndim:
        raise ObservationError(f"{where}: expected {ndim}-d, got shape {tuple(arr.shape)}")
    if experts is not None and any(n != experts for n in arr.shape):
        raise ObservationError(f"{where}: expected {experts} experts, got shape {tuple(arr.shape)}")
    return arr.astype(dtype)


def layer_stats_from_fields(fields: Mapping[str, Any], where: str, raw_key: str) -> LayerStats:
    """One layer's ``{field: tensor}`` (REAP or ours) -> LayerStats."""
    if "expert_frequency" not in fields:
        raise ObservationError(f"{where}: no expert_frequency (fields: {sorted(fields)})")
    freq = _array(fields["expert_frequency"], f"{where}.expert_frequency", np.int64, 1)
    n = freq.shape[0]
    if "total_tokens" not in fields:
        raise ObservationError(f"{where}: no total_tokens (fields: {sorted(fields)})")
    total = int(_array(fields["total_tokens"], f"{where}.total_tokens", np.int64, 0))

    def opt(name: str, dtype, ndim: int) -> np.ndarray | None:
        return _array(fields[name], f"{where}.{name}", dtype, ndim, n) if name in fields else None

    return LayerStats(
        total_tokens=total,
        expert_frequency=freq,
        weighted_frequency=opt("weighted_expert_frequency_sum", np.float64, 1),
        coactivation=opt("coactivation", np.int64, 2),
        reap=opt("reap", np.float64, 1),
        weighted_ean_sum=opt("weighted_ean_sum", np.float64, 1),
        ean_sum=opt("ean_sum", np.float64, 1),
        max_activations=opt("max_activations", np.float64, 1),
        raw_key=raw_key,
    )


def _layers(obj: Mapping, where: str) -> tuple[dict[int, LayerStats], tuple[str, ...]]:
    out: dict[int, LayerStats] = {}
    fields: tuple[str, ...] = ()
    for key, value in obj.items():
        if key == META_KEY:
            continue
        index = _layer_index(key)
        if index is None or not isinstance(value, Mapping):
            raise ObservationError(
                f"{where}: top-level key {key!r} is not a layer index with a dict of fields"
            )
        if index in out:
            raise ObservationError(
                f"{where}: layer {index} appears twice (keys {out[index].raw_key!r}, {key!r})"
            )
        out[index] = layer_stats_from_fields(value, f"{where}[{key!r}]", str(key))
        fields = fields or tuple(sorted(str(k) for k in value))
    if not out:
        raise ObservationError(f"{where}: no layers")
    return dict(sorted(out.items())), fields


def load_observations(path: str | os.PathLike, allow_pickle: bool = False) -> Observations:
    """Read one file (REAP's observer output or ours). ``allow_pickle`` loads with
    ``weights_only=False``: only for files you trust (REAP files with pickled trackers)."""
    path = Path(path)
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=not allow_pickle)
    except Exception as exc:  # torch raises several types for a bad or non-tensor pickle
        hint = "" if allow_pickle else " (if it is a trusted file with pickled objects, allow pickle)"
        raise ObservationError(f"{path}: cannot load with torch.load: {exc}{hint}") from exc
    if not isinstance(obj, Mapping):
        raise ObservationError(
            f"{path}: expected a dict {{layer_idx: {{field: tensor}}}}, got {type(obj).__name__}"
        )
    layers, fields = _layers(obj, str(path))
    meta = obj.get(META_KEY) or {}
    tags: dict[str, dict[int, LayerStats]] = {}
    records = None
    if meta:
        for tag, tag_layers in sorted((meta.get("tags") or {}).items()):
            tags[str(tag)], _ = _layers(tag_layers, f"{path}[{META_KEY!r}].tags[{tag!r}]")
        per = meta.get("per_record")
        if per:
            where = f"{path}[{META_KEY!r}].per_record"
            counts = _array(per["counts"], f"{where}.counts", np.int64, 3)
            records = RecordCounts(
                layers=tuple(int(x) for x in _array(per["layers"], f"{where}.layers", np.int64, 1)),
                counts=counts,
                tags=tuple(str(t) for t in per["tags"]),
                tokens=_array(per["tokens"], f"{where}.tokens", np.int64, 1),
                lines=_array(per["lines"], f"{where}.lines", np.int64, 1),
            )
            if not (
                counts.shape[0] == len(records.tags) == len(records.tokens) == len(records.lines)
                and counts.shape[1] == len(records.layers)
            ):
                raise ObservationError(
                    f"{where}: lengths disagree (counts {counts.shape}, "
                    f"{len(records.tags)} tags, {len(records.layers)} layers)"
                )
    plain_meta = {k: v for k, v in meta.items() if k not in ("tags", "per_record")}
    return Observations(
        label=path.name.removesuffix(".pt"),
        digest=digest,
        layers=layers,
        tags=tags,
        records=records,
        fmt="reap-swap" if meta.get("format") == FORMAT else "reap",
        fields=fields,
        meta=plain_meta,
    )


def load_many(paths: Sequence[str | os.PathLike], allow_pickle: bool = False) -> list[Observations]:
    return [load_observations(p, allow_pickle) for p in paths]


def _fields(stats: LayerStats) -> dict[str, torch.Tensor]:
    out = {
        "total_tokens": torch.tensor(int(stats.total_tokens), dtype=torch.long),
        "expert_frequency": torch.from_numpy(np.asarray(stats.expert_frequency, dtype=np.int64).copy()),
    }
    if stats.weighted_frequency is not None:
        out["weighted_expert_frequency_sum"] = torch.from_numpy(
            np.asarray(stats.weighted_frequency, dtype=np.float64).copy()
        )
    if stats.coactivation is not None:
        out["coactivation"] = torch.from_numpy(np.asarray(stats.coactivation, dtype=np.int64).copy())
    return out


def save_observations(
    path: str | os.PathLike,
    layers: Mapping[int, LayerStats],
    *,
    tags: Mapping[str, Mapping[int, LayerStats]] | None = None,
    records: RecordCounts | None = None,
    meta: Mapping[str, Any] | None = None,
    reap_layout_only: bool = False,
) -> str:
    """Write the file (atomically: temp file + rename); returns its sha256."""
    obj: dict[Any, Any] = {int(i): _fields(s) for i, s in sorted(layers.items())}
    if not reap_layout_only:
        extra: dict[str, Any] = {"format": FORMAT, "version": VERSION, **dict(meta or {})}
        extra["tags"] = {
            t: {int(i): _fields(s) for i, s in sorted(ls.items())} for t, ls in sorted((tags or {}).items())
        }
        if records is not None:
            width = np.int32 if records.counts.size == 0 or records.counts.max() < 2**31 else np.int64
            extra["per_record"] = {
                "layers": torch.tensor(list(records.layers), dtype=torch.long),
                "counts": torch.from_numpy(np.ascontiguousarray(records.counts, dtype=width)),
                "tags": list(records.tags),
                "tokens": torch.from_numpy(np.asarray(records.tokens, dtype=np.int64).copy()),
                "lines": torch.from_numpy(np.asarray(records.lines, dtype=np.int64).copy()),
            }
        obj[META_KEY] = extra
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)
    return file_digest(path)
