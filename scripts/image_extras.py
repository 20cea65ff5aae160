"""Print the installed distributions the accelerator image is not assumed to hold, one a line.

    python scripts/image_extras.py        (scripts/device-dry-run.sh uninstalls what it prints)

The image is assumed to hold torch, transformers, numpy, safetensors and pytest (and pip), with what
they require: the closure of those requirements in this environment, read from the installed metadata
(markers evaluated here, and a requirement's extras followed: torch requires
``cuda-toolkit[cufile,...]``, whose extras bring the CUDA libraries torch loads at import). Everything
else installed (priortr itself, matplotlib, pillow, accelerate, pytest-xdist, ...) is printed, so that
removing it leaves the image's set. Needs ``packaging``, which transformers requires.
"""

from __future__ import annotations

import re
from importlib import metadata

from packaging.requirements import Requirement

IMAGE = ("torch", "transformers", "numpy", "safetensors", "pytest", "pip")


def canonical(name: str) -> str:
    """A distribution's name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: tuple[str, ...]) -> set[str]:
    """``roots`` and every installed distribution they require, transitively, with the extras each
    requirement asks for."""
    installed = {canonical(d.metadata["Name"]): d for d in metadata.distributions()}
    missing = [root for root in roots if canonical(root) not in installed]
    if missing:
        raise SystemExit(f"not installed here, but the image has them: {', '.join(missing)}")
    seen: set[tuple[str, str]] = set()
    todo = [(canonical(root), "") for root in roots]
    while todo:
        name, extra = todo.pop()
        if (name, extra) in seen or name not in installed:
            continue
        seen.add((name, extra))
        for line in installed[name].requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": extra}):
                target = canonical(requirement.name)
                todo += [(target, ""), *((target, canonical(e)) for e in requirement.extras)]
    return {name for name, _ in seen}


def main() -> None:
    keep = closure(IMAGE)
    names = {canonical(d.metadata["Name"]) for d in metadata.distributions()}
    for name in sorted(names - keep):
        print(name)


if __name__ == "__main__":
    main()
