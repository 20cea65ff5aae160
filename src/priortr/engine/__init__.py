"""The pruning engine: the library's surgery on a Hugging Face model's hidden states, masks, positions
and KV cache, and the one stage core every front end runs.

It attaches PyTorch module hooks to a stock transformers model (no copied modeling code). A front end
that runs the decoder layers itself reaches it through ``front_door`` alone (the vLLM plug-in, which
runs layers 0..L of a pruned prompt and writes the kept tokens' keys and values into vLLM's paged cache
itself: ``kept_runs``, ``StagedPrompt``). Its parts, in the order a prefill meets them:

* ``hooks``: the wiring. One permanent pre-hook on the multimodal model; per-layer hooks are armed for
  a pruned prefill only, so decode steps run none.
* ``plan``: the prefill's plan, made on the host from one copy of the prompt (images, pools, budgets,
  the attention rows to recompute) by its one constructor, and frozen.
* ``prefill``: the stages, between decoder layers, and their record.
* ``stage``: one stage, values in and values out (gather evidence -> select -> cut), the core the vLLM
  plug-in runs too (through ``front_door``); ``state``: what the stages so far left (pools, sequence
  map).
* ``evidence``: what a selector sees (``StageInputs``): recomputed attention rows (Q, P, last row),
  hidden states, the vision tower's [CLS] attention, keys and features (``VISION_NEEDS``).
* ``cut``: new hidden states, pools and sequence map of the kept tokens, the KV cache compacted;
  ``sequence``: the map between prompt positions and current columns.
* ``ledger``: what later calls (decode steps, chat turns) need to continue a pruned cache.
* ``result``: ``handle.last`` (``PruneResult``), assembled when read.

Its private parts sit beside them: ``attention`` (attention rows recomputed from a layer's projections)
and ``pools`` (the visual tokens ranked together). The tensor helpers the adapters and
``priortr.compat`` share with the engine (per-row gathers, RoPE, host/device copies) live below it, in
``priortr.tensors``, so nothing under the engine imports the engine.
"""
