"""Settings in one room: a served config's ``priortr`` settings are checked once
(``settings.check_settings``) and then read from ``settings.served_settings``' cache by every caller (the
config hooks, the model, the processor on every request), counted here; the cache tells apart what the
checks tell apart, never keeps a refusal, and sees settings that changed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from priortr.integrations.vllm import settings

N_LAYERS = 4


def hf_config(priortr: object, n_layers: int = N_LAYERS) -> SimpleNamespace:
    """A model config as the plug-in reads it: its ``priortr`` settings and its text config's depth."""
    text = SimpleNamespace(num_hidden_layers=n_layers)
    return SimpleNamespace(priortr=priortr, get_text_config=lambda: text)


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The settings ``check_settings`` is called with, from an empty cache."""
    calls: list[object] = []
    check = settings.check_settings

    def counted(given: object, n_layers: int) -> settings.ServedSettings:
        calls.append(given)
        return check(given, n_layers)

    monkeypatch.setattr(settings, "check_settings", counted)
    monkeypatch.setattr(settings, "_CHECKED", {})
    return calls


def test_a_served_config_is_checked_once(checks):
    config = hf_config({"method": "priortr", "budget": 8, "layer": 1, "request_budgets": [4]})
    first = settings.served_settings(config)
    for _ in range(8):  # the hooks, the model, two processor calls per request...
        assert settings.served_settings(config) is first
    assert settings.served_settings(hf_config(dict(config.priortr))) is first  # the same settings
    assert len(checks) == 1
    assert first.config.budget == 8 and first.config.layer == 1 and first.policy.budgets == (4,)
    assert settings.served_settings(hf_config(None)) is None  # stock vLLM: nothing checked
    assert len(checks) == 1


def test_other_settings_or_depths_are_checked_again(checks):
    one = settings.served_settings(hf_config({"method": "priortr", "budget": 8}))
    assert settings.served_settings(hf_config({"method": "priortr", "budget": 4})).config.budget == 4
    assert settings.served_settings(hf_config({"method": "priortr", "budget": 8}, n_layers=6)) is not one
    assert settings.served_settings(hf_config({"method": "priortr", "budget": 8.0 / 16})).config.budget == 0.5
    assert len(checks) == 4


def test_the_cache_tells_apart_what_the_checks_do(checks):
    """1 == True in Python; a budget of True is refused where 1 is served, so they are two keys."""
    settings.served_settings(hf_config({"method": "priortr", "budget": 1}))
    with pytest.raises(ValueError, match="must not be a bool"):
        settings.served_settings(hf_config({"method": "priortr", "budget": True}))


def test_a_refused_config_is_refused_at_every_call(checks):
    config = hf_config({"method": "sparsevlm"})
    for _ in range(2):
        with pytest.raises(ValueError, match="may merge tokens"):
            settings.served_settings(config)
    assert len(checks) == 2


def test_settings_changed_in_place_are_checked_again(checks):
    config = hf_config({"method": "priortr", "budget": 8})
    assert settings.served_settings(config).config.budget == 8
    config.priortr["budget"] = 16
    assert settings.served_settings(config).config.budget == 16
    assert len(checks) == 2


def test_the_shared_settings_refuse_to_change(checks):
    served = settings.served_settings(hf_config({"method": "priortr", "budget": 8}))
    with pytest.raises(TypeError):
        served.config.options["adaptive"] = True
    with pytest.raises(AttributeError):  # frozen dataclasses
        served.config.budget = 4
    with pytest.raises(AttributeError):
        served.policy.budgets = (4,)
