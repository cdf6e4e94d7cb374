"""Import a file of scripts/ as a module (scripts/ is not a package), for the tests that use one.

`load_research` does the same for a research harness file (research/gpu/, research/sim/,
research/measure/) that a product test uses to build its inputs (a model folder, a plan); the
harness's own tests live in research/tests/."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
RESEARCH = tuple(ROOT / "research" / area for area in ("gpu", "sim", "measure"))


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py, freshly executed as module `name` (registered in sys.modules first, as
    an import would, so dataclasses and pickling inside it can find their module)."""
    return _load(name, SCRIPTS / f"{name}.py")


def load_research(name: str) -> ModuleType:
    """research/<area>/<name>.py, loaded as load_script loads a script."""
    found = [d / f"{name}.py" for d in RESEARCH if (d / f"{name}.py").is_file()]
    if len(found) != 1:
        raise FileNotFoundError(f"{name}.py: {len(found)} matches under {[str(d) for d in RESEARCH]}")
    return _load(name, found[0])
