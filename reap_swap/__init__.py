"""reap-swap: workload-aware MoE expert residency for vLLM.

Packages, pure core first (they import neither torch nor vLLM nor the shells; .importlinter):
plan (the plan document), planner (observations -> plan), sizing (shapes, memory split, quant
layouts), cache (policies, slots, traces, simulation), client (per-prompt selection), config (the
settings); then the shells: engine (in vLLM's workers), server (launcher, routes, controller),
bench, cli; compat holds every vLLM-specific import.

``get_logger``: one stderr handler for the ``reap_swap`` logger tree, in every process that logs.
vLLM configures only its own ``vllm`` logger; without this, INFO lines from reap-swap in the
launcher, API and worker processes would be dropped. Level follows VLLM_LOGGING_LEVEL.
"""

from __future__ import annotations

import logging
import os
import sys

__version__ = "0.1.0"

_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"


def get_logger(name: str) -> logging.Logger:
    root = logging.getLogger("reap_swap")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, "%m-%d %H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
        root.propagate = False
    return logging.getLogger(name)
