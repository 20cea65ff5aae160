"""The package's rooms: the top level holds what a user imports, the core (API, engine, methods, adapters,
compat, tensors) imports no plotting, benchmark or evaluation code, the rooms stand on each other in one
order with no import pointing up it and no import cycle, and no two modules share a name unless one is
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
    "config_file.py",
    "adapters",
    "engine",
    "methods",
    "compat",
    "tensors",
    "cli",
    "testbed",
    "tools",
    "frontend",
    "integrations",
}
CORE = ("__init__.py", "api.py", "config_file.py", "adapters", "engine", "methods", "compat", "tensors")
FORBIDDEN = (
    "matplotlib",
    "lmms_eval",
    "vllm",
    "priortr.cli",
    "priortr.integrations",
    "priortr.testbed",
    "priortr.tools",
    "priortr.frontend",
)
FLOORS = {
    "tensors": 0,
    "compat": 1,
    "methods": 2,
    "adapters": 3,
    "engine": 4,
    "config_file": 5,
    "api": 6,
    "__init__": 7,
    "frontend": 8,
    "tools": 9,
    "integrations": 10,
    "testbed": 11,
    "cli": 12,
}
"""Each room's floor, one room a floor: a module imports from its own room and the floors below it, never
from one above, so between any two rooms at most one may import the other."""
ENGINE_DOORS = frozenset({"priortr.engine.front_door", "priortr.engine.config"})
"""The engine modules ``integrations/`` may import: the front door, and ``PruningConfig``'s module (the
checked settings every front end shares); never the engine's internals (its plan, stage, state,
evidence, attention...)."""


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


def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph(package: Path) -> dict[str, set[str]]:
    """Every module of ``package`` and the modules of ``package`` it imports: ``from a import b`` imports
    ``a.b`` when that is a module, else ``a``; a name that is no module counts as the module holding it."""
    modules = {_module_name(path, package): path for path in package.rglob("*.py")}

    def owner(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {owner(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                edges |= {owner(f"{node.module}.{alias.name}") for alias in node.names}
        graph[name] = {imported for imported in edges if imported and imported != name}
    return graph


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _upward(graph: dict[str, set[str]]) -> set[str]:
    """``importer -> imported`` for every import from a room on a higher floor."""
    return {
        f"{module} -> {imported}"
        for module, edges in graph.items()
        for imported in edges
        if FLOORS[_room(imported)] > FLOORS[_room(module)]
    }


def _past_the_door(graph: dict[str, set[str]]) -> set[str]:
    """``importer -> imported`` for every import of an engine module other than ``ENGINE_DOORS`` from
    ``integrations/``."""
    return {
        f"{module} -> {imported}"
        for module, edges in graph.items()
        if _room(module) == "integrations"
        for imported in edges
        if _room(imported) == "engine" and imported not in ENGINE_DOORS
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph`` (one path per cycle found by a depth-first walk)."""
    state: dict[str, int] = {}  # 1: on the walk's path, 2: done
    path: list[str] = []
    found = []

    def walk(module: str) -> None:
        state[module] = 1
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == 1:
                found.append([*path[path.index(imported) :], imported])
            elif imported not in state:
                walk(imported)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module)
    return found


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
        "priortr.tools",
        "priortr.tools.viz",
        "matplotlib.pyplot",
    }


def test_no_import_points_up_the_floors():
    """tensors <- compat <- methods <- adapters <- engine <- config_file <- api <- __init__ <- frontend
    <- tools <- integrations <- testbed <- cli."""
    graph = _graph(PACKAGE)
    assert {_room(module) for module in graph} <= set(FLOORS)
    assert not _upward(graph)


def test_every_room_has_a_floor_of_its_own():
    assert len(set(FLOORS.values())) == len(FLOORS)


def test_the_negative_control_finds_an_upward_import_between_the_front_rooms(tmp_path):
    """The arrow that once stood here: ``frontend`` reading ``tools`` while ``tools`` reads ``frontend``."""
    package = tmp_path / "priortr"
    for room in ("frontend", "tools"):
        (package / room).mkdir(parents=True)
        (package / room / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    planted = "def f():\n    from priortr.tools.configs import SOURCES\n"
    (package / "frontend" / "loading.py").write_text(planted)
    (package / "tools" / "configs.py").write_text("SOURCES = {}\n")
    (package / "tools" / "bench.py").write_text("from priortr.frontend import loading\n")
    assert _upward(_graph(package)) == {"priortr.frontend.loading -> priortr.tools.configs"}


def test_no_import_cycle():
    assert not _cycles(_graph(PACKAGE))


def test_the_negative_controls_find_an_upward_import_and_a_cycle(tmp_path):
    package = tmp_path / "priortr"
    for room in ("tensors", "compat", "engine"):
        (package / room).mkdir(parents=True)
        (package / room / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "tensors" / "rope.py").write_text("def f():\n    from priortr.engine.stage import g\n")
    (package / "engine" / "stage.py").write_text("from priortr.engine import plan\n")
    (package / "engine" / "plan.py").write_text(
        "from priortr.engine.stage import g\nfrom priortr import compat\n"
    )
    graph = _graph(package)
    assert _upward(graph) == {"priortr.tensors.rope -> priortr.engine.stage"}
    assert _cycles(graph) == [["priortr.engine.plan", "priortr.engine.stage", "priortr.engine.plan"]]
    assert "priortr.compat" in graph["priortr.engine.plan"]


def test_integrations_reach_the_engine_through_its_front_door():
    """``integrations/`` (the vLLM plug-in runs the layers itself) reach the engine through
    ``engine/front_door.py`` and the config type only."""
    graph = _graph(PACKAGE)
    assert any(_room(module) == "integrations" and ENGINE_DOORS & edges for module, edges in graph.items())
    assert not _past_the_door(graph)


def test_the_negative_control_finds_an_integration_past_the_front_door(tmp_path):
    package = tmp_path / "priortr"
    (package / "engine").mkdir(parents=True)
    (package / "integrations" / "vllm").mkdir(parents=True)
    for path in (
        "__init__.py",
        "engine/__init__.py",
        "integrations/__init__.py",
        "integrations/vllm/__init__.py",
    ):
        (package / path).write_text("")
    internals = ("attention", "evidence", "plan", "stage", "state")
    for name in (*internals, "front_door", "config"):
        (package / "engine" / f"{name}.py").write_text("")
    (package / "integrations" / "vllm" / "step.py").write_text(
        "from priortr.engine.attention import RowSpec\n"
        "from priortr.engine import evidence\n"
        "import priortr.engine.plan\n"
        "from priortr.engine.front_door import StagedPrompt\n"
        "from priortr.engine.config import PruningConfig\n"
        "def run():\n"
        "    from priortr.engine.stage import run_stage\n"
        "    from priortr.engine.state import StageState\n"
    )
    assert _past_the_door(_graph(package)) == {
        f"priortr.integrations.vllm.step -> priortr.engine.{name}" for name in internals
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
