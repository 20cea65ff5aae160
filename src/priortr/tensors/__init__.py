"""The ground floor: tensor helpers that know neither transformers' internals nor the engine.

``gathers`` keeps each batch row's own columns of a tensor (hidden states, RoPE, masks, caches), ``rope``
applies rotary position embeddings as the decoders do, ``host`` moves planning data between the host and
the device without stalling the device. ``compat``, the adapters and the engine all stand on them; this
package imports nothing from the rest of priortr.
"""
