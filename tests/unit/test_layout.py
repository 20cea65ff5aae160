"""The package's rooms: the top level holds what a user imports, the core (API, engine, methods, adapters,
compat) imports no plotting, benchmark or evaluation code, and no two modules share a name unless one is
the other's command-line front end."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "priortr"
ROOMS = {
    "__init__.py",
    "api.py",
    "adapters",
    "engine",
    "methods",
    "compat",
    "cli",
    "testbed",
    "tools",
    "integrations",
}
CORE = ("__init__.py", "api.py", "adapters", "engine", "methods", "compat")
# plotting, benchmarks, evaluation, front ends: every tool but the API's config files (tools.config_file)
TOOLS = sorted(
    path.stem for path in (PACKAGE / "tools").glob("*.py") if path.stem not in ("__init__", "config_file")
)
FORBIDDEN = (
    "matplotlib",
    "lmms_eval",
    "vllm",
    "priortr.cli",
    "priortr.integrations",
    "priortr.testbed",
    "priortr.tools.configs",
    *(f"priortr.tools.{name}" for name in TOOLS),
)


def _modules(room: str) -> list[Path]:
    path = PACKAGE / room
    return [path] if path.is_file() else sorted(path.rglob("*.py"))


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _forbidden(name: str) -> bool:
    return any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN)


def test_the_top_level_holds_the_rooms():
    entries = {path.name for path in PACKAGE.iterdir() if path.name != "__pycache__"}
    assert entries == ROOMS


def test_the_core_imports_no_tool_or_integration():
    found = {
        f"{path.relative_to(PACKAGE)}: {name}"
        for room in CORE
        for path in _modules(room)
        for name in _imports(path)
        if _forbidden(name)
    }
    assert not found


def test_the_negative_control_finds_a_forbidden_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from priortr.tools import viz\n    import matplotlib.pyplot\n")
    assert {name for name in _imports(module) if _forbidden(name)} == {
        "priortr.tools.viz",
        "matplotlib.pyplot",
    }


def test_pruning_a_model_loads_no_tool():
    """At run time too: applying a method loads no plotting, benchmark or evaluation module."""
    script = (
        "import sys, priortr; priortr.apply; priortr.PruneResult; import priortr.engine.hooks; "
        "print(' '.join(sorted(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = done.stdout.split()
    assert "priortr.engine.hooks" in loaded
    assert not [name for name in loaded if _forbidden(name)]


def test_no_two_modules_share_a_name_unless_one_is_the_front_end():
    """``cli/<command>.py`` is the front end of ``tools/<command>.py`` or ``testbed/<command>.py``."""
    by_name: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            by_name.setdefault(path.stem, []).append(str(path.parent.relative_to(PACKAGE)))
    clashes = {}
    for name, rooms in by_name.items():
        others = sorted(room for room in rooms if room != "cli")
        if len(others) > 1 or (len(others) == 1 and len(rooms) > 1 and others[0] not in ("tools", "testbed")):
            clashes[name] = sorted(rooms)
    assert not clashes
