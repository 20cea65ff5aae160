"""Methods that prune before the language model (issue 57): VisionZip, VisPruner and DivPrune served on
LLaVA-1.5, DivPrune on every family whose ``priortr.apply`` runs it, each answer against
``priortr.apply`` + HF ``generate()`` on the same tiny checkpoint (``family_contract.expected``), in one
step of mixed requests and with requests arriving while others decode; what cannot be served is refused
with its reason when the engine starts.

One engine per (family, method): engine start is the slow part, so a family's cases share it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from vllm import LLM

from priortr.integrations.vllm import models
from priortr.integrations.vllm.settings import served_settings
from priortr.integrations.vllm.vision_evidence import evidence_slots
from tests.vllm.family_contract import (
    ARRIVALS,
    FAMILIES,
    OFF,
    Family,
    answers,
    arrival_cases,
    check_padded_serving,
    expected,
    serve,
    step_cases,
)
from tests.vllm.harness import ANSWER_TOKENS, check_positions_stay_put, generate
from tests.vllm.reference import ENGINE, hf_tokens

LLAVA_METHODS = {
    "divprune": {"method": "divprune", "budget": 4},
    "visionzip": {"method": "visionzip", "budget": 6},  # 5 dominant patches (one slot is [CLS]'s), 1 merged
    "vispruner": {"method": "vispruner", "budget": 4},
}


def pre_llm(name: str, settings: dict) -> Family:
    """Family ``name``'s row serving ``settings`` instead of its decoder-layer method; the prompt
    lengths of ``step_cases`` are the row's, K being the same count."""
    row = FAMILIES[name]
    return replace(row, settings=settings)


def engine(row: Family, path: Any) -> LLM:
    return LLM(
        model=str(path), hf_overrides=row.overrides(), limit_mm_per_prompt=row.limits, **row.engine, **ENGINE
    )


class PreLLMContract:
    """One step of mixed requests and requests arriving while others decode, exact against apply."""

    row: Family

    @pytest.fixture(scope="class")
    @classmethod
    def path(cls, request: pytest.FixtureRequest) -> Any:
        return request.getfixturevalue(cls.row.fixture)

    @pytest.fixture(scope="class")
    @classmethod
    def llm(cls, path: Any) -> Any:
        served = engine(cls.row, path)
        yield served
        del served

    def test_one_step_of_images_text_budgets_and_pruning_off(self, llm, path):
        assert llm.apply_model(type) == [self.row.plug_in]
        cases = step_cases(self.row)
        outs = generate(llm, cases)
        for index, (case, answer) in enumerate(zip(cases, answers(outs), strict=True)):
            assert answer == expected(self.row, path, case), index
        assert tuple(len(out.prompt_token_ids) for out in outs) == self.row.lengths
        unpruned = [hf_tokens(path, *case[:2], None, ANSWER_TOKENS) for case in cases[:3]]
        assert answers(outs)[:3] != unpruned  # pruning changed an answer

    def test_survivors_left_where_vllm_merged_them_is_caught(self, llm, path, monkeypatch):
        """Negative control: the survivors get their positions, but the rows keep the first K of each
        image's embeddings as vLLM merged them; the answer changes."""
        stock = models.shorten_prompts

        def unwritten(model: Any, taps: Any, step: Any, positions: Any, inputs_embeds: torch.Tensor) -> Any:
            return stock(model, taps, step, positions, inputs_embeds.clone())

        monkeypatch.setattr(models, "shorten_prompts", unwritten)
        case = step_cases(self.row)[1]
        assert answers(generate(llm, [case])) != [expected(self.row, path, case)]

    def test_survivors_positions_are_written_where_vllm_reads_them(self, llm):
        """The survivors' positions go into the runner's own positions buffer, as their embeddings go
        into its ``inputs_embeds``: on a GPU the step replays piecewise CUDA graphs, which read the
        addresses they captured, so a copy would leave the survivors at their placeholders' positions."""
        check_positions_stay_put(llm, step_cases(self.row))

    def test_pruned_prompts_stay_exact_when_padded(self, llm, path, monkeypatch):
        """Every step padded to a CUDA-graph size, as vLLM 0.34 pads it on a Hopper GPU (the CPU build
        never pads): the survivors take the prompt's own rows and the padding rows pass through."""
        check_padded_serving(llm, self.row, path, monkeypatch, before_llm=True)

    def test_requests_arriving_while_others_decode(self, llm, path):
        cases = arrival_cases(self.row)
        results = serve(llm, cases, ARRIVALS)
        for index, case in enumerate(cases):
            assert results[index] == expected(self.row, path, case), index


class TestLlavaDivPrune(PreLLMContract):
    row = pre_llm("llava", LLAVA_METHODS["divprune"])


class TestLlavaVisPruner(PreLLMContract):
    row = pre_llm("llava", LLAVA_METHODS["vispruner"])


class TestLlavaVisionZipEveryTokenASlot(PreLLMContract):
    row = pre_llm("llava", {"method": "visionzip", "budget": 4, "options": {"cls_takes_a_slot": False}})


class TestLlavaVisionZip(PreLLMContract):
    """VisionZip's default: the authors' K counts [CLS], so an image keeps K - 1 tokens (of 5: 3 dominant,
    1 merged), and the prompt holds K - 1 slots: two images at 5 split 3 + 2 and keep 2 + 1, at the
    wide 8 they keep 3 + 3."""

    row = replace(
        pre_llm("llava", {"method": "visionzip", "budget": 5}), lengths=(9 + 4, 11 + 3, 11 + 6, 9 + 16, 10)
    )

    def test_requests_arriving_while_others_decode(self, llm, path):
        """Arrivals at the engine's budget and with pruning off (the narrow budgets leave no patch)."""
        cases = [case for case in arrival_cases(self.row) if case[2] is None or case[2] == OFF]
        results = serve(llm, cases, {0: [0], 2: [1, 2]})
        for index, case in enumerate(cases):
            assert results[index] == expected(self.row, path, case), index

    def test_encoder_cache_counts_the_tower_evidence(self, llm):
        """A pruned image's cache entry is counted at its N rows plus the rows its riding evidence
        (features, keys, the [CLS] query) takes at the language model's width."""
        hf_config = llm.llm_engine.model_config.hf_config
        slots = evidence_slots(served_settings(hf_config).config, hf_config)(16)
        manager = llm.llm_engine.engine_core.engine_core.scheduler.encoder_cache_manager
        generate(llm, [(self.row.one, [self.row.large(20)], None)])
        assert slots > 0
        assert 16 + slots in manager.num_embeds_by_hash.values()

    def test_a_budget_leaving_no_patch_is_refused(self, llm):
        """Two images at a budget of 2 are one token each, which leaves no patch once [CLS] takes its
        slot: the request is refused."""
        with pytest.raises(ValueError, match="keeps no token"):
            generate(llm, [(self.row.two, [self.row.large(0), self.row.small(1)], {"budget": 2})])


@pytest.mark.parametrize(
    ("fixture", "settings", "message"),
    [
        (
            "llava_dir",
            {"method": "prumerge", "budget": 4},
            r"which vLLM does not build .* 1 of the tower's 2",
        ),
        ("llava_dir", {"method": "prumerge+", "budget": 4}, r"last layer, which vLLM does not build"),
        (
            "qwen_dir",
            {"method": "visionzip", "budget": 4},
            r"qwen2-vl model.s vision tower has no \[CLS\] token",
        ),
        ("onevision_dir", {"method": "vispruner", "budget": 4}, r"vision tower has no \[CLS\] token"),
    ],
)
def test_evidence_the_tower_does_not_show_is_refused_when_the_model_loads(
    fixture, settings, message, request
):
    """PruMerge ranks by the tower's last layer, which vLLM does not build for LLaVA-1.5 (feature layer
    -2); Qwen2-VL's and LLaVA-OneVision's towers have no [CLS] token (``priortr.apply`` refuses them
    alike): the engine refuses to start, naming the reason."""
    row = replace(next(row for row in FAMILIES.values() if row.fixture == fixture), settings=settings)
    with pytest.raises(ValueError, match=message):
        engine(row, request.getfixturevalue(fixture))


def divprune(name: str) -> Family:
    """Family ``name``'s row serving DivPrune at the budget of its decoder-layer method."""
    return pre_llm(name, {"method": "divprune", "budget": FAMILIES[name].settings["budget"]})


class TestQwen2VLDivPrune(PreLLMContract):
    row = divprune("qwen2-vl")


class TestQwen2_5_VLDivPrune(PreLLMContract):
    row = divprune("qwen2.5-vl")


class TestInternVLDivPrune(PreLLMContract):
    row = divprune("internvl")


class TestInternVL3_5DivPrune(PreLLMContract):
    row = divprune("internvl3.5")


def anyres_divprune(name: str) -> Family:
    """An AnyRes row under DivPrune, every image 56x28 (a 4x8 tile grid): a 28x28 image's one tile is
    the whole image at the base crop's resolution, so its base and tile tokens are duplicates (22 pairs
    of its 36 tokens within a cosine distance of 1e-6 on the test checkpoint), which DivPrune's greedy
    max-min ranks by rounding differences between vLLM's tower and transformers' (docs/serving.md)."""
    row = divprune(name)
    return replace(row, small=row.large)


class TestLlavaOnevisionDivPrune(PreLLMContract):
    row = anyres_divprune("llava-onevision")


class TestLlavaNextDivPrune(PreLLMContract):
    row = anyres_divprune("llava-next")


class TestMistral3DivPrune(PreLLMContract):
    row = divprune("mistral3")
