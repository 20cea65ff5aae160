"""The ``priortr`` argument parser, built from each command module's ``add_parser``.

Building it imports no torch or transformers (the command modules import them inside their functions),
so ``priortr --help`` and ``priortr <command> --help`` answer at once.
"""

from __future__ import annotations

import argparse
import re

from priortr import __version__
from priortr.cli import bench, calibrate, demo, evaluate, families, flops, generate, methods, report, viz

# in the order of `priortr --help`
COMMANDS = (generate, methods, families, flops, bench, viz, demo, evaluate, calibrate, report)


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line: ``priortr generate: error: ...``."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        # argparse reads "-1:128" as an unknown option and says "--stages: expected one argument"
        for token in args or []:
            if re.fullmatch(r"-\d+:\S*", token):
                self.error(f"argument --stages: a stage's layer is a decoder layer index >= 0, got {token!r}")
        return super().parse_known_args(args, namespace)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one sub-parser per command, each setting ``check`` (run before any work,
    or None) and ``run`` (the command)."""
    parser = Parser(prog="priortr", description="Prior-corrected visual token pruning.")
    parser.add_argument("--version", action="version", version=f"priortr {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log diagnostics to stderr")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(commands)
    return parser
