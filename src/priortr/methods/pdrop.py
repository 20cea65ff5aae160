"""PyramidDrop (Xing et al., "PyramidDrop: Accelerating Your Large Vision-Language Models via Pyramid
Visual Redundancy Reduction", CVPR 2025), and PriorTR's score inside its schedule.

The decoder is split into equal stages; at the end of each, the visual tokens the last instruction
token attends to least are dropped, each stage keeping a ratio lambda of the previous stage's tokens.
Authors' code: github.com/Cooperx521/PyramidDrop at 6444f304, ``llava/model/modeling_llama_pdrop.py``:
after decoder layer ``layer_idx`` with ``rank_layer = layer_idx + 1`` in ``layer_list`` (8/16/24 of
32), ``pdrop_rank_drop`` ranks with layer ``rank_layer`` (the first layer of the next stage): its
input norm, q/k projections and RoPE applied to ``layer_idx``'s output, the last prompt token's row
(``prompt_total_len - 1``), float32 softmax over every key, mean over heads, ``topk`` over the image
tokens. Here the stage scored at layer 7 ranks with the attention of layer 8 on its input
(``next_attention`` evidence), and its tokens are cut before layer 8 runs.
"""

from __future__ import annotations

from priortr.methods.priortr import priortr_score
from priortr.methods.registry import register_method
from priortr.methods.selection import Selection, StageInputs, top_k


def pyramid_stages(kept: int, n_visual: int, n_layers: int, stages: int = 4) -> list[tuple[int, int]]:
    """PyramidDrop's schedule (Xing et al., CVPR 2025): the decoder split into ``stages`` equal stages
    (layers 8 / 16 / 24 of 32 start stages 2-4), each keeping a ratio lambda of the previous stage's
    visual tokens, lambda = (K / N)^(1 / (stages - 1)) so that the last stage keeps K.

    Returns (0-indexed scored layer, tokens kept after it): the last layer of each stage is scored.
    """
    if stages < 2:
        raise ValueError("PyramidDrop needs at least 2 stages")
    kept = min(kept, n_visual)
    ratio = (kept / n_visual) ** (1 / (stages - 1))
    firsts = [n_layers * i // stages for i in range(1, stages)]
    counts = [round(n_visual * ratio**i) for i in range(1, stages - 1)] + [kept]
    return [(first - 1, count) for first, count in zip(firsts, counts, strict=True)]


@register_method(
    "pdrop",
    where="layers",
    needs=("next_attention",),
    schedule=pyramid_stages,
    summary="PyramidDrop: last instruction token's attention, several stages of geometric decay",
    source="PyramidDrop, Xing et al., CVPR 2025",
)
def _pdrop(inputs: StageInputs) -> Selection:
    """Each stage keeps the visual tokens the last prompt token attends to most in the next layer."""
    return top_k(inputs.attention.last, inputs.budget)


@register_method(
    "pdrop+priortr",
    where="layers",
    needs=("attention",),
    schedule=pyramid_stages,
    summary="PriorTR's score P*log(P/Q) at every stage of PyramidDrop's schedule",
    source="PriorTR (orthogonal to attention pruners, Sec. 1) in PyramidDrop's schedule (CVPR 2025)",
)
def _pdrop_priortr(inputs: StageInputs) -> Selection:
    """PyramidDrop's stages, each ranked by the prior-corrected score of Eq. (8)."""
    return top_k(priortr_score(inputs.attention), inputs.budget)
