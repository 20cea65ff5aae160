"""SparseVLM at its defaults selects what the authors' code selects, on a tiny LLaVA of LLaVA-1.5's
geometry (576 visual tokens, 32 decoder layers), so the published schedule applies unscaled.

The reference below re-states the authors' algorithm (github.com/Gumpest/SparseVLMs at commit
26a5f48813c46cd1c7364160354e7fdd3febaa67, default ``USE_VERSION=1_0``), written for this test from
``llava/model/language_model/modelling_sparse_llama.py`` (``LlamaDynamicvitModel.forward``),
``score.py`` (``attn_postprocess_topk``, ``sparse_token_list_*``) and ``utils.py``
(``cluster_and_merge``). It reads the stock model's own tensors: the language model's input embeddings
(captured before decoder layer 0) choose the text raters once, and each pruning layer's eager attention
weights score the visual tokens.

The two harness rules that apply to every method (docs/methods.md) are applied here as well, because
the test compares inside the harness: kept tokens keep their original RoPE positions, and a recycled
cluster sits in the slot of its highest-scoring member (the authors renumber positions and append the
clusters after the kept visual tokens). Pruning is reproduced by masking (``tests/helpers/oracle.py``), merged
states by writing them into the scored layer's output.
"""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import torch
from transformers import LlavaForConditionalGeneration

import priortr
from tests.helpers.oracle import staged_reference
from tests.helpers.tiny import Batch, llava_batch, tiny_llava

SCHEDULE_64 = ((2, 66), (6, 30), (15, 17))  # score.py: pruning_loc 2/6/15, sparse_token_list_64


def _official_geometry_llava() -> LlavaForConditionalGeneration:
    """A random-weight LLaVA with 24 x 24 = 576 visual tokens and 32 decoder layers, float64, eager."""
    text = {"num_hidden_layers": 32, "max_position_embeddings": 1024}
    return tiny_llava(attn="eager", image_size=168, patch_size=7, text=text)


def _layers(model: LlavaForConditionalGeneration) -> torch.nn.ModuleList:
    return model.model.language_model.layers


def _official_raters(embeddings: torch.Tensor, start: int, n_visual: int) -> torch.Tensor:
    """``modelling_sparse_llama.py``, "Select Text Raters": every token after the image is a text
    token; m = softmax over the text of (visual embeddings @ text embeddings^T), averaged over the
    visual tokens; raters are the text tokens with m above its mean. Returns their offsets in the text."""
    visual = embeddings[start : start + n_visual]  # [N, D]
    text = embeddings[start + n_visual :]  # [T, D]
    relevance = (visual @ text.T).softmax(dim=1).mean(dim=0)  # [T]
    return torch.where(relevance > relevance.mean())[0]


def _official_cluster_and_merge(x: torch.Tensor, cluster_num: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``utils.py`` ``cluster_and_merge`` for one image (B = 1): DPC-kNN labels [M] and merged tokens
    [C, D]. Two mutual nearest neighbours have the same density whenever C = 2 (a point's k = C nearest
    are itself and its neighbour); the authors break such ties with uniform noise of 1e-6, i.e. at
    random, the library (and this re-statement) by the lower index: the one deviation here."""
    distance = torch.cdist(x, x) / x.shape[1] ** 0.5  # [M, M]
    nearest = torch.topk(distance, k=cluster_num, dim=-1, largest=False).values
    density = (-(nearest**2).mean(dim=-1)).exp()  # [M]
    rank = torch.empty(x.shape[0], dtype=torch.long)
    rank[torch.sort(density, descending=True, stable=True).indices] = torch.arange(x.shape[0])
    denser = (rank[None, :] < rank[:, None]).to(x.dtype)  # [M, M] j denser than i
    parent = (distance * denser + distance.max() * (1 - denser)).min(dim=-1).values
    centres = torch.topk(parent * density, k=cluster_num).indices  # [C]
    labels = distance[centres].argmin(dim=0)  # [M] nearest centre
    labels[centres] = torch.arange(cluster_num)
    counts = torch.zeros(cluster_num, dtype=x.dtype).index_add_(
        0, labels, torch.ones_like(labels, dtype=x.dtype)
    )
    weight = 1.0 / (counts + 1e-6)
    merged = torch.zeros(cluster_num, x.shape[1], dtype=x.dtype).index_add_(
        0, labels, x * weight[labels, None]
    )
    return labels, merged


def _forward(model, batch: Batch, masks, writes, capture: int | None):
    """Logits, and decoder layer ``capture``'s eager attention weights [H, S, S] and output, of a forward
    in which the masked columns are hidden after their stage and the merged states are written after
    theirs."""
    captured = {}

    def write(layer_idx):
        def hook(module, args, output):
            hidden = (output[0] if isinstance(output, tuple) else output).clone()
            positions, states = writes[layer_idx]
            hidden[0, positions] = states
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

        return hook

    def keep(module, args, output):
        captured["hidden"] = output[0] if isinstance(output, tuple) else output

    def keep_weights(module, args, output):
        captured["weights"] = output[1][0]  # eager attention returns (output, weights)

    with ExitStack() as stack, torch.no_grad():
        for layer_idx in writes:
            stack.callback(_layers(model)[layer_idx].register_forward_hook(write(layer_idx)).remove)
        if capture is not None:
            stack.callback(_layers(model)[capture].register_forward_hook(keep).remove)
            stack.callback(_layers(model)[capture].self_attn.register_forward_hook(keep_weights).remove)
        if masks:
            stack.enter_context(staged_reference(model, masks, batch.attention_mask))
        logits = model(**batch.kwargs()).logits
    return logits, captured.get("weights"), captured.get("hidden")


def _input_embeddings(model, batch: Batch) -> torch.Tensor:
    captured = {}

    def hook(module, args, kwargs):
        captured["embeddings"] = args[0] if args else kwargs["hidden_states"]

    handle = _layers(model)[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**batch.kwargs())
    finally:
        handle.remove()
    return captured["embeddings"][0]


def official_sparsevlm(model, batch: Batch, schedule, raters: torch.Tensor | None = None):
    """The authors' selection, stage by stage: [(layer, surviving positions)], and the logits.

    ``raters`` overrides the text raters (offsets into the text after the image) for negative controls.
    """
    start, n_visual = batch.image_start[0], batch.n_visual
    text_start = start + n_visual
    if raters is None:
        raters = _official_raters(_input_embeddings(model, batch), start, n_visual)
    alive = torch.arange(start, text_start)  # surviving visual slots, ascending
    visual = batch.visual_mask()
    masks, writes, stages = [], {}, []
    for layer, count in schedule:
        _, weights, hidden = _forward(model, batch, masks, writes, capture=layer)
        attention = weights.mean(dim=0)  # [S, S] head mean (attn_postprocess_topk)
        relation = attention[text_start + raters][:, alive].mean(dim=0)  # [n] raters' mean
        n = alive.numel()
        top = torch.topk(relation, min(count, n - 1)).indices
        selected = torch.zeros(n, dtype=torch.bool)
        selected[top] = True
        pruned = torch.where(~selected)[0]  # ascending, as torch.where(pred_score_vis == 0)
        candidates = pruned[torch.topk(relation[pruned], int(pruned.numel() * 0.3) + 1).indices]
        cluster_num = int(candidates.numel() / 10) + 1
        labels, merged = _official_cluster_and_merge(hidden[0, alive[candidates]], cluster_num)
        slots = torch.stack([alive[candidates[labels == c][0]] for c in range(cluster_num)])
        writes[layer] = (slots, merged)
        alive = torch.cat([alive[selected], slots]).sort().values
        survives = torch.zeros_like(visual)
        survives[0, alive] = True
        masks.append((layer, visual & ~survives))
        stages.append((layer, alive))
    logits, _, _ = _forward(model, batch, masks, writes, capture=None)
    return stages, logits


@pytest.fixture(scope="module")
def case():
    model = _official_geometry_llava()
    batch = llava_batch(model, text_after=(12,))
    return model, batch


def test_sparsevlm_default_equals_the_authors_selection(case):
    model, batch = case
    with priortr.apply(model, method="sparsevlm", budget=64) as handle, torch.no_grad():
        logits = model(**batch.kwargs()).logits
        result = handle.last
    stages, reference = official_sparsevlm(model, batch, SCHEDULE_64)
    assert [alive.numel() for _, alive in stages] == [82, 32, 18]  # recycled clusters on top of the count
    assert [stage.layer for stage in result.stages] == [layer for layer, _ in SCHEDULE_64]
    for stage, (_, alive) in zip(result.stages, stages, strict=True):
        assert stage.merged
        assert torch.equal(stage.kept[0], alive), stage.layer
    # Merged states included; the authors divide a cluster's sum by its count + 1e-6, the library
    # averages, hence the tolerance (without the writes the logits move by more than 1e-3).
    expected = reference[0, result.positions[0]]
    torch.testing.assert_close(logits[0], expected, atol=1e-6, rtol=0)


def test_rater_choice_is_observable(case):
    """Negative control: every text token as a rater (no choice) changes the authors' kept set, so the
    test above sees the raters; the raters are a strict subset of the text here."""
    model, batch = case
    start, n_visual = batch.image_start[0], batch.n_visual
    raters = _official_raters(_input_embeddings(model, batch), start, n_visual)
    n_text = batch.seq_len - start - n_visual
    assert 0 < raters.numel() < n_text
    official, _ = official_sparsevlm(model, batch, SCHEDULE_64[:1])
    everyone, _ = official_sparsevlm(model, batch, SCHEDULE_64[:1], raters=torch.arange(n_text))
    assert not torch.equal(official[0][1], everyone[0][1])


def test_budget_exact_option_keeps_the_schedule_counts(case):
    """``recycling='in_budget'``: the recycled clusters count inside each stage's count (the harness
    rule that K counts every visual token left), so the schedule's counts are the tokens alive."""
    model, batch = case
    options = {"recycling": "in_budget"}
    with priortr.apply(model, method="sparsevlm", budget=64, options=options) as handle, torch.no_grad():
        model(**batch.kwargs())
        result = handle.last
    assert [int((stage.kept[0] >= 0).sum()) for stage in result.stages] == [66, 30, 17]
