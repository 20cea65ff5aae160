"""Prefix caching and chunked prefill on (vLLM's defaults) with the plug-in, on LLaVA-1.5.

One engine with 32-token blocks and 80 tokens a step serves the module: a pruned request never reads
the prefix cache (vLLM's own hit counters show no lookup for it) and its prompt is scheduled in one
step (a spy on the scheduler's outputs), while text-only and unpruned requests hit the cache (blocks
a pruned request wrote among them) and are chunked, an image cut by a chunk or a hit included. Every
answer equals priortr.apply + Hugging Face generate() (greedy, float32). The negative controls turn
the plug-in's scheduler rules off in an engine of their own: the pruned prompt then reaches the model
in pieces.
"""

from __future__ import annotations

import pytest
from vllm import LLM, SamplingParams

from priortr.integrations.vllm import scheduler
from tests.helpers.checkpoint import WORDS
from tests.vllm.harness import run_arrivals
from tests.vllm.reference import ENGINE, hf_tokens, image, vllm_request

SETTINGS = {"method": "priortr", "budget": 4, "layer": 1}
TOKENS = 8
BLOCK = 32
STEP = 80
ENGINE_CACHED = {
    **ENGINE,
    "block_size": BLOCK,
    "max_num_batched_tokens": STEP,
    "disable_log_stats": False,
}
QUESTION = "what is in the image"


def words(count: int, first: int = 0) -> str:
    """``count`` words of the tiny tokenizer's vocabulary (one token each), from its ``first``."""
    return " ".join(WORDS[(first + i) % len(WORDS)] for i in range(count))


def prompt(before: str, question: str = QUESTION) -> str:
    """LLaVA's prompt with text before the image: <s> USER: + len(before) words, 16 image
    placeholders (K when pruned), then 7 tokens (\\n, five words, ASSISTANT:)."""
    return f"<s>USER: {before} <image>\n {question} ASSISTANT:"


SYSTEM = words(54)
"""54 words: 56 tokens before the image, one whole block and 24 tokens of the next."""


@pytest.fixture(scope="module")
def llm(llava_dir):
    engine = LLM(model=str(llava_dir), hf_overrides={"priortr": SETTINGS}, **ENGINE_CACHED)
    yield engine
    del engine


def request(text: str, seed: int | None, budget: dict | None = None) -> dict:
    """``text`` with one 28 x 28 image drawn from ``seed`` (none for None)."""
    return vllm_request(text, [] if seed is None else [image(28, seed)], budget)


def expected(llava_dir, case: dict, pruned: bool) -> list[int]:
    images = [case["multi_modal_data"]["image"]] if "multi_modal_data" in case else []
    return hf_tokens(llava_dir, case["prompt"], images, SETTINGS if pruned else None, TOKENS)


def cache_counts(llm: LLM) -> tuple[int, int]:
    """vLLM's prefix-cache counters so far: (tokens looked up, tokens hit)."""
    names = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
    found = {metric.name: metric.value for metric in llm.llm_engine.get_metrics() if metric.name in names}
    return int(found[names[0]]), int(found[names[1]])


def served(llm: LLM, case: dict) -> tuple[list[int], tuple[int, int], int]:
    """The greedy tokens of one request sent alone, the (queries, hits) it added, its prompt length."""
    before = cache_counts(llm)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    out = llm.generate([case], params, use_tqdm=False)[0]
    after = cache_counts(llm)
    counts = (after[0] - before[0], after[1] - before[1])
    return list(out.outputs[0].token_ids), counts, len(out.prompt_token_ids)


def test_repeated_requests_hit_the_cache_where_exact(llm, llava_dir):
    """A pruned request sent twice never looks the cache up; a text-only request hits the block of
    text it shares with the pruned one, then, sent again, its own two; an unpruned image request hits
    the first block, then, sent again, its own blocks up to the middle of its image (the step then
    runs the image's last 8 rows)."""
    pruned = request(prompt(SYSTEM), 0)
    for _ in range(2):
        tokens, counts, length = served(llm, pruned)
        assert tokens == expected(llava_dir, pruned, pruned=True)
        assert (counts, length) == ((0, 0), 56 + 4 + 7)
    text_only = request(f"<s>USER: {SYSTEM} {words(13)} ASSISTANT:", None)
    hits = []
    for _ in range(2):
        tokens, counts, length = served(llm, text_only)
        assert tokens == expected(llava_dir, text_only, pruned=False)
        assert length == 70
        hits.append(counts)
    assert hits == [(70, BLOCK), (70, 2 * BLOCK)]  # the pruned request's first block (text), then its own
    unpruned = request(prompt(SYSTEM), 0, {"enabled": False})
    hits = []
    for _ in range(2):
        tokens, counts, length = served(llm, unpruned)
        assert tokens == expected(llava_dir, unpruned, pruned=False)
        assert length == 56 + 16 + 7
        hits.append(counts)
    assert hits == [(79, BLOCK), (79, 2 * BLOCK)]  # the second block ends inside the image [56, 72)
    assert expected(llava_dir, pruned, pruned=True) != expected(llava_dir, unpruned, pruned=False)


def test_multi_turn_chat(llm, llava_dir):
    """Turn 2 is turn 1, its answer and a new question. Pruned, turn 2 is pruned afresh (its kept
    tokens are chosen by its own last rows, as priortr.apply on the whole chat chooses them) and reads
    no cache; unpruned, turn 2 hits turn 1's blocks, its image's included."""
    for budget, pruned in [(None, True), ({"enabled": False}, False)]:
        first = request(prompt(words(20, first=3)), 1, budget)
        tokens, counts, _ = served(llm, first)
        assert tokens == expected(llava_dir, first, pruned)
        answer = llm.get_tokenizer().decode(tokens, skip_special_tokens=True)
        assert "<image>" not in answer
        second = request(f"{first['prompt']} {answer}</s>USER: describe the cat ASSISTANT:", 1, budget)
        tokens, counts, length = served(llm, second)
        assert tokens == expected(llava_dir, second, pruned)
        if pruned:
            assert counts == (0, 0)
        else:
            assert counts[0] == length and counts[1] >= BLOCK


def test_chunked_prefill_keeps_a_pruned_prompt_whole(llm, llava_dir, monkeypatch):
    """Two unpruned prompts longer than a step are chunked (the first cut inside its image, its last
    20 rows leaving 60 of the next step for a pruned prompt of 67, which waits one step for room for
    all of it) and the pruned request decodes while the second is chunked; a text-only prompt is
    chunked too. The scheduler's outputs are recorded step by step."""
    core = llm.llm_engine.engine_core.engine_core
    steps: list[dict[str, int]] = []  # per step: tokens scheduled per request (vLLM suffixes the ids)
    schedule = core.scheduler.schedule

    def recording(*args, **kwargs):
        out = schedule(*args, **kwargs)
        steps.append({key.split("-")[0]: count for key, count in out.num_scheduled_tokens.items()})
        return out

    monkeypatch.setattr(core.scheduler, "schedule", recording)
    cases = {
        "long": request(prompt(words(75, first=5)), 2, {"enabled": False}),  # 77 + 16 + 7 tokens
        "pruned": request(prompt(words(54, first=7)), 3),  # 56 + 4 + 7 tokens
        "later": request(prompt(words(60, first=9)), 4, {"enabled": False}),  # 62 + 16 + 7 tokens
        "text": request(f"<s>USER: {words(90, first=11)} {QUESTION} ASSISTANT:", None),  # 98 tokens
    }
    arrivals = {0: ["long", "pruned"], 3: ["later", "text"]}
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    engine = llm.llm_engine
    results = run_arrivals(engine, cases, arrivals, params)
    for name, case in cases.items():
        assert results[name] == expected(llava_dir, case, pruned=name == "pruned"), name
    first = {name: next(s[name] for s in steps if name in s) for name in cases}
    assert first["long"] == STEP and first["pruned"] == 56 + 4 + 7  # "long" cut inside its image
    assert first["later"] < 62 + 16 + 7 and first["text"] < 98  # chunked too
    assert [name for name in ("long", "pruned") if name in steps[1]] == ["long"]  # 60 rows free of 67
    assert any("pruned" in s and "later" in s for s in steps)  # decoding while "later" is chunked


def test_pruned_prompt_longer_than_a_step_is_refused(llm):
    """56 + 4 + 7 fits a step of 80 tokens; with 20 more words before the image it does not, and the
    request is refused with the settings to change instead of waiting forever."""
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0)
    with pytest.raises(ValueError, match=r"this pruned prompt is 87 tokens where a step holds 80"):
        llm.generate([request(prompt(words(74)), 5)], params, use_tqdm=False)
    out = llm.generate([request(prompt(words(74)), 5, {"enabled": False})], params, use_tqdm=False)
    assert len(out[0].prompt_token_ids) == 76 + 16 + 7  # unpruned, it is chunked


@pytest.mark.parametrize("rule", ["prefix cache", "whole prompt"])
def test_without_the_scheduler_rules_a_pruned_prompt_arrives_in_pieces(llava_dir, monkeypatch, rule):
    """Negative controls, each in an engine of its own: a pruned request that may read the cache hits
    the block of text a first one wrote; one that may be chunked is cut where the step's budget ends.
    Either way its prompt reaches the model in pieces, which the model refuses."""
    if rule == "prefix cache":
        monkeypatch.setattr(scheduler, "pruned", lambda request: False)
        cases = [[request(prompt(SYSTEM), 6)], [request(prompt(SYSTEM), 7)]]
    else:
        monkeypatch.setattr(scheduler.PruningScheduler, "_splits_prompt", staticmethod(lambda *args: False))
        cases = [[request(prompt(words(75, first=5)), 2, {"enabled": False}), request(prompt(SYSTEM), 7)]]
    engine = LLM(model=str(llava_dir), hf_overrides={"priortr": SETTINGS}, **ENGINE_CACHED)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    with pytest.raises(RuntimeError, match="scheduled in pieces"):
        for batch in cases:
            engine.generate(batch, params, use_tqdm=False)
    del engine
