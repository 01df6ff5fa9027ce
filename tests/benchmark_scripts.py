"""Import a script of ``benchmarks/`` as a module, for tests of the helpers it defines (it is no package)."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py``, executed as a fresh module named ``name``."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
