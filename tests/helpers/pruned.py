"""Reading a pruned run back against the references: which columns each stage hid, which logits rows
are real tokens, and a batch row run on its own."""

from __future__ import annotations

from typing import Any

import torch

import priortr
from tests.helpers.oracle import staged_reference
from tests.helpers.pruned_reference import pruned_reference
from tests.helpers.tiny import Batch

NEW_TOKENS = 4


def logits_atol(model) -> float:
    """How closely a pruned run's float64 logits must equal the reference's: 1e-10, or 1e-6 for Llama 4,
    whose stock layers compute RoPE, the q/k norms and every RMSNorm in float32 whatever the model's dtype,
    and for GLM-4.6V's MoE text model (``glm4v_moe_text``), whose RMSNorms and expert router do.
    Two float64 evaluations of one value (matrix products over different sequence lengths) differ by
    ~1e-16, which flips a float32 rounding now and then: ~1e-8 in the logits of the tiny model's random
    weights at transformers 5.17.0, where the same tokens are chosen."""
    types = {model.config.model_type, model.config.get_text_config().model_type}
    return 1e-6 if types & {"llama4", "glm4v_moe_text"} else 1e-10


def has_local_or_linear_layers(model) -> bool:
    """Whether the model has layers other than full attention (sliding-window, chunked or linear
    attention), which the masked reference does not model."""
    text = model.config.get_text_config()
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    return kinds != {"full_attention"} or getattr(text, "sliding_window", None) is not None


BIDIRECTIONAL_IMAGES = ("molmo2",)
"""Model types whose prefill mask lets image tokens attend to later ones in a model of full attention only
(Molmo2, given ``mm_token_type_ids``: every image token of a row is one bidirectional block), which the
causal masked reference does not model."""


def reference_for(model, stages, attention_mask):
    """The reference a pruned run of ``model`` is compared to: the staged masked reference
    (``tests.helpers.oracle``), or for models with local or linear-attention layers or bidirectional
    image blocks the reference that runs each layer on the pruned sequence with the mask transformers
    built (``tests.helpers.pruned_reference``); both agree on causal full attention
    (``tests/engine/test_pruned_reference.py``) and take the same inputs."""
    if has_local_or_linear_layers(model) or model.config.model_type in BIDIRECTIONAL_IMAGES:
        return pruned_reference(model, stages, attention_mask)
    return staged_reference(model, stages, attention_mask)


def stage_masks(batch: Batch, result: priortr.PruneResult) -> list[tuple[int, torch.Tensor]]:
    """(layer, [B, S] visual columns not kept after that stage) for ``oracle.staged_reference``."""
    visual = batch.visual_mask()
    return [(stage.layer, visual & ~stage.kept_mask(batch.seq_len)) for stage in result.stages]


def pruned_columns(batch: Batch, kept: torch.Tensor) -> torch.Tensor:
    """[B, S] True on visual columns that were not kept."""
    pruned = batch.visual_mask().clone()
    pruned.scatter_(1, kept, False)
    return pruned


def conversation(batch: Batch, history: torch.Tensor, mask: torch.Tensor) -> Batch:
    """The whole conversation so far (``history`` [B, S + T] ids, ``mask`` its attention mask) as one prompt
    with ``batch``'s images: a second turn's input."""
    extra = history.shape[1] - batch.seq_len
    mm = batch.mm_token_type_ids
    inputs = {  # the batch's other inputs; per-token ones (Gemma 3's token_type_ids) grow with the text
        key: torch.cat([value, value.new_zeros(value.shape[0], extra)], dim=1)
        if key == "token_type_ids"
        else value
        for key, value in batch.extra.items()
    }
    return Batch(
        history,
        mask,
        batch.pixel_values,
        batch.image_start,
        batch.image_end,
        batch.n_visual,
        image_grid_thw=batch.image_grid_thw,
        mm_token_type_ids=None if mm is None else torch.cat([mm, mm.new_zeros(mm.shape[0], extra)], dim=1),
        visual_ids=batch.visual_ids,
        extra=inputs,
    )


def kept_rows(values: torch.Tensor, result: priortr.PruneResult, batch: Batch):
    """``values`` [B, S, V] at the positions left after pruning, and which of them are real tokens
    (not left padding, not the padding of ragged rows)."""
    picked = values.gather(1, result.positions[..., None].expand(-1, -1, values.shape[-1]))
    return picked, batch.attention_mask.gather(1, result.positions).bool() & ~result.padding


def assert_matches_reference(model, batch, result, logits, out, **options: Any) -> None:
    """Prefill logits of real tokens and greedy generation (``out``, generated with ``options``) equal the
    staged masked reference; the stock model differs (so the comparison can fail)."""
    with reference_for(model, stage_masks(batch, result), batch.attention_mask), torch.no_grad():
        reference, real = kept_rows(model(**batch.kwargs()).logits, result, batch)
        expected = generate(model, batch, **options)
    torch.testing.assert_close(logits[real], reference[real], atol=logits_atol(model), rtol=0)
    assert torch.equal(out.sequences, expected.sequences)
    atol = logits_atol(model)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(expected.logits), atol=atol, rtol=0)
    with torch.no_grad():
        stock, _ = kept_rows(model(**batch.kwargs()).logits, result, batch)
    assert (stock[real] - logits[real]).abs().max() > 1e-6, "the stock model must differ"


def generate(model, batch: Batch, new_tokens: int = NEW_TOKENS, **options: Any):
    """Greedy ``generate`` of exactly ``new_tokens`` tokens, with its logits."""
    return model.generate(
        **batch.kwargs(),
        **options,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )


def row_alone(batch: Batch, row: int) -> dict:
    """Batch row ``row`` as its own unpadded batch of one.

    Qwen-VL packs every image's patches into one tensor (``image_grid_thw`` says how many each row
    has); a batch whose rows hold different image counts says them (``images_per_row``), one entry per
    image; every other input with a leading axis divisible by the batch size holds the same number of
    entries per row (the batches of ``tests.helpers.families`` give every row the same images). A batch
    that packs its rows' images otherwise gives each row's inputs (``row_inputs``).
    """
    if batch.row_inputs is not None:
        return batch.row_inputs[row]
    real = batch.attention_mask[row].bool()
    kwargs = batch.kwargs()
    out = {
        "input_ids": batch.input_ids[row, real][None],
        "attention_mask": batch.attention_mask[row, real][None],
    }
    if batch.image_grid_thw is not None:
        patches = batch.image_grid_thw.prod(dim=1).tolist()
        first = sum(patches[:row])
        out["pixel_values"] = batch.pixel_values[first : first + patches[row]]
        out["image_grid_thw"] = batch.image_grid_thw[row : row + 1]
    if batch.mm_token_type_ids is not None:  # one per token (Qwen-VL, Gemma 4): the row's real tokens
        out["mm_token_type_ids"] = batch.mm_token_type_ids[row, real][None]
    if "token_type_ids" in kwargs:  # one per token (Gemma 3): the row's real tokens
        out["token_type_ids"] = kwargs["token_type_ids"][row, real][None]
    images = batch.images_per_row
    for key, value in kwargs.items():
        if key in out or not isinstance(value, torch.Tensor):
            continue
        if images is not None and value.shape[0] == sum(images):
            out[key] = value[sum(images[:row]) : sum(images[: row + 1])]
            continue
        if value.shape[0] % batch.batch_size:
            continue
        per_row = value.shape[0] // batch.batch_size
        out[key] = value[row * per_row : (row + 1) * per_row]
    return out
