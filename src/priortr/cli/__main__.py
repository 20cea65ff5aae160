"""``python -m priortr.cli``: the console script ``priortr``."""

from priortr.cli import main

raise SystemExit(main())
