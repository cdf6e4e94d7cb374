"""The planner's inputs: several observation files merged into one view, checked against the model.

Counts add over disjoint token sets, so files observed on different corpora combine; a file
given twice would be counted twice and is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from reap_swap.planner.config import PlannerError
from reap_swap.planner.observation_types import LayerStats, Observations
from reap_swap.sizing.model_shape import ModelShape


@dataclass(frozen=True)
class PlannerInputs:
    """All files' statistics merged per layer and per corpus tag, and each file's unique label."""

    observations: Sequence[Observations]
    layers: Mapping[int, LayerStats]
    labels: list[str]
    tag_names: list[str]
    tags: Mapping[str, Mapping[int, LayerStats]]

    def layer_tags(self, index: int) -> dict[str, LayerStats]:
        """One layer's statistics per corpus tag (tags whose files cover the layer)."""
        return {t: self.tags[t][index] for t in self.tag_names if index in self.tags[t]}

    def sources(self, index: int) -> list[tuple[str, LayerStats]]:
        """One layer's statistics per input file, by label."""
        return [(label, o.layers[index]) for label, o in zip(self.labels, self.observations)]


def merge_inputs(observations: Sequence[Observations], shape: ModelShape) -> PlannerInputs:
    """Merge the files; refuses none, a repeated file, and layers or widths that are not the model's."""
    if not observations:
        raise PlannerError("no observation files given")
    digests = [o.digest for o in observations]
    if len(set(digests)) != len(digests):
        raise PlannerError(
            "the same observation file is given twice (equal sha256): it would be counted twice"
        )
    layers = merge_layers([o.layers for o in observations])
    check_shape(layers, shape)
    tag_names = sorted({t for o in observations for t in o.tags})
    tags = {t: merge_layers([o.tags[t] for o in observations if t in o.tags]) for t in tag_names}
    return PlannerInputs(
        observations, layers, unique_labels([o.label for o in observations]), tag_names, tags
    )


def merge_layer_stats(parts: Sequence[LayerStats]) -> LayerStats:
    """Sum counts over disjoint token sets; REAP's per-routed-token mean is re-weighted by
    frequency; max stays max. A field survives only if every part has it (a partial sum would
    be biased)."""
    first = parts[0]
    sizes = {p.num_experts for p in parts}
    if len(sizes) != 1:
        raise PlannerError(f"layer {first.raw_key!r}: expert counts differ between files: {sorted(sizes)}")

    def total(name: str) -> np.ndarray | None:
        values = [getattr(p, name) for p in parts]
        return None if any(v is None for v in values) else np.sum(values, axis=0)

    freq = np.sum([p.expert_frequency for p in parts], axis=0).astype(np.int64)
    reap = None
    if all(p.reap is not None for p in parts):
        weighted = np.sum([p.reap * p.expert_frequency for p in parts], axis=0)
        reap = np.divide(weighted, freq, out=np.zeros_like(weighted, dtype=np.float64), where=freq > 0)
    max_act = None
    if all(p.max_activations is not None for p in parts):
        max_act = np.max([p.max_activations for p in parts], axis=0)
    return LayerStats(
        total_tokens=sum(p.total_tokens for p in parts),
        expert_frequency=freq,
        weighted_frequency=total("weighted_frequency"),
        coactivation=total("coactivation"),
        reap=reap,
        weighted_ean_sum=total("weighted_ean_sum"),
        ean_sum=total("ean_sum"),
        max_activations=max_act,
        raw_key=first.raw_key,
    )


def merge_layers(maps: Sequence[Mapping[int, LayerStats]]) -> dict[int, LayerStats]:
    """Per layer merge of several files' layer maps; every file must have the same layers."""
    keys = [frozenset(m) for m in maps]
    if len(set(keys)) > 1:
        raise PlannerError(
            "observation files cover different layers: " + "; ".join(str(sorted(k)) for k in keys)
        )
    return {i: merge_layer_stats([m[i] for m in maps]) for i in sorted(keys[0])} if maps else {}


def check_shape(layers: Mapping[int, LayerStats], shape: ModelShape) -> None:
    missing = sorted(set(shape.moe_layers) - set(layers))
    extra = sorted(set(layers) - set(shape.moe_layers))
    if missing or extra:
        raise PlannerError(
            f"observations cover layers {sorted(layers)}, model {shape.architecture} has "
            f"MoE layers {list(shape.moe_layers)}"
            + (f"; missing {missing}" if missing else "")
            + (f"; not MoE: {extra}" if extra else "")
        )
    for i, s in layers.items():
        if s.num_experts != shape.num_experts:
            raise PlannerError(
                f"layer {i}: observations have {s.num_experts} experts, model has {shape.num_experts}"
            )


def unique_labels(labels: Sequence[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        n = seen.get(label, 0)
        seen[label] = n + 1
        out.append(label if n == 0 else f"{label}#{n + 1}")
    return out


def input_artifact(label: str, o: Observations) -> dict:
    first = o.layers[min(o.layers)]
    return {
        "label": label,
        "sha256": o.digest,
        "format": o.fmt,
        "fields": list(o.fields),
        "layers": len(o.layers),
        "totalTokens": int(first.total_tokens),
        "tags": sorted(o.tags),
        "records": o.records.counts.shape[0] if o.records is not None else 0,
    }
