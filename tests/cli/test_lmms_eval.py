"""The lmms-eval plug-in (``--model priortr``) on the tiny local LLaVA checkpoint; offline, CPU.

Skipped without the ``eval`` extra. The random-weight model's answers are noise, so accuracy is never
asserted, only that every request type runs, the results are complete and the pruning statistics hold.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lmms_eval")

from lmms_eval.api.instance import GenerationResult, Instance
from PIL import Image
from transformers import AutoModelForImageTextToText

from priortr.frontend.prompts import prompt_text
from priortr.integrations.lmms_eval.model import PADDING_KEY, PriorTRLMMs, cut_at_stop
from tests.helpers.lmms import BUDGET, N_VISUAL, TASK_DIR, lmms_eval_command
from tests.helpers.lmms_task.utils import CHOICES, RECORDS, write_local_dataset


def test_manifest_resolves_model_priortr() -> None:
    from lmms_eval import models

    assert models.get_model("priortr") is PriorTRLMMs


def test_priortr_imports_without_lmms_eval() -> None:
    code = "import sys, priortr, priortr.cli; assert 'lmms_eval' not in sys.modules, 'lmms_eval imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_lmms_eval_cli_runs_both_request_types_with_budget_4(checkpoint: Path, tmp_path: Path) -> None:
    data = write_local_dataset(tmp_path / "data").parent
    out = tmp_path / "out"
    env = os.environ | {
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    args = [
        "--model",
        "priortr",
        "--model_args",
        f"pretrained={checkpoint},method=priortr,budget={BUDGET},layer=1",
        "--tasks",
        "priortr_local_gen,priortr_local_mc",
        "--include_path",
        str(TASK_DIR),
        "--batch_size",
        "2",
        "--output_path",
        str(out),
        "--log_samples",
    ]
    # the task YAMLs read priortr_local.jsonl from the working directory
    run = subprocess.run(
        [*lmms_eval_command(), *args], cwd=data, env=env, capture_output=True, text=True, timeout=600
    )
    log = run.stdout[-4000:] + run.stderr[-8000:]
    assert run.returncode == 0, log
    # lmms-eval 0.7 exits 0 even when a task or the model fails, so the results file is the real check
    results_files = sorted(out.rglob("*_results.json"))
    assert len(results_files) == 1, log
    results = json.loads(results_files[0].read_text())
    gen, mc = results["results"]["priortr_local_gen"], results["results"]["priortr_local_mc"]
    assert 0.0 <= gen["exact_match,none"] <= 1.0, gen
    assert 0.0 <= mc["acc,none"] <= 1.0, mc
    throughput = results["throughput"]
    assert throughput["avg_kept_tokens"] == BUDGET, throughput
    assert throughput["avg_visual_tokens"] == N_VISUAL, throughput
    assert throughput["avg_budget"] == BUDGET, throughput
    assert throughput["avg_unpruned_requests"] == 0, throughput
    assert throughput["total_gen_tokens"] > 0, throughput

    samples = {
        task: [
            json.loads(line) for line in next(out.rglob(f"*_samples_{task}.jsonl")).read_text().splitlines()
        ]
        for task in ("priortr_local_gen", "priortr_local_mc")
    }
    assert len(samples["priortr_local_gen"]) == len(samples["priortr_local_mc"]) == len(RECORDS)
    for sample in samples["priortr_local_gen"]:
        assert isinstance(sample["filtered_resps"], str), sample
    for sample in samples["priortr_local_mc"]:
        # one (loss, is_greedy) per choice; lmms-eval picks the choice with the smallest value
        losses = [float(resp[0]) for resp in sample["filtered_resps"]]
        assert len(losses) == len(CHOICES) and all(loss > 0 for loss in losses), sample
        predicted = CHOICES[losses.index(min(losses))]
        assert sample["acc"] == float(predicted == sample["target"]), sample


# -- in-process checks of the request paths -------------------------------------------------------


@pytest.fixture(scope="module")
def lm(checkpoint: Path) -> PriorTRLMMs:
    model = PriorTRLMMs(
        pretrained=str(checkpoint), budget=BUDGET, layer=1, batch_size="2", dtype="float64", device="cpu"
    )
    model.task_dict = {"local": {"test": _docs()}}
    return model


@pytest.fixture(scope="module")
def stock(checkpoint: Path) -> torch.nn.Module:
    """The same checkpoint without pruning, for the prompt without an image."""
    return AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float64).eval()


def _docs() -> list[dict]:
    """Docs 0-3: one image each (different sizes); 4: no image (runs unpruned); 5: two images."""
    sizes = [(40, 30), (28, 28), (64, 48), (30, 40)]
    colours = [(220, 30, 30), (30, 30, 220), (30, 200, 30), (90, 90, 90)]
    docs = [{"images": [Image.new("RGB", size, colour)]} for size, colour in zip(sizes, colours, strict=True)]
    return [*docs, {"images": []}, {"images": [docs[0]["images"][0], docs[1]["images"][0]]}]


def _doc_to_visual(doc: dict) -> list[Image.Image]:
    return doc["images"]


# (context, continuation, doc): contexts and continuations of different lengths, so rows are padded
LL_REQUESTS = [
    ("what color is the image", " red", 0),
    ("describe this picture", " a red cat", 1),
    ("what is in the picture", " cat", 2),
    ("color", " blue blue", 3),
    ("what is in the image", " a cat", 4),
    ("what color", " red blue", 5),
    ("a cat", " red", 0),
]


def _instance(kind: str, args: tuple, doc_id: int) -> Instance:
    return Instance(kind, args, idx=0, metadata={"task": "local", "doc_id": doc_id, "repeats": 1})


def _by_hand(
    lm: PriorTRLMMs, stock: torch.nn.Module, context: str, continuation: str, images: list[Image.Image]
) -> tuple[float, bool]:
    """Sum of log-softmax of the continuation tokens as cached, pruned decoding reads them, batch 1: a
    pruned prefill of the prompt alone (the budget split over two images), then the continuation on
    its cache; the stock model in one pass for a prompt without images."""
    content = [{"type": "image", "image": image} for image in images] + [{"type": "text", "text": context}]
    prompt = lm.processor.apply_chat_template(
        [{"role": "user", "content": content}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    cont = torch.tensor([lm.tokenizer(continuation, add_special_tokens=False)["input_ids"]])
    inputs = dict(prompt)
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(torch.float64)
    seq, n = prompt["input_ids"].shape[1], cont.shape[1]
    with torch.inference_mode():
        if images:
            before = lm.handle.last
            prefill = lm.model(**inputs, use_cache=True)
            assert lm.handle.last is not before and lm.handle.last.kept.shape == (1, BUDGET)
            mask = torch.ones(1, seq + n, dtype=torch.long)
            rest = lm.model(input_ids=cont, attention_mask=mask, past_key_values=prefill.past_key_values)
            rows = torch.cat([prefill.logits[0, -1:], rest.logits[0, :-1]])  # row j predicts token j
        else:
            whole = torch.cat([prompt["input_ids"], cont], dim=1)
            rows = stock(input_ids=whole, attention_mask=torch.ones_like(whole)).logits[0, seq - 1 : -1]
    log_probs = torch.log_softmax(rows, dim=-1)
    total = float(log_probs.gather(1, cont[0][:, None]).sum())
    return total, bool((log_probs.argmax(dim=-1) == cont[0]).all())


def test_every_option_is_scored_on_the_kept_set_of_its_question(lm: PriorTRLMMs) -> None:
    """Before: each option was appended to the question inside the pruned prefill, counted as
    instruction, and scored on a kept set of its own."""
    images = lm.task_dict["local"]["test"][1]["images"]
    context, options = "describe this picture", [" red", " a red cat", " blue blue blue"]
    prompt = lm._encode([prompt_text(lm.processor, context, 1)], [images])
    with torch.inference_mode():
        lm.model(**prompt, use_cache=False)
    alone = lm.handle.last.kept[0]  # what a prefill of the question keeps
    lm._score([context] * 3, options, [images] * 3)  # the three options in one batch
    assert all(torch.equal(kept, alone) for kept in lm.handle.last.kept)
    for option in options:  # and each on its own
        lm._score([context], [option], [images])
        assert torch.equal(lm.handle.last.kept[0], alone)


@pytest.mark.filterwarnings("ignore::priortr.PruningSkippedWarning")
def test_loglikelihood_batch_2_matches_a_direct_pruned_forward(
    lm: PriorTRLMMs, stock: torch.nn.Module
) -> None:
    """Batches of rows with different visual-token counts, two images, or none (left unpruned)."""
    docs = lm.task_dict["local"]["test"]
    requests = [
        _instance("loglikelihood", (ctx, cont, _doc_to_visual, doc_id, "local", "test"), doc_id)
        for ctx, cont, doc_id in LL_REQUESTS
    ]
    results = lm.loglikelihood(requests)
    assert len(results) == len(LL_REQUESTS)
    assert all(isinstance(result, GenerationResult) for result in results)
    for (ctx, cont, doc_id), result in zip(LL_REQUESTS, results, strict=True):
        nll, greedy = result.text
        expected, expected_greedy = _by_hand(lm, stock, ctx, cont, docs[doc_id]["images"])
        # float64 padded batch vs batch 1: kernels and summation order differ (as in methods/test_methods.py)
        assert nll == pytest.approx(-expected, abs=1e-7), (ctx, cont)
        assert greedy == expected_greedy
    # a target given as a function of the doc (output_type: loglikelihood) scores the same
    by_function = _instance(
        "loglikelihood", (LL_REQUESTS[1][0], lambda doc: " a red cat", _doc_to_visual, 1, "local", "test"), 1
    )
    alone = lm.loglikelihood([by_function])[0].text  # a batch of its own: other padding, same score
    assert alone[0] == pytest.approx(results[1].text[0], abs=1e-7) and alone[1] == results[1].text[1]


@pytest.mark.filterwarnings("ignore::priortr.PruningSkippedWarning")
def test_generate_until_batch_2_matches_batch_1_in_order(lm: PriorTRLMMs) -> None:
    prompts = [("what color is the image", 0), ("describe this picture in a color", 1), ("cat", 2)]
    prompts += [("a", 3), ("what is in the image", 4), ("what color", 5)]

    def requests(gen_kwargs: dict) -> list[Instance]:
        return [
            _instance("generate_until", (ctx, gen_kwargs, _doc_to_visual, doc_id, "local", "test"), doc_id)
            for ctx, doc_id in prompts
        ]

    gen_kwargs = {"max_new_tokens": 5, "do_sample": False}
    batched = lm.generate_until(requests(gen_kwargs))
    assert lm.handle.last.kept.shape[1] == BUDGET
    lm.batch_size = 1
    try:
        single = [lm.generate_until([request])[0] for request in requests(gen_kwargs)]
    finally:
        lm.batch_size = 2
    assert batched == single
    assert all(isinstance(text, str) and 0 < len(text.split()) <= 5 for text in batched), batched
    assert gen_kwargs == {"max_new_tokens": 5, "do_sample": False}  # the task's kwargs are not consumed

    stop = batched[0].split()[-1]  # a stop string cuts every answer at its first occurrence
    stopped = lm.generate_until(requests({**gen_kwargs, "until": [stop]}))
    assert stopped == [cut_at_stop(text, [stop]).strip() for text in batched]
    assert stopped[0] != batched[0]


def test_cut_at_stop() -> None:
    assert cut_at_stop("a b\nc ASSISTANT: d", ["ASSISTANT:", "\n"]) == "a b"
    assert cut_at_stop("a b", []) == "a b"
    assert cut_at_stop("a b", [""]) == "a b"


def test_clse_runs_its_three_stages_in_the_plugin(checkpoint: Path) -> None:
    """``method=clse`` (a count budget names its schedule: 8 of 16 tokens keeps 13, 8, then 2)."""
    lm = PriorTRLMMs(pretrained=str(checkpoint), method="clse", budget=8, dtype="float64", device="cpu")
    lm.task_dict = {"local": {"test": _docs()}}
    request = _instance(
        "loglikelihood", ("what color is the image", " red", _doc_to_visual, 0, "local", "test"), 0
    )
    (result,) = lm.loglikelihood([request])
    assert math.isfinite(result.text[0])
    assert [stage.layer for stage in lm.handle.last.stages] == [0, 1, 2]
    assert (lm.handle.last.kept >= 0).sum().item() == 2


def test_unknown_model_arg_is_an_error(checkpoint: Path) -> None:
    with pytest.raises(TypeError, match=r"unknown model_args \['budgt'\]"):
        PriorTRLMMs(pretrained=str(checkpoint), budgt=4)


def _padding(request: Instance) -> Instance:
    """``request`` as lmms-eval copies it to even out the processes' shards."""
    return Instance(
        request.request_type, request.arguments, idx=0, metadata={**request.metadata, PADDING_KEY: True}
    )


def _never_called(doc: dict) -> list[Image.Image]:
    raise AssertionError("a padding request reached the model")


@pytest.mark.filterwarnings("ignore::priortr.PruningSkippedWarning")
def test_padding_requests_are_answered_without_running_the_model(lm: PriorTRLMMs) -> None:
    real = _instance(
        "generate_until", ("what color", {"max_new_tokens": 3}, _doc_to_visual, 0, "local", "test"), 0
    )
    pad = _padding(
        _instance("generate_until", ("a", {"max_new_tokens": 3}, _never_called, 1, "local", "test"), 1)
    )
    before = lm._stats["generate_until"].requests
    answers = lm.generate_until([pad, real, pad])
    assert answers[0] == answers[2] == "" and answers[1] == lm.generate_until([real])[0] != ""
    assert lm._stats["generate_until"].requests == before + 2  # the real request, twice

    scored = _instance("loglikelihood", ("color", " red", _doc_to_visual, 0, "local", "test"), 0)
    skipped = _padding(_instance("loglikelihood", ("color", " red", _never_called, 0, "local", "test"), 0))
    results = lm.loglikelihood([skipped, scored])
    assert math.isnan(results[0].text[0]) and results[0].text[1] is False
    assert results[1].text == lm.loglikelihood([scored])[0].text


def test_device_map_splits_the_model_and_scores_the_same(lm: PriorTRLMMs, checkpoint: Path) -> None:
    split = PriorTRLMMs(
        pretrained=str(checkpoint), budget=BUDGET, layer=1, batch_size="2", dtype="float64", device_map="auto"
    )
    split.task_dict = lm.task_dict
    requests = [
        _instance("loglikelihood", (ctx, cont, _doc_to_visual, doc_id, "local", "test"), doc_id)
        for ctx, cont, doc_id in LL_REQUESTS[:3]
    ]
    assert [r.text for r in split.loglikelihood(requests)] == [r.text for r in lm.loglikelihood(requests)]


def test_device_map_is_refused_under_data_parallel(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")  # as accelerate launch --num_processes 2 sets it
    with pytest.raises(
        ValueError, match=r"device_map=auto .* cannot be combined with 2 data-parallel processes"
    ):
        PriorTRLMMs(pretrained=str(checkpoint), device_map="auto")


def test_a_filelock_without_its_api_module_is_refused_before_loading(checkpoint: Path, monkeypatch) -> None:
    """filelock 4.3 removed ``filelock._api``, which lmms-eval 0.7's evaluator imports after building the
    model: the plug-in refuses such a filelock first, naming the fix (the installed one has it: the same
    construction goes past the check and fails only on the misspelt argument)."""
    with pytest.raises(TypeError, match="unknown model_args"):
        PriorTRLMMs(pretrained=str(checkpoint), budgt=4)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "filelock._api" else real(name, *a)
    )
    with pytest.raises(RuntimeError, match=r"filelock\._api.*pip install 'filelock<4\.3'"):
        PriorTRLMMs(pretrained=str(checkpoint), budgt=4)
