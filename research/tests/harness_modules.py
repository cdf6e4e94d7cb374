"""Import a research harness file (research/gpu/, research/sim/, research/measure/) or a file of
scripts/ as a module (none of them is a package), for research/tests/. Loaded by path, as
tests/script_modules.py loads scripts/."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
DIRS = (*(ROOT / "research" / area for area in ("gpu", "sim", "measure")), ROOT / "scripts")


def load_script(name: str) -> ModuleType:
    """<dir>/<name>.py from the first of DIRS that holds it, freshly executed as module `name`
    (registered in sys.modules first, as an import would, so dataclasses and pickling inside it can
    find their module)."""
    path = next((d / f"{name}.py" for d in DIRS if (d / f"{name}.py").is_file()), None)
    if path is None:
        raise FileNotFoundError(f"{name}.py is in none of {[str(d) for d in DIRS]}")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
