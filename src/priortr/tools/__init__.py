"""Tools around the library: benchmarks (``bench``, ``overhead``, ``flops``), calibration (``calibrate``),
plots (``viz``), result tables (``report``, ``journal``), model loading and prompts for the command line
and the plug-ins (``loading``, ``prompts``), the shipped configs (``configs``), and what they need of each
family (``families``). The library itself (``priortr.api``, the engine, the methods, the adapters)
imports none of them; the config files ``apply(config=...)`` reads are the core's
(``priortr.config_file``)."""
