"""Where the served plan comes from: the operator's file, validated against the model's config
before any engine process exists, or, without one, a bare plan written for the model
(plan/bare.py)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from reap_swap.config.settings import Settings
from reap_swap.server.host_checks import LaunchError


def model_config_source(args: argparse.Namespace) -> str | Path:
    """Local path of the served model's config.json (downloads only config.json for hub ids)."""
    candidate = getattr(args, "hf_config_path", None) or args.model
    path = Path(candidate).expanduser()
    if path.is_dir() or path.is_file():
        return path
    try:
        from huggingface_hub import hf_hub_download

        return hf_hub_download(
            repo_id=str(candidate), filename="config.json", revision=getattr(args, "revision", None)
        )
    except Exception as exc:  # noqa: BLE001 - any failure: we cannot validate the plan
        raise LaunchError(
            f"cannot read the config of model {candidate!r} to validate the plan: {type(exc).__name__}: {exc}"
        ) from None


def read_shape(args: argparse.Namespace):
    """The served model's shape from its config.json; LaunchError naming the model if unreadable."""
    from reap_swap.sizing.model_shape import ModelShapeError, read_model_shape

    try:
        return read_model_shape(model_config_source(args))
    except ModelShapeError as exc:
        raise LaunchError(f"model {args.model}: {exc}") from None


def with_plan(settings: Settings, args: argparse.Namespace, shape) -> Settings:
    """``settings`` with the plan file the workers read: the operator's, else a bare plan written
    for this model (plan/bare.py: no core, no slices, the pool from --reap-budget GIB or a fixed
    share). A bare plan's pool already has the GiB asked for, so it is served as the plan's pool,
    where the device cache runs (a GiB budget means "grow to it" only on top of an operator's plan)."""
    if settings.plan_file is not None:
        return settings.model_copy(update={"plan_file": settings.plan_file.resolve()})
    from reap_swap.plan.bare import bare_plan_document, bare_pool_bytes, write_bare_plan

    budget = settings.budget.request()
    doc = bare_plan_document(shape, str(args.model), bare_pool_bytes(shape, budget))
    settings = settings.model_copy(update={"plan_file": write_bare_plan(doc, tempfile.gettempdir())})
    return settings.updated(budget="plan") if isinstance(budget, float) else settings


def load_validated_plan(settings: Settings, args: argparse.Namespace, shape=None):
    """(model shape, plan checked against it, the plan's cartridges); LaunchError if not valid.
    ``shape``: the model's, when the caller has read it already."""
    from reap_swap.plan.cartridges import load_cartridges
    from reap_swap.plan.document import PlanError, load_plan

    plan_file = settings.plan_file
    if shape is None:
        shape = read_shape(args)
    try:
        plan = load_plan(str(plan_file), shape)
    except PlanError as exc:
        raise LaunchError(
            f"invalid plan {plan_file} for model {args.model}:\n{exc.report.format_text()}"
        ) from None
    try:
        cartridges = load_cartridges(plan, plan_file)
    except (ValueError, OSError) as exc:
        raise LaunchError(f"invalid cartridges for plan {plan_file}: {exc}") from None
    return shape, plan, cartridges
