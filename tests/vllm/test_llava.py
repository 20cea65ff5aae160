"""LLaVA-1.5 (1-D RoPE) served by vLLM with the plug-in: the family contract (``family_contract.py``)
and LLaVA's own checks, on one engine, against priortr.apply + HF generate()."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from priortr.engine import evidence
from tests.vllm.family_contract import FamilyContract, answers, expected
from tests.vllm.harness import ANSWER_TOKENS, generate
from tests.vllm.reference import LLAVA_PROMPT, hf_tokens, image

PROMPT = LLAVA_PROMPT.format("what is in the image")  # 9 text tokens


class TestLlava(FamilyContract):
    family = "llava"

    def test_image_embeddings_are_refused_when_pruned_and_served_when_not(self, llm):
        """The plug-in sizes an image from its pixels, so a pruned request sending image embeddings is
        refused in the front end (a ValueError, an HTTP 400 from the server) instead of failing the
        engine; the same embeddings with pruning off are served."""
        width = llm.llm_engine.model_config.hf_config.text_config.hidden_size
        embedded = {
            "prompt": PROMPT,
            "multi_modal_data": {"image": torch.randn(1, 16, width)},  # one image, the checkpoint's N = 16
        }
        params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0, ignore_eos=True)
        with pytest.raises(ValueError, match="image embeddings"):
            llm.generate([embedded], params, use_tqdm=False)
        off = {**embedded, "mm_processor_kwargs": {"priortr": {"enabled": False}}}
        out = llm.generate([off], params, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == ANSWER_TOKENS
        assert len(out.prompt_token_ids) == 9 + 16

    def test_evidence_a_row_at_a_time_matches_hf(self, llm, row, path, monkeypatch):
        """The step's attention evidence reduced one text row at a time (``evidence.RowAttention``, the
        chunk forced to one row) answers as HF + priortr.apply with the whole rows in one chunk."""
        chunks: list[slice] = []
        rows = evidence.RowAttention.rows

        def counted(self, chunk):
            chunks.append(chunk)
            return rows(self, chunk)

        monkeypatch.setattr(evidence, "ROW_CHUNK_ELEMENTS", 1)
        monkeypatch.setattr(evidence.RowAttention, "rows", counted)
        case = (PROMPT, [image(28, 2)], None)
        answer = answers(generate(llm, [case]))
        monkeypatch.undo()
        assert answer == [expected(row, path, case)]
        assert len(chunks) > 1 and all(chunk.stop - chunk.start == 1 for chunk in chunks)

    def test_adjacent_images_are_one_run_under_one_budget(self, llm, row, path):
        """Two images with no text between them (a raw prompt: LLaVA-1.5's llava-hf template writes
        ``<image>\\n`` per image) are one run of 2 x 16 tokens keeping 4 under one budget, as
        priortr.apply prunes them, in a step with a one-image request."""
        adjacent = (LLAVA_PROMPT.replace("<image>", "<image><image>").format("what is in the image"),)
        cases = [(*adjacent, [image(28, 40), image(28, 41)], None), (PROMPT, [image(28, 42)], None)]
        outs = generate(llm, cases)
        assert answers(outs) == [expected(row, path, case) for case in cases]
        assert len(outs[0].prompt_token_ids) == 9 + row.settings["budget"]  # one run's K, not K per image
        assert hf_tokens(path, *cases[0][:2], None, ANSWER_TOKENS) != answers(outs)[0]
