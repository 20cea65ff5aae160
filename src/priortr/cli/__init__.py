"""``priortr`` command line: a layer over ``priortr.apply`` for trying pruning, measuring it and the
testbed.

    priortr generate --model llava-hf/llava-1.5-7b-hf --image cat.png --prompt "What is this?" --budget 64

One module per command (``generate``, ``methods``, ``families``, ``flops``, ``bench``, ``viz``, ``demo``,
``evaluate`` for ``eval``, ``calibrate``, ``report``), each with ``add_parser``, ``check`` (its input,
before any work) and ``run``; ``parser`` assembles them, ``arguments`` and ``checks`` hold what several share.
All pruning logic lives in the Python API, and models load through ``priortr.frontend.loading``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from priortr.cli.checks import one_line
from priortr.cli.parser import build_parser

__all__ = ["build_parser", "main"]

log = logging.getLogger("priortr.cli")


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; return 0, or 2 after printing ``priortr: error: ...`` for bad input."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, or argparse's own usage error (already printed)
        return exc.code if isinstance(exc.code, int) else 0
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    log.setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    log.info("arguments: %s", {k: v for k, v in vars(args).items() if k not in ("check", "run")})
    args.argv = argv
    try:
        if args.check is not None:
            args.check(args)
        code = args.run(args)
        sys.stdout.flush()  # here, so that a closed pipe is seen below and not at interpreter exit
        return code
    except BrokenPipeError:  # the reader stopped early (`priortr report ... | head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 128 + signal.SIGPIPE  # as the shell reports a writer stopped by its reader
    except (ValueError, OSError) as exc:
        if args.debug:
            raise
        print(f"priortr: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("priortr: interrupted", file=sys.stderr)
        return 130
