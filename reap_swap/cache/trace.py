"""Routing traces: every token's routed experts per MoE layer, per request, in step order.

Pure (numpy + orjson). A trace is what ``reap-swap simulate`` replays to count a device cache's
hits, misses and bytes moved, deterministically and without a GPU.

Step order: requests run one at a time; a request's first step is its prefill (all prompt
tokens at once), every later step is one decode token. A request with P prompt tokens and D
generated tokens has 1 + (D - 1) steps and P + D - 1 routed tokens (the last sampled token is
never fed back through the model).

File: one ``.npz`` (``numpy.savez_compressed``, loaded with ``allow_pickle=False``):

- ``topk_ids``        uint8 (num_experts <= 256) or uint16, shape [tokens, layers, top_k]: the
                      routed expert ids of every token, in step order. The k axis is the order the
                      recorder got them in (not necessarily the router's rank).
- ``step_offsets``    int64 [steps + 1]: step s is tokens ``step_offsets[s]:step_offsets[s+1]``.
- ``request_offsets`` int64 [requests + 1]: request r is steps ``request_offsets[r]:...[r+1]``.
- ``layers``          int64 [layers]: the MoE layer index (the N of ``layer_N``) of each column.
- ``meta``            uint8: UTF-8 JSON object with ``version``, ``model``, ``num_experts``,
                      ``top_k``, ``per_expert_bytes``, ``request_tags`` (one string per request,
                      may be empty), and free-form ``source`` (how it was recorded).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

TRACE_VERSION = 1
_ARRAYS = ("topk_ids", "step_offsets", "request_offsets", "layers", "meta")


class TraceError(ValueError):
    """A trace file or object that is not a valid trace; the message names the field."""


@dataclass(frozen=True, eq=False)
class Trace:
    """One trace in memory (see the module docstring for the fields)."""

    topk_ids: np.ndarray
    step_offsets: np.ndarray
    request_offsets: np.ndarray
    layers: tuple[int, ...]
    model: str
    num_experts: int
    top_k: int
    per_expert_bytes: int
    request_tags: tuple[str, ...]
    source: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate(self)

    @property
    def num_tokens(self) -> int:
        return int(self.topk_ids.shape[0])

    @property
    def num_steps(self) -> int:
        return len(self.step_offsets) - 1

    @property
    def num_requests(self) -> int:
        return len(self.request_offsets) - 1

    def request_first_steps(self) -> np.ndarray:
        """The prefill step index of every request."""
        return self.request_offsets[:-1].copy()

    def step_counts(self, layer: int) -> np.ndarray:
        """[steps, num_experts] int32: routed selections of each expert in each step of ``layer``
        (a MoE layer index, not a column)."""
        if layer not in self.layers:
            raise TraceError(f"layers: {layer} is not in the trace (layers {list(self.layers)})")
        col = self.layers.index(layer)
        ids = self.topk_ids[:, col, :].astype(np.int64)
        step_of_token = np.repeat(np.arange(self.num_steps), np.diff(self.step_offsets))
        out = np.zeros((self.num_steps, self.num_experts), dtype=np.int32)
        np.add.at(out, (np.repeat(step_of_token, self.top_k), ids.ravel()), 1)
        return out

    def meta(self) -> dict[str, Any]:
        return {
            "version": TRACE_VERSION,
            "model": self.model,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "per_expert_bytes": self.per_expert_bytes,
            "request_tags": list(self.request_tags),
            "source": dict(self.source),
        }


def _fail(where: str, message: str) -> None:
    raise TraceError(f"{where}: {message}")


def _check_offsets(name: str, offsets: np.ndarray, end: int, what: str) -> None:
    if offsets.ndim != 1 or len(offsets) < 2:
        _fail(name, f"needs at least 2 entries (got shape {offsets.shape})")
    if not np.issubdtype(offsets.dtype, np.integer):
        _fail(name, f"must be integers (got {offsets.dtype})")
    if offsets[0] != 0 or offsets[-1] != end:
        _fail(name, f"must run from 0 to {end} {what} (got {int(offsets[0])} .. {int(offsets[-1])})")
    empty = np.flatnonzero(np.diff(offsets) <= 0)
    if len(empty):
        _fail(name, f"entry {int(empty[0])} is empty or decreasing: every one needs at least 1 of {what}")


def validate(t: Trace) -> None:
    """Raise TraceError naming the first bad field."""
    if t.num_experts < 1 or t.top_k < 1 or t.top_k > t.num_experts:
        _fail("meta", f"need 1 <= top_k ({t.top_k}) <= num_experts ({t.num_experts})")
    if t.per_expert_bytes < 1:
        _fail("meta.per_expert_bytes", f"must be positive (got {t.per_expert_bytes})")
    ids = t.topk_ids
    if ids.ndim != 3 or ids.shape[1:] != (len(t.layers), t.top_k):
        _fail("topk_ids", f"shape {ids.shape}, expected [tokens, {len(t.layers)} layers, top_k {t.top_k}]")
    if ids.dtype not in (np.uint8, np.uint16):
        _fail("topk_ids", f"dtype {ids.dtype}, expected uint8 or uint16")
    if ids.size and int(ids.max()) >= t.num_experts:
        _fail("topk_ids", f"expert id {int(ids.max())} >= num_experts {t.num_experts}")
    if t.top_k > 1 and ids.size:
        s = np.sort(ids, axis=2)
        dup = np.argwhere(s[:, :, 1:] == s[:, :, :-1])
        if len(dup):
            tok, col = int(dup[0][0]), int(dup[0][1])
            _fail("topk_ids", f"token {tok} layer {t.layers[col]} routes one expert twice")
    if len(set(t.layers)) != len(t.layers) or any(i < 0 for i in t.layers):
        _fail("layers", f"must be distinct non-negative layer indices (got {list(t.layers)})")
    _check_offsets("step_offsets", t.step_offsets, ids.shape[0], "tokens")
    _check_offsets("request_offsets", t.request_offsets, len(t.step_offsets) - 1, "steps")
    if len(t.request_tags) != len(t.request_offsets) - 1:
        _fail("meta.request_tags", f"{len(t.request_tags)} tags for {len(t.request_offsets) - 1} requests")


def id_dtype(num_experts: int) -> type:
    return np.uint8 if num_experts <= 256 else np.uint16


def from_requests(
    requests: Sequence[Sequence[np.ndarray]],
    *,
    layers: Sequence[int],
    model: str,
    num_experts: int,
    top_k: int,
    per_expert_bytes: int,
    request_tags: Sequence[str] | None = None,
    source: Mapping[str, Any] | None = None,
) -> Trace:
    """Build a trace from ``requests[r][s]`` = int array [tokens of step s, layers, top_k]."""
    steps = [np.asarray(s) for r in requests for s in r]
    if not steps:
        raise TraceError("requests: a trace needs at least one request with one step")
    dtype = id_dtype(num_experts)
    bad = [i for i, s in enumerate(steps) if s.size and (s.min() < 0 or s.max() >= num_experts)]
    if bad:
        raise TraceError(f"topk_ids: step {bad[0]} has an expert id outside [0, {num_experts})")
    tokens = np.concatenate([s.reshape(-1, len(layers), top_k) for s in steps]).astype(dtype)
    step_offsets = np.concatenate([[0], np.cumsum([len(s) for s in steps])]).astype(np.int64)
    request_offsets = np.concatenate([[0], np.cumsum([len(r) for r in requests])]).astype(np.int64)
    return Trace(
        topk_ids=tokens,
        step_offsets=step_offsets,
        request_offsets=request_offsets,
        layers=tuple(int(i) for i in layers),
        model=model,
        num_experts=int(num_experts),
        top_k=int(top_k),
        per_expert_bytes=int(per_expert_bytes),
        request_tags=tuple(request_tags) if request_tags is not None else ("",) * len(requests),
        source=dict(source or {}),
    )


def steps_of_sequence(routed: np.ndarray, prompt_tokens: int) -> list[np.ndarray]:
    """One request's routing in sequence order -> its steps: the prompt as one prefill step, then
    one step per later token. ``routed``: [tokens, layers, top_k], e.g. vLLM's per-request
    ``routed_experts`` output with ``--enable-return-routed-experts`` (prompt + generated - 1
    tokens; with prefix caching on it also lists cached prompt tokens, which the server did not
    route in that request -- give every prompt a unique first block, as research/gpu/gpu_e2e.py does)."""
    routed = np.asarray(routed)
    if routed.ndim != 3:
        raise TraceError(f"routed: shape {routed.shape}, expected [tokens, layers, top_k]")
    if not 1 <= prompt_tokens <= len(routed):
        raise TraceError(f"prompt_tokens: {prompt_tokens} outside [1, {len(routed)}] routed tokens")
    return [routed[:prompt_tokens]] + [routed[i : i + 1] for i in range(prompt_tokens, len(routed))]


def save_trace(path: str | os.PathLike, trace: Trace) -> None:
    """Write the .npz (compressed); the same trace gives the same arrays."""
    meta = np.frombuffer(orjson.dumps(trace.meta(), option=orjson.OPT_SORT_KEYS), dtype=np.uint8)
    with open(path, "wb") as f:
        np.savez_compressed(
            f,
            topk_ids=trace.topk_ids,
            step_offsets=trace.step_offsets,
            request_offsets=trace.request_offsets,
            layers=np.asarray(trace.layers, dtype=np.int64),
            meta=meta,
        )


def _read_meta(raw: np.ndarray) -> dict[str, Any]:
    try:
        meta = orjson.loads(raw.tobytes())
    except orjson.JSONDecodeError as exc:
        raise TraceError(f"meta: not valid JSON ({exc})") from exc
    if not isinstance(meta, dict):
        raise TraceError("meta: must be a JSON object")
    if meta.get("version") != TRACE_VERSION:
        raise TraceError(f"meta.version: {meta.get('version')!r}, this reader knows version {TRACE_VERSION}")
    for key in ("model", "num_experts", "top_k", "per_expert_bytes", "request_tags"):
        if key not in meta:
            raise TraceError(f"meta.{key}: missing")
    return meta


def load_trace(path: str | os.PathLike) -> Trace:
    """Read and validate a trace; TraceError names the file and the bad field."""
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in _ARRAYS if k not in z.files]
            if missing:
                raise TraceError(f"missing arrays {missing} (has {sorted(z.files)})")
            arrays = {k: z[k] for k in _ARRAYS}
    except TraceError as exc:
        raise TraceError(f"{path}: {exc}") from None
    except (OSError, ValueError) as exc:
        raise TraceError(f"{path}: not a readable .npz trace ({exc})") from exc
    try:
        meta = _read_meta(arrays["meta"])
        return Trace(
            topk_ids=arrays["topk_ids"],
            step_offsets=arrays["step_offsets"],
            request_offsets=arrays["request_offsets"],
            layers=tuple(int(i) for i in arrays["layers"]),
            model=str(meta["model"]),
            num_experts=int(meta["num_experts"]),
            top_k=int(meta["top_k"]),
            per_expert_bytes=int(meta["per_expert_bytes"]),
            request_tags=tuple(str(t) for t in meta["request_tags"]),
            source=meta.get("source") or {},
        )
    except TraceError as exc:
        raise TraceError(f"{path}: {exc}") from None
