"""The failure scenarios of ``examples/scenarios.py`` and their tiny GPT, loaded once for the tests that train them."""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@cache
def scenarios() -> ModuleType:
    spec = importlib.util.spec_from_file_location("scenarios_tests", EXAMPLES / "scenarios.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
