"""Fail closed: a model config carrying ``priortr`` settings never starts unpruned.

Where the plug-in cannot serve (a vLLM outside ``SUPPORTED_VLLM``, or an error while registering),
``register`` puts ``RegistrationGuard`` hooks under every architecture name in ``architectures.py``
instead of the pruning classes: vLLM runs an architecture's hook from ``MODELS_CONFIG_MAP`` on every
engine config it builds (vLLM 0.33: ``vllm/config/vllm.py:2754-2764``, called from ``VllmConfig``'s
``__post_init__`` at ``:1539``), and the guard refuses one that carries ``priortr`` settings, saying
why the plug-in is not active and which vLLM releases it supports. A config without them runs vLLM's
own hook for the architecture as before, so stock models and vLLM's CLI are untouched.

The guard reads one vLLM name, ``MODELS_CONFIG_MAP`` (imported when it is installed), and calls
vLLM's hooks by the two methods vLLM calls (``verify_and_update_model_config`` at
``vllm/config/model.py:1520``, ``verify_and_update_config``): it must still install on a vLLM whose
other internals the plug-in no longer recognises.
"""

from __future__ import annotations

from typing import Any

from priortr.integrations.vllm.architectures import SERVED, UNSERVED
from priortr.integrations.vllm.settings import SETTINGS_KEY

GUARDED = SERVED + tuple(UNSERVED)
"""Every architecture a ``priortr`` config may name: the served families and the unserved ones."""


class SettingsGuard:
    """A ``MODELS_CONFIG_MAP`` hook that refuses a config carrying ``priortr`` settings (``refusal``
    says why) and otherwise runs ``previous``, vLLM's own hook for the architecture (None: it has none)."""

    previous: Any = None

    @classmethod
    def refusal(cls, architecture: str) -> str:
        """The error message for a ``priortr`` config of ``architecture``."""
        raise NotImplementedError

    @classmethod
    def verify_and_update_model_config(cls, model_config: Any) -> None:
        if cls.previous is not None:
            cls.previous.verify_and_update_model_config(model_config)

    @classmethod
    def verify_and_update_config(cls, vllm_config: Any) -> None:
        model_config = vllm_config.model_config
        if getattr(model_config.hf_config, SETTINGS_KEY, None) is not None:
            raise ValueError(cls.refusal(model_config.architecture))
        if cls.previous is not None:
            cls.previous.verify_and_update_config(vllm_config)


class RegistrationGuard(SettingsGuard):
    """The hook ``register`` installs where the plug-in is not active (``reason`` says why)."""

    reason: str

    @classmethod
    def refusal(cls, architecture: str) -> str:
        return (
            f"priortr's vLLM plug-in is not active ({cls.reason}), and this {architecture} config carries "
            "priortr settings, which vLLM would ignore and serve the model unpruned (every request "
            "holding all its visual tokens in the KV cache): install a vLLM in the plug-in's supported "
            "range (pip install 'priortr[vllm]'; docs/serving.md), or drop the priortr settings from "
            "--hf-overrides to serve the model unpruned (and then drop --trust-request-mm-kwargs, whose "
            "request keywords only the plug-in narrows)"
        )


def install(reason: str) -> None:
    """Put a ``RegistrationGuard`` giving ``reason`` over vLLM's hook of every guarded architecture
    (over a guard already there: the hook under it), so that a ``priortr`` config refuses to start."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    for architecture in GUARDED:
        previous = MODELS_CONFIG_MAP.get(architecture)
        if isinstance(previous, type) and issubclass(previous, RegistrationGuard):
            previous = previous.previous
        MODELS_CONFIG_MAP[architecture] = type(
            "RegistrationGuard", (RegistrationGuard,), {"previous": previous, "reason": reason}
        )
