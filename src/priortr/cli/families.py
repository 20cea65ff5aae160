"""``priortr families``: every image-text model class the installed transformers ships, each marked
supported (with its priortr adapter), refused (with the reason) or not yet
(``priortr.tools.family_support``)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "families",
        help="which image-text models of this transformers priortr prunes",
        description=run.__doc__,
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.set_defaults(check=None, run=run)


def run(args: argparse.Namespace) -> int:
    """List every image-text model class of the installed transformers (its auto mappings), each marked
    supported (the priortr adapter that serves it), refused (why) or not yet, so you see at once whether
    your model works with ``priortr.apply``."""
    from priortr.tools import family_support

    rows = family_support.family_support()
    print(json.dumps(family_support.as_json(rows)) if args.json else family_support.format_table(rows))
    return 0
