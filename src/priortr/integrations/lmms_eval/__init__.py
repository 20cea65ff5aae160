"""The lmms-eval plug-in: ``lmms-eval --model priortr`` (docs/lmms-eval.md). ``manifest`` is what
lmms-eval reads from the entry point without importing torch; ``model`` is the model class it loads."""
