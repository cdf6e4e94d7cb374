"""One stderr handler for the `reap_swap` logger tree, in every process that logs.

Why: vLLM configures only its own `vllm` logger; without this, INFO lines from reap-swap in the
launcher, API and worker processes would be dropped. Level follows VLLM_LOGGING_LEVEL.
"""

from __future__ import annotations

import logging
import os
import sys

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
