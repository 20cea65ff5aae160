"""Research scripts and raw results: reproductions of the paper's numbers and one-off analyses.

Not part of the installed ``priortr`` package; run from the repository root (see benchmarks/README.md).
"""
