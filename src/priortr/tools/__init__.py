"""Tools around the library: benchmarks (``bench``, ``overhead``, ``flops``), calibration (``calibrate``),
plots (``viz``), result tables (``report``, ``journal``), the shipped true-shape configs (``configs``),
and what they need of each family (``families``). Loading a model, prompts and timing, which every front
end shares, are ``priortr.frontend``'s. The library itself (``priortr.api``, the engine, the methods,
the adapters) imports none of them; the config files ``apply(config=...)`` reads are the core's
(``priortr.config_file``)."""
