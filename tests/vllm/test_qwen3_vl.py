"""Qwen3-VL, dense and MoE (q/k norms, interleaved M-RoPE, DeepStack; the MoE's decoder layers 1-3 with
vLLM's sparse MoE blocks) served by vLLM with the plug-in: the family contract (``family_contract.py``)
and Qwen3-VL's own checks, on one engine per family, against priortr.apply + HF generate().

Each tiny checkpoint adds DeepStack features to the outputs of decoder layers 0 and 1, and the engine
scores layer 1: the last injection lands on every visual token before the cut, as in ``apply``; the
MoE's scored layer 1 is a MoE layer, run on the pruned prompt whole and on the step's other rows.
Negative controls drop the DeepStack features of the pruned prompt, and of the unpruned rows of a
pruned step, and the answers must then differ.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
from vllm.forward_context import get_forward_context
from vllm.model_executor.models.qwen3_moe import Qwen3MoeSparseMoeBlock

from priortr.integrations.vllm import served_families
from priortr.integrations.vllm import step as pruned_step
from tests.vllm.family_contract import OFF, FamilyContract, answers, expected, step_cases
from tests.vllm.harness import ANSWER_TOKENS, generate
from tests.vllm.reference import hf_tokens


class DeepStackChecks(FamilyContract):
    """Qwen3-VL's own checks, dense and MoE."""

    def test_pruned_prompt_without_deepstack_is_caught(self, llm, row, path, monkeypatch):
        """Negative control: the pruned prompt's layers 0..L run without its DeepStack features (its
        encoder rows cut to the embeddings); the answer must differ from apply's."""
        original = pruned_step.prefill_prompt

        def without_deepstack(model, prompt, inputs_embeds):
            width = inputs_embeds.shape[1]
            images = [(column, rows[:, :width]) for column, rows in prompt.images]
            return original(model, dataclasses.replace(prompt, images=images), inputs_embeds)

        monkeypatch.setattr(pruned_step, "prefill_prompt", without_deepstack)
        case = step_cases(row)[0]
        assert answers(generate(llm, [case])) != [expected(row, path, case)]

    def test_unpruned_rows_without_deepstack_are_caught(self, llm, row, path, monkeypatch):
        """Negative control: in a step with a pruned prompt, the other rows (an unpruned image) get no
        DeepStack features; that request's answer must differ from stock HF's."""
        original = served_families.PruningQwen3VL._step_injections  # still run: it clears vLLM's buffer
        monkeypatch.setattr(
            served_families.PruningQwen3VL, "_step_injections", lambda self, rows: original(self, rows)[:0]
        )
        pruned, unpruned = step_cases(row)[0], step_cases(row)[3]
        assert unpruned[2] == OFF
        outs = generate(llm, [pruned, unpruned])
        assert answers(outs)[1] != hf_tokens(path, *unpruned[:2], None, ANSWER_TOKENS)


class TestQwen3VL(DeepStackChecks):
    family = "qwen3-vl"


class TestQwen3VLMoe(DeepStackChecks):
    family = "qwen3-vl-moe"

    @pytest.mark.parametrize("hidden", [True, False])
    def test_moe_blocks_of_a_whole_prompt_see_no_padding_mask(self, llm, row, monkeypatch, hidden):
        """The step's padding mask (vLLM's ``is_padding``, which its GPU routers apply to the first rows
        of a MoE block's input; the CPU build's router ignores it, so this checks what the blocks are
        shown) is hidden while the pruned prompt runs whole (9 + 16 rows in a step of 9 + 6) and shown
        for the step's own rows. Negative control (``hidden`` False): without ``unpadded_rows`` the
        whole prompt's block gets the step's mask, shorter than its rows."""
        seen = []
        original = Qwen3MoeSparseMoeBlock.forward

        def recording(self, hidden_states):
            padding = get_forward_context().is_padding
            seen.append((hidden_states.shape[0], None if padding is None else padding.shape[0]))
            return original(self, hidden_states)

        monkeypatch.setattr(Qwen3MoeSparseMoeBlock, "forward", recording)
        if not hidden:
            monkeypatch.setattr(pruned_step, "unpadded_rows", contextlib.nullcontext)
        generate(llm, [step_cases(row)[0]], tokens=1)
        whole = (9 + 16, None) if hidden else (9 + 16, 9 + 6)
        rows = (9 + 6, 9 + 6)
        assert seen == [whole, rows, rows]  # layer 1 on the prompt, layers 2-3 on the step
