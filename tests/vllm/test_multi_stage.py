"""Multi-stage methods served (CLSE's three stages, PyramidDrop's schedule, ``stages`` schedules of a
scoring rule): each family where ``priortr.apply`` runs the method answers as ``apply`` + Hugging Face
``generate()`` does, and where ``apply`` refuses it the engine refuses it too, with the library's
message. Every case here was refused on 87afea2 ("prunes at several decoder layers").

The tiny checkpoints have 4 decoder layers: CLSE scores layers 0, 1 and 2 (16 tokens an image keep
13, 8, then 2 at budget 8), PyramidDrop layers 0, 1 and 2 (16 keep 10, 6, then 4 at budget 4), the
``stages`` schedule layers 1 and 2 (8, then 4). Qwen3-VL adds DeepStack features to the outputs of
layers 0 and 1, so only a schedule from layer 1 on applies there (``apply`` refuses the others).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from vllm import LLM

from priortr.integrations.vllm import decoder, step
from tests.vllm.family_contract import FAMILIES, Family, answers, check_padded_serving, expected
from tests.vllm.harness import generate
from tests.vllm.reference import ENGINE

SCHEDULES = {
    "clse": {"method": "clse", "budget": 8},
    "pdrop": {"method": "pdrop", "budget": 4},
    "stages": {"method": "priortr", "stages": [[1, 8], [2, 4]]},
}
"""Each multi-stage method's engine settings (no request budgets: a multi-stage method serves the
engine's)."""
NO_GRID = ("internvl", "internvl3.5", "llava-onevision", "llava-next", "mistral3")
"""The families whose adapter defines no token grid for an image, which CLSE's first stage reads
(``FamilyAdapter.token_grids``): tiles, AnyRes crops, Mistral 3's row breaks. A new family is held to
serve CLSE unless it is listed here."""
DEEPSTACK = ("qwen3-vl", "qwen3-vl-moe")
"""The families that add visual features to the outputs of layers 0 and 1 (DeepStack)."""


def served(family: str, method: str) -> bool:
    """Whether ``priortr.apply`` runs ``method`` on ``family``'s tiny checkpoint."""
    if family in DEEPSTACK:
        return method == "stages"
    return method != "clse" or family not in NO_GRID


CASES = [(family, method) for family in FAMILIES for method in SCHEDULES if served(family, method)]
REFUSED = {
    (family, method): "DeepStack" if family in DEEPSTACK else "defines no grid"
    for family in FAMILIES
    for method in SCHEDULES
    if not served(family, method)
}


def engine(row: Family, path: Path) -> LLM:
    """An engine serving ``row``'s checkpoint with ``row``'s settings and nothing granted to requests."""
    return LLM(
        model=str(path),
        hf_overrides={"priortr": row.settings},
        limit_mm_per_prompt=row.limits,
        **row.engine,
        **ENGINE,
    )


class ServedSchedule:
    """The three tests of one (family, method) pair, on one engine. Each pair is a class of its own
    (made below), so that pytest-xdist's ``loadscope`` shares the 24 engines between its workers."""

    family: str
    method: str

    @pytest.fixture(scope="class")
    @classmethod
    def served_case(cls, request: pytest.FixtureRequest) -> Any:
        """(the family's row with the method's settings, its checkpoint, an engine serving them)."""
        row = replace(FAMILIES[cls.family], settings=SCHEDULES[cls.method])
        path = request.getfixturevalue(row.fixture)
        llm = engine(row, path)
        yield row, path, llm
        del llm

    def test_answers_as_apply(self, served_case):
        """One image, two images sharing the budget, an unpruned image and a text-only prompt in one
        step answer as ``apply`` does, each pruned prompt scheduled on text + its last stage's K per
        image."""
        row, path, llm = served_case
        cases = [
            (row.one, [row.large(0)], None),
            (row.two, [row.large(1), row.small(2)], None),
            (row.one, [row.large(5)], {"enabled": False}),
            (row.text_only, [], None),
        ]
        outs = generate(llm, cases)
        for index, (case, answer) in enumerate(zip(cases, answers(outs), strict=True)):
            assert answer == expected(row, path, case), index
        unpruned = generate(llm, [(*cases[0][:2], {"enabled": False})])[0]
        assert len(outs[0].prompt_token_ids) < len(unpruned.prompt_token_ids)

    def test_pruned_prefills_stay_exact_when_padded(self, served_case, monkeypatch):
        """Every step padded to a CUDA-graph size, as vLLM 0.34 pads it on a Hopper GPU (the CPU
        build never pads): the stages cut the prompt's own rows and the padding rows pass through."""
        row, path, llm = served_case
        check_padded_serving(llm, row, path, monkeypatch)

    def test_uncompacted_stage_cache_is_caught(self, served_case, monkeypatch):
        """Negative control: the first stage cuts the hidden states but leaves the keys and values of
        the layers it followed uncut (the later cuts then index the wrong tokens of them); the answer
        changes."""
        row, path, llm = served_case
        original = step.cut_prompt
        calls: list[int] = []

        def first_uncompacted(prompt: Any, keep: Any) -> Any:
            calls.append(len(prompt.keys))
            cut = original(prompt, keep)
            if len(calls) > 1:
                return cut
            return replace(cut, keys=prompt.keys, values=prompt.values)

        monkeypatch.setattr(step, "cut_prompt", first_uncompacted)
        case = (row.one, [row.large(0)], None)
        assert answers(generate(llm, [case])) != [expected(row, path, case)]
        assert len(calls) > 1  # a stage after the faulty one indexed its keys and values

    def test_residual_updated_in_place_as_on_a_gpu(self, served_case, monkeypatch):
        """vLLM's fused add-norm writes the residual sum into its residual argument on a GPU (the
        ``vllm_c`` impl is in place; the CPU build's is not), and layer 0's residual stream is the
        prompt's embeddings, which CLSE's stages read: emulated here, every method still answers as
        ``apply`` does."""
        row, path, llm = served_case
        original = decoder.LayerParts.output

        def in_place(self: Any, attended: Any, residual: Any) -> Any:
            hidden, summed = original(self, attended, residual)
            return hidden, residual.copy_(summed)

        monkeypatch.setattr(decoder.LayerParts, "output", in_place)
        case = (row.one, [row.large(0)], None)
        assert answers(generate(llm, [case])) == [expected(row, path, case)]


def class_name(family: str, method: str) -> str:
    """``Test`` + the pair, as an identifier: ``qwen2.5-vl``, ``clse`` -> ``TestQwen2_5_vlClse``."""
    return "Test" + re.sub(r"\W", "_", family).capitalize() + method.capitalize()


for _family, _method in CASES:
    globals()[class_name(_family, _method)] = type(
        class_name(_family, _method), (ServedSchedule,), {"family": _family, "method": _method}
    )


@pytest.mark.parametrize(("family", "method"), list(REFUSED), ids=[f"{f}-{m}" for f, m in REFUSED])
def test_refused_where_apply_refuses(family, method, request):
    """Where ``apply`` refuses the method (a family without token grids for CLSE, a stage before the
    last DeepStack injection), the engine refuses it when it starts, with the library's message."""
    row = replace(FAMILIES[family], settings=SCHEDULES[method])
    with pytest.raises(Exception, match=REFUSED[family, method]):
        engine(row, request.getfixturevalue(row.fixture))
