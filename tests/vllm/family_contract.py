"""The contract every family the plug-in serves must keep, written once and run over a table of families
(as peft runs its common tester over its model list): a new family costs a row in ``FAMILIES``, its
tiny checkpoint (``checkpoints.py``, a fixture in ``conftest.py``) and a ``FamilyContract`` subclass
naming the row, beside whatever is that family's own.

Every answer is compared with ``priortr.apply`` + Hugging Face ``generate()`` on the same checkpoint
(``reference.hf_tokens``); the negative controls patch a fault into the plug-in and the answer must then
differ. One engine per family serves a class (engine start is the slow part; a class is also the unit
that ``--dist loadscope`` hands to one worker, so the families spread over the workers); the preemption
scenario starts its own engine with a tiny KV cache and runs last in its class (``conftest.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any, ClassVar

import pytest
from PIL import Image
from vllm import LLM, SamplingParams

from priortr.integrations.vllm import models, served_families
from tests.helpers.tiny_glm4v import GLM_IMAGE_END_ID, GLM_IMAGE_ID, GLM_IMAGE_START_ID
from tests.helpers.tiny_mistral3 import MISTRAL3_BREAK_ID, MISTRAL3_END_ID, MISTRAL3_IMAGE_ID
from tests.vllm.checkpoints import MISTRAL3_TOKEN_PIXELS
from tests.vllm.harness import (
    ANSWER_TOKENS,
    apply_settings,
    generate,
    run_arrivals,
    shift_decode_offset,
    skip_kv_rewrite,
)
from tests.vllm.reference import ENGINE, LLAVA_PROMPT, QWEN_IMAGE, hf_tokens, image, vllm_request
from tests.vllm.runners import GRIDS, RUNNER, PaddedStep, pad_steps

OFF = {"enabled": False}
NARROW = (4, 2)
"""Per-request budgets every engine grants beside its family's ``wide`` one: a two-image and a
one-image request asking for fewer tokens than the engine's budget."""
PREEMPTED_TOKENS = 40
TEXT_ONLY = "USER: what is the color of the cat ASSISTANT:"  # 9 tokens


@dataclass(frozen=True)
class Family:
    """A served family as the contract drives it.

    ``one``/``two``: prompts with one and two images (text between them); ``small``/``large``: seed ->
    an image of the family's fewer and more visual tokens; ``wide``: a per-request budget above the
    engine's; ``lengths``: the pruned prompt lengths of ``step_cases``, hand-computed (text tokens + K,
    plus what the family keeps of an image besides its kept tokens); ``layouts``: (case of
    ``step_cases``, offset, token ids) spans the served prompt must hold; ``budgets``: further
    per-request budgets the family's own tests ask for; ``engine``: further engine arguments."""

    fixture: str
    architecture: str
    plug_in: type
    settings: dict
    one: str
    two: str
    small: Callable[[int], Image.Image]
    large: Callable[[int], Image.Image]
    wide: int
    lengths: tuple[int, ...]
    limits: dict
    text_only: str = TEXT_ONLY
    layouts: tuple[tuple[int, int, tuple[int, ...]], ...] = ()
    budgets: tuple[float, ...] = ()
    engine: dict = field(default_factory=dict)

    def overrides(self) -> dict:
        """The engine's ``hf_overrides``: the family's settings and every budget its requests ask for."""
        granted = [self.wide, *NARROW, *self.budgets]
        return {"priortr": {**self.settings, "request_budgets": granted}}


def sized(width: int, height: int | None = None) -> Callable[[int], Image.Image]:
    """Seed -> a random image ``width`` x ``height`` (default square) pixels."""
    return lambda seed: image(width, seed, height=height)


def mistral3_grid(rows: int, cols: int) -> Callable[[int], Image.Image]:
    """Seed -> a random image of ``rows x cols`` Mistral 3 tokens."""
    return sized(cols * MISTRAL3_TOKEN_PIXELS, rows * MISTRAL3_TOKEN_PIXELS)


FASTV = {"method": "fastv", "budget": 6, "layer": 1}
QWEN_ONE = f"USER: {QWEN_IMAGE} what is in the image ASSISTANT:"  # 9 text tokens with the markers
QWEN_TWO = f"USER: {QWEN_IMAGE} a {QWEN_IMAGE} what is in the image ASSISTANT:"  # 12
INTERNVL_ONE = "USER: <IMG_CONTEXT> what is in the image ASSISTANT:"  # 9 with <img> and </img>
INTERNVL_TWO = "USER: <IMG_CONTEXT> a <IMG_CONTEXT> what is in the image ASSISTANT:"  # 12
GLM4V_IMAGE = "<|begin_of_image|><|image|><|end_of_image|>"
GLM4V_ONE = f"USER: {GLM4V_IMAGE} what is in the image ASSISTANT:"  # 9 text tokens with the markers
GLM4V_TWO = f"USER: {GLM4V_IMAGE} a {GLM4V_IMAGE} what is in the image ASSISTANT:"  # 12
ANYRES_ONE = "USER: <image> what is in the image ASSISTANT:"  # 7
ANYRES_TWO = "USER: <image> a <image> what is in the image ASSISTANT:"  # 8
IMG, BREAK, END = MISTRAL3_IMAGE_ID, MISTRAL3_BREAK_ID, MISTRAL3_END_ID


def _qwen(
    fixture: str, architecture: str, plug_in: type, small: int, large: int, budgets: tuple = ()
) -> Family:
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL: ``small`` px is 4 tokens, ``large`` px 16 (step case 1's 16 + 4
    tokens keep 5 + 1)."""
    return Family(
        fixture,
        architecture,
        plug_in,
        FASTV,
        QWEN_ONE,
        QWEN_TWO,
        sized(small),
        sized(large),
        wide=10,
        lengths=(9 + 6, 12 + 6, 12 + 10, 9 + 16, 9),
        limits={"image": 2, "video": 0},
        budgets=budgets,
    )


def _internvl(fixture: str) -> Family:
    """56x56: one tile, 16 tokens; 112x56: two crops and the thumbnail, 48."""
    return Family(
        fixture,
        "InternVLForConditionalGeneration",
        served_families.PruningInternVL,
        {"method": "priortr", "budget": 8, "layer": 1},
        INTERNVL_ONE,
        INTERNVL_TWO,
        sized(56),
        sized(112, 56),
        wide=12,
        lengths=(9 + 8, 12 + 8, 12 + 12, 9 + 48, 9),
        limits={"image": 2, "video": 0},
        layouts=((0, 1, (198, *[199] * 8, 197)),),  # <img> K x <IMG_CONTEXT> </img>
    )


def _anyres(fixture: str, architecture: str, plug_in: type, limits: dict) -> Family:
    """28x28 is 36 tokens (base crop 16, one 4x4 crop, 4 newlines), 56x28 is 52 (a 4x8 grid)."""
    return Family(
        fixture,
        architecture,
        plug_in,
        {"method": "priortr", "budget": 8, "layer": 1},
        ANYRES_ONE,
        ANYRES_TWO,
        sized(28),
        sized(56, 28),
        wide=12,
        lengths=(7 + 8, 8 + 8, 8 + 12, 7 + 52, 9),
        limits=limits,
        budgets=(40, 1),
    )


FAMILIES = {
    "llava": Family(
        "llava_dir",
        "LlavaForConditionalGeneration",
        served_families.PruningLlava,
        {"method": "priortr", "budget": 4, "layer": 1},
        LLAVA_PROMPT.format("what is in the image"),  # 9 text tokens
        "<s>USER: <image>\n a <image>\n what is in the image ASSISTANT:",  # 11
        sized(28),  # CLIP resizes every image to 16 tokens
        sized(28),
        wide=8,
        lengths=(9 + 4, 11 + 4, 11 + 8, 9 + 16, 10),
        limits={"image": 2},
        text_only="<s>" + TEXT_ONLY,
        engine={"enable_mm_embeds": True},
    ),
    "qwen2-vl": _qwen(
        "qwen_dir", "Qwen2VLForConditionalGeneration", served_families.PruningQwen2VL, 56, 112, (5, 0.25)
    ),
    "qwen2.5-vl": _qwen(
        "qwen2_5_dir",
        "Qwen2_5_VLForConditionalGeneration",
        served_families.PruningQwen2_5_VL,
        56,
        112,
        (5, 0.25),
    ),
    "qwen3-vl": _qwen(
        "qwen3_vl_dir", "Qwen3VLForConditionalGeneration", served_families.PruningQwen3VL, 64, 128
    ),
    "qwen3-vl-moe": _qwen(
        "qwen3_vl_moe_dir", "Qwen3VLMoeForConditionalGeneration", served_families.PruningQwen3VLMoe, 64, 128
    ),
    "internvl": _internvl("internvl_dir"),
    "internvl3.5": _internvl("internvl3_5_dir"),  # a Qwen3 text model: q/k norms in the scored attention
    "llava-onevision": _anyres(
        "onevision_dir",
        "LlavaOnevisionForConditionalGeneration",
        served_families.PruningLlavaOnevision,
        {"image": 2, "video": 0},
    ),
    "llava-next": _anyres(
        "llava_next_dir", "LlavaNextForConditionalGeneration", served_families.PruningLlavaNext, {"image": 2}
    ),
    "mistral3": Family(
        "mistral3_dir",
        "Mistral3ForConditionalGeneration",
        served_families.PruningMistral3,
        {"method": "priortr", "budget": 4, "layer": 1},
        "USER: [IMG] what is in the image ASSISTANT:",  # 7 text tokens
        "USER: [IMG] a [IMG] what is in the image ASSISTANT:",  # 8
        mistral3_grid(2, 3),
        mistral3_grid(4, 4),
        wide=10,
        # text, K [IMG] slots per image, then each image's row breaks and [IMG_END] (2 x 3: 2, 4 x 4: 4)
        lengths=(7 + 4 + 4, 8 + 4 + 4 + 2, 8 + 10 + 4 + 4, 7 + 20, 9),
        limits={"image": 2},
        layouts=(
            (0, 1, (*[IMG] * 4, *[BREAK] * 3, END)),
            (3, 1, (*([IMG] * 4 + [BREAK]) * 3, *[IMG] * 4, END)),  # unpruned: vLLM's own layout
        ),
    ),
    "glm4v": Family(
        "glm4v_dir",
        "Glm4vForConditionalGeneration",
        served_families.PruningGlm4v,
        FASTV,
        GLM4V_ONE,
        GLM4V_TWO,
        sized(56),  # 4 tokens
        sized(112),  # 16
        wide=10,
        lengths=(9 + 6, 12 + 6, 12 + 10, 9 + 16, 9),
        limits={"image": 2, "video": 0},
        layouts=((0, 1, (GLM_IMAGE_START_ID, *[GLM_IMAGE_ID] * 6, GLM_IMAGE_END_ID)),),
    ),
}
"""Every family the plug-in serves: 1-D RoPE (LLaVA, InternVL's tiles, LLaVA-OneVision's and
LLaVA-NeXT's AnyRes crops, Mistral 3's row breaks) and M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL with
DeepStack, dense and MoE; GLM-4.1V, whose GLM-4 layers have sandwich norms and partial RoPE)."""


def step_cases(family: Family) -> list[tuple]:
    """One step: one image, two images sharing the budget, two asking for more, an unpruned image
    beside pruned ones, a text-only prompt."""
    return [
        (family.one, [family.large(0)], None),
        (family.two, [family.large(1), family.small(2)], None),
        (family.two, [family.large(3), family.large(4)], {"budget": family.wide}),
        (family.one, [family.large(5)], OFF),
        (family.text_only, [], None),
    ]


ARRIVALS = {0: [0], 2: [1, 2], 5: [3, 4]}
"""Engine step -> the requests of ``arrival_cases`` added before it."""


def arrival_cases(family: Family) -> list[tuple]:
    """Requests arriving while others decode: pruned at the engine's and at smaller budgets, unpruned,
    text-only."""
    two, one = NARROW
    return [
        (family.one, [family.large(10)], None),
        (family.two, [family.small(11), family.large(12)], {"budget": two}),
        (family.one, [family.large(13)], OFF),
        (family.text_only, [], None),
        (family.one, [family.small(14)], {"budget": one}),
    ]


def expected(family: Family, path: Path, case: tuple, tokens: int = ANSWER_TOKENS) -> list[int]:
    """``priortr.apply``'s greedy answer to ``case`` on the family's checkpoint."""
    prompt, images, budget = case
    return hf_tokens(path, prompt, images, apply_settings(family.settings, images, budget), tokens)


def answers(outs: list) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in outs]


def check_step(llm: LLM, family: Family, path: Path) -> None:
    """``step_cases`` in one step of ``llm``: the served prompt lengths are the row's (they show which
    prompts were pruned) and every answer is ``apply``'s."""
    cases = step_cases(family)
    outs = generate(llm, cases)
    assert [len(out.prompt_token_ids) for out in outs] == list(family.lengths)
    assert answers(outs) == [expected(family, path, case) for case in cases]


def serve(llm: LLM, cases: list[tuple], arrivals: dict[int, list[int]]) -> dict[int, list[int]]:
    """``cases`` (by index) arriving at the steps ``arrivals`` names; each one's answer."""
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0, ignore_eos=True)
    requests = {index: vllm_request(*case) for index, case in enumerate(cases)}
    return run_arrivals(llm.llm_engine, requests, arrivals, params)


def record_pruned_steps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(tokens embedded, rows handed in) of every step that runs a pruned prefill, from now on; each
    such step's hidden states are checked to keep the length handed in (padding rows included)."""
    stock = models.run_step
    seen: list[tuple[int, int]] = []

    def recording(model: Any, step: Any, positions: Any, inputs_embeds: Any, injected: Any) -> Any:
        seen.append((len(step.input_ids), inputs_embeds.shape[0]))
        out = stock(model, step, positions, inputs_embeds, injected)
        assert out.shape[0] == inputs_embeds.shape[0]  # the hidden states keep the padded length
        return out

    monkeypatch.setattr(models, "run_step", recording)
    return seen


PADDED_ARRIVALS = {0: [0], 2: [1, 2]}
"""Engine step -> the requests of ``padded_cases`` added before it: a pruned prefill alone, then a
text-only prompt and a two-image pruned prefill beside its decode."""


def padded_cases(family: Family) -> list[tuple]:
    """Pruned prompts (one image; two) and a text-only one, for steps padded as a GPU pads them."""
    return [
        (family.one, [family.large(10)], None),
        (family.text_only, [], None),
        (family.two, [family.large(11), family.small(12)], None),
    ]


def record_shortened_steps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """``record_pruned_steps`` for a method before the language model: (tokens embedded, rows handed
    in) of every step whose prompts ``pre_llm.shorten_prompts`` shortens."""
    stock = models.shorten_prompts
    seen: list[tuple[int, int]] = []

    def recording(model: Any, taps: Any, step: Any, positions: Any, inputs_embeds: Any) -> Any:
        if step.images:
            seen.append((len(step.input_ids), inputs_embeds.shape[0]))
        return stock(model, taps, step, positions, inputs_embeds)

    monkeypatch.setattr(models, "shorten_prompts", recording)
    return seen


def check_padded_serving(
    llm: LLM, family: Family, path: Path, monkeypatch: pytest.MonkeyPatch, before_llm: bool = False
) -> None:
    """``padded_cases`` served with every step padded to vLLM 0.34's Hopper capture sizes
    (``runners.pad_steps``): at least one pruned prefill ran in a step with padding rows, and every
    answer is ``apply``'s. ``before_llm``: the method prunes before the language model."""
    padded = pad_steps(monkeypatch, GRIDS["hopper"])
    pruned = (record_shortened_steps if before_llm else record_pruned_steps)(monkeypatch)
    cases = padded_cases(family)
    results = serve(llm, cases, PADDED_ARRIVALS)
    assert any(step.size > step.tokens for step in padded)
    assert any(rows > tokens for tokens, rows in pruned)  # a pruned prefill met padding rows
    for index, case in enumerate(cases):
        assert results[index] == expected(family, path, case), index


def preemption_engine(family: Family, path: Path, step_tokens: int) -> LLM:
    """An engine whose KV cache, 4 blocks of 32 tokens (3 usable), cannot hold four two-image prompts
    decoding ``PREEMPTED_TOKENS`` each, so that vLLM preempts and re-prefills; ``step_tokens`` is its
    step's token budget (96: a re-prefill in one step)."""
    return LLM(
        model=str(path),
        hf_overrides=family.overrides(),
        limit_mm_per_prompt=family.limits,
        num_gpu_blocks_override=4,
        disable_log_stats=False,
        block_size=32,
        **{**ENGINE, "max_model_len": 96, "max_num_batched_tokens": step_tokens},
    )


def record_schedule(engine: LLM, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """The tokens vLLM's scheduler gives each request in each step of ``engine``, by request id, as it
    runs."""
    scheduler = engine.llm_engine.engine_core.engine_core.scheduler
    scheduled: dict[str, list[int]] = {}
    schedule = scheduler.schedule

    def recording(*args: Any, **kwargs: Any) -> Any:
        out = schedule(*args, **kwargs)
        for name, count in out.num_scheduled_tokens.items():
            scheduled.setdefault(name, []).append(count)
        return out

    monkeypatch.setattr(scheduler, "schedule", recording)
    return scheduled


def cut_after_a_full_step(scheduled: dict[str, list[int]], step: int) -> list[str]:
    """The requests whose prefill was cut: a step of ``step`` tokens, then more than one token."""
    return [name for name, runs in scheduled.items() if any(a == step and b > 1 for a, b in pairwise(runs))]


class FamilyContract:
    """The scenarios every served family must pass; a subclass ``TestX`` names its row of ``FAMILIES``
    in ``family`` and adds the family's own tests, which share the class's engine (``llm``)."""

    family: ClassVar[str]

    @pytest.fixture(scope="class")
    @classmethod
    def row(cls) -> Family:
        return FAMILIES[cls.family]

    @pytest.fixture(scope="class")
    @classmethod
    def path(cls, row: Family, request: pytest.FixtureRequest) -> Path:
        """The family's tiny checkpoint."""
        return request.getfixturevalue(row.fixture)

    @pytest.fixture(scope="class")
    @classmethod
    def llm(cls, row: Family, path: Path) -> Any:
        """The class's engine: the family's settings, two images per prompt."""
        engine = LLM(
            model=str(path),
            hf_overrides=row.overrides(),
            limit_mm_per_prompt=row.limits,
            **row.engine,
            **ENGINE,
        )
        yield engine
        del engine

    @pytest.fixture(params=list(GRIDS))
    def padded_steps(
        self, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
    ) -> list[PaddedStep]:
        """Every step of the engine's runner padded as a GPU with each of vLLM 0.34's capture grids pads
        it (``runners.pad_steps``), which the CPU build never does; the steps, as they run."""
        return pad_steps(monkeypatch, GRIDS[request.param])

    @pytest.fixture
    def pruned_steps(self, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
        """(tokens embedded, rows handed in) of every step that runs a pruned prefill."""
        return record_pruned_steps(monkeypatch)

    def test_one_step_of_images_text_budgets_and_pruning_off(self, llm, row, path):
        """One image, two sharing the budget, two at a per-request budget, an unpruned image and a
        text-only prompt in one step: each answers as apply does, the prompts shortened to text + K."""
        assert llm.apply_model(type) == [row.plug_in]
        assert llm.llm_engine.model_config.architectures == [row.architecture]
        cases = step_cases(row)
        outs = generate(llm, cases)
        for index, (case, answer) in enumerate(zip(cases, answers(outs), strict=True)):
            assert answer == expected(row, path, case), index
        assert tuple(len(out.prompt_token_ids) for out in outs) == row.lengths
        for case, offset, ids in row.layouts:
            assert tuple(outs[case].prompt_token_ids[offset : offset + len(ids)]) == ids, case
        for case, answer in zip(cases[:3], answers(outs)[:3], strict=True):  # pruning changed the answers
            assert answer != hf_tokens(path, *case[:2], None, ANSWER_TOKENS)

    def test_requests_arriving_while_others_decode(self, llm, row, path):
        cases = arrival_cases(row)
        results = serve(llm, cases, ARRIVALS)
        for index, case in enumerate(cases):
            assert results[index] == expected(row, path, case), index

    def test_wrong_decode_offset_is_caught(self, llm, row, path, monkeypatch):
        """Negative control: decoding one position off the original positions changes the answer."""
        shift_decode_offset(monkeypatch)
        case = step_cases(row)[0]
        assert answers(generate(llm, [case])) != [expected(row, path, case)]

    def test_skipped_kv_rewrite_is_caught(self, llm, row, path, monkeypatch):
        """Negative control: leaving layers 0..L's cache without the kept tokens' keys/values changes
        the answer."""
        skip_kv_rewrite(monkeypatch)
        case = step_cases(row)[1]
        assert answers(generate(llm, [case])) != [expected(row, path, case)]

    def test_stock_requests_stay_exact_when_padded(self, llm, row, path, padded_steps, pruned_steps, request):
        """The padding emulation's check: unpruned and text-only requests (vLLM's own forward) answer
        as HF does with every step padded."""
        cases = [(row.one, [row.large(0)], OFF), (row.text_only, [], None), (row.one, [row.small(1)], OFF)]
        results = serve(llm, cases, {0: [0], 2: [1, 2]})
        assert any(step.size > step.tokens for step in padded_steps)
        if RUNNER == "v2" and request.node.callspec.params["padded_steps"] == "hopper":
            # uniform decodes of 3 requests run as 4 (SM100's grid has every count up to 6)
            assert any(step.decode and step.slots > step.requests for step in padded_steps)
        assert not pruned_steps
        for index, case in enumerate(cases):
            assert results[index] == expected(row, path, case), index

    def test_pruned_requests_stay_exact_when_padded(
        self, llm, row, path, padded_steps, pruned_steps, record_property
    ):
        """Pruned prefills beside decodes, text-only and unpruned prompts, in padded steps."""
        cases = [
            (row.one, [row.large(10)], None),
            (row.one, [row.small(11)], None),
            (row.text_only, [], None),
            (row.one, [row.large(12)], OFF),
            (row.one, [row.large(13)], {"budget": NARROW[1]}),
        ]
        results = serve(llm, cases, {0: [0], 2: [1, 2, 3], 5: [4]})
        assert len(pruned_steps) >= 2  # requests 0 and 4; 1 keeps all of a 4-token Qwen image
        sizes = {step.tokens: step.size for step in padded_steps if not step.decode}
        assert all(rows == sizes[tokens] for tokens, rows in pruned_steps)  # the grid's size reached them
        held = sum(rows > tokens for tokens, rows in pruned_steps)
        record_property("padded steps holding a pruned prefill", held)
        assert held >= 1
        for index, case in enumerate(cases):
            assert results[index] == expected(row, path, case), index

    @pytest.mark.last_in_class
    def test_preemption_by_recompute_is_exact(self, row, path, monkeypatch):
        """A KV cache of 4 blocks of 32 tokens (3 usable) cannot hold four two-image prompts decoding 40
        tokens each: vLLM preempts and re-prefills prompt + generated tokens in one step (never cut
        after its prompt: a step holds it whole); the scores must use the prompt's rows only, as they
        did the first time."""
        engine = preemption_engine(row, path, step_tokens=96)
        scheduled = record_schedule(engine, monkeypatch)
        cases = [(row.two, [row.small(20 + i), row.small(30 + i)], None) for i in range(4)]
        outs = generate(engine, cases, tokens=PREEMPTED_TOKENS)
        stats = engine.llm_engine.get_metrics()
        for case, answer in zip(cases, answers(outs), strict=True):
            assert answer == expected(row, path, case, PREEMPTED_TOKENS)
        preempted = [metric for metric in stats if metric.name == "vllm:num_preemptions"]
        assert preempted and preempted[0].value > 0, "the cache was large enough: nothing was preempted"
        assert not cut_after_a_full_step(scheduled, 96)
        del engine
