"""lmms-eval registration of the ``priortr`` model (entry-point group ``lmms_eval.models``).

lmms-eval imports this module while it imports ``lmms_eval.models``, for every run and whatever model is
asked for, so it must stay cheap: no torch, no transformers, no priortr. The model class itself
(``priortr.integrations.lmms_eval.model.PriorTRLMMs``) is imported by path only when ``--model priortr``
is used.

Requires the ``eval`` extra (``pip install "priortr[eval]"``); ``import priortr`` never imports this.
"""

from lmms_eval.models.registry_v2 import ModelManifest

MANIFEST = ModelManifest(
    model_id="priortr", simple_class_path="priortr.integrations.lmms_eval.model.PriorTRLMMs"
)
