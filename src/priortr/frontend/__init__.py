"""What every front end shares: loading a model to prune (``loading``), chat prompts about images
(``prompts``) and the one clock (``timing``).

The command line, the lmms-eval plug-in, the testbed and the tools (``priortr bench`` / ``calibrate``)
all go through these, so a user meets the same checks, the same prompt and the same timing everywhere.
The library itself (``priortr.api``, the engine, the methods, the adapters) imports none of them.
"""
