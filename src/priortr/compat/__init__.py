"""The one place that knows how transformers works inside; the engine speaks only to this package.

* ``release``: the supported releases (``FLOOR`` and newer) and ``UnsupportedTransformers``, raised for
  anything priortr does not recognise;
* ``calls``: the argument names of the multimodal model's and the decoder layers' forwards, resolved
  from their signatures when pruning is attached (``resolve``), and views of one call of each;
* ``layers``: what kind each decoder layer is (full, sliding or chunked attention, linear attention);
* ``cache``: cache lengths, and the per-layer-type operations on a KV cache (compact, guard);
* ``masks``: attention masks gathered to the kept tokens, keyed by the attention implementation, and
  the masks of calls that continue a pruned cache of a model with local windows;
* ``inputs``: model inputs named differently across releases;
* ``model_classes``: the image-text model classes the release ships, from its auto mappings.

Supporting a future rename is a one-line change in the module that names it (e.g.
``calls.CACHE_NAMES``); the tests run at both ends of the supported range.
"""

from priortr.compat import cache, calls, inputs, layers, masks, model_classes, release
from priortr.compat.release import UnsupportedTransformers

__all__ = [
    "UnsupportedTransformers",
    "cache",
    "calls",
    "inputs",
    "layers",
    "masks",
    "model_classes",
    "release",
]
