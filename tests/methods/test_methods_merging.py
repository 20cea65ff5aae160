"""Tests for the merging methods of priortr.methods: VisionZip, PruMerge(+), SparseVLM, PriorTR+Merging."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from priortr.methods.clustering import dpc_knn, kmeans
from priortr.methods.priortr import priortr_merge
from priortr.methods.prumerge import prumerge
from priortr.methods.recycling import recycle_counts, split_budget
from priortr.methods.scoring import Evidence
from priortr.methods.selection import Selection, StageInputs
from priortr.methods.sparsevlm import sparsevlm, sparsevlm_raters, sparsevlm_stages
from priortr.methods.value_checks import value_checks_enabled
from priortr.methods.visionzip import visionzip

METHODS: dict[str, Callable[..., Selection]] = {
    "visionzip": visionzip,
    "prumerge": prumerge,
    "prumerge_plus": lambda inputs: prumerge(inputs, plus=True),
    "sparsevlm": sparsevlm,
    "sparsevlm_in_budget": lambda inputs: sparsevlm(inputs, recycling="in_budget"),
    "sparsevlm_kmeans": lambda inputs: sparsevlm(inputs, clustering="kmeans"),
    "priortr_merge": priortr_merge,
    "priortr_merge_dpc": lambda inputs: priortr_merge(inputs, clustering="dpc_knn"),
}


def _random_inputs(budget: int = 12, batch: int = 2, n_visual: int = 40, seed: int = 0) -> StageInputs:
    """Every kind of evidence, random but valid, for B images of N visual tokens."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.rand(batch, 5, n_visual, generator=gen) / n_visual  # [B, R, N]
    valid = torch.ones(batch, 5, dtype=torch.bool)
    valid[-1, 3:] = False
    posterior = torch.rand(batch, n_visual, generator=gen) + 0.01
    prior = torch.rand(batch, n_visual, generator=gen) + 0.01
    return StageInputs(
        budget=budget,
        hidden=torch.randn(batch, n_visual, 8, generator=gen),
        attention=Evidence(
            prior=prior / prior.sum(-1, keepdim=True),
            posterior=posterior / posterior.sum(-1, keepdim=True),
            last=posterior / posterior.sum(-1, keepdim=True),
        ),
        text_rows=rows,
        text_valid=valid,
        text_embeddings=torch.randn(batch, 5, 8, generator=gen),
        text_after=valid,
        visual_embeddings=torch.randn(batch, n_visual, 8, generator=gen),
        vision_cls=torch.softmax(torch.randn(batch, n_visual, generator=gen), dim=-1),
        vision_keys=torch.randn(batch, 2, n_visual, 4, generator=gen),
        vision_cls_last=torch.softmax(torch.randn(batch, n_visual, generator=gen), dim=-1),
        vision_keys_last=torch.randn(batch, n_visual, 6, generator=gen),
        vision_features=torch.randn(batch, n_visual, 5, generator=gen),
    )


def _row(inputs: StageInputs, b: int) -> StageInputs:
    """Image ``b`` of ``inputs`` alone, as a batch of one."""
    evidence = inputs.attention
    return StageInputs(
        budget=inputs.budget,
        hidden=inputs.hidden[b : b + 1],
        attention=Evidence(
            evidence.prior[b : b + 1], evidence.posterior[b : b + 1], evidence.last[b : b + 1]
        ),
        text_rows=inputs.text_rows[b : b + 1],
        text_valid=inputs.text_valid[b : b + 1],
        text_embeddings=inputs.text_embeddings[b : b + 1],
        text_after=inputs.text_after[b : b + 1],
        visual_embeddings=inputs.visual_embeddings[b : b + 1],
        vision_cls=inputs.vision_cls[b : b + 1],
        vision_keys=inputs.vision_keys[b : b + 1],
        vision_cls_last=inputs.vision_cls_last[b : b + 1],
        vision_keys_last=inputs.vision_keys_last[b : b + 1],
        vision_features=inputs.vision_features[b : b + 1],
    )


def _merged(selection: Selection, hidden: torch.Tensor) -> torch.Tensor:
    """The survivors' states [B, K, D] the engine would compute (before the projector for a merge in
    ``features`` space, where ``hidden`` stands for the features)."""
    assert selection.merge is not None
    return selection.merge @ hidden.float()


def _replace(inputs: StageInputs, **changes: object) -> StageInputs:
    fields = {name: getattr(inputs, name) for name in inputs.__dataclass_fields__}
    return StageInputs(**{**fields, **changes})


# --- the contract, for every method ----------------------------------------------------------------


def _count(name: str, budget: int, n_visual: int = 40) -> int:
    """Survivors of a budget: K; K plus the recycled clusters for SparseVLM's default (the authors');
    K - 1 for VisionZip, whose [CLS] takes one of the authors' K slots."""
    if name in ("sparsevlm", "sparsevlm_kmeans"):
        return budget + recycle_counts(n_visual - budget, 0.3, 10)[1]
    return budget - 1 if name == "visionzip" else budget


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("budget", [1, 5, 12, 39])
def test_keeps_exactly_k_with_valid_merge_rows(name: str, budget: int) -> None:
    inputs = _random_inputs(budget=budget)
    if name == "visionzip" and budget == 1:
        with pytest.raises(ValueError, match=r"no patch once \[CLS\] takes its slot"):
            METHODS[name](inputs)
        return
    selection = METHODS[name](inputs)
    count = _count(name, budget)
    assert selection.indices.dtype == torch.int64
    assert tuple(selection.indices.shape) == (2, count)
    assert bool((selection.indices[:, 1:] > selection.indices[:, :-1]).all())
    if selection.merge is not None:
        merge = selection.merge
        assert merge.dtype == torch.float32 and tuple(merge.shape) == (2, count, 40)
        assert bool((merge >= 0).all())
        if selection.merge_space == "hidden":
            torch.testing.assert_close(merge.sum(-1), torch.ones(2, count))
        else:  # the authors' weights: the survivor itself with weight 1, plus what it absorbs
            assert bool((merge.sum(-1) >= 1).all())
        own = merge.gather(2, selection.indices[:, :, None]).squeeze(2)  # [B, K]
        assert bool((own > 0).all()), "every survivor must merge its own slot"


@pytest.mark.parametrize("name", METHODS)
def test_batch_equals_each_row_alone(name: str) -> None:
    inputs = _random_inputs()
    together = METHODS[name](inputs)
    for b in range(2):
        alone = METHODS[name](_row(inputs, b))
        torch.testing.assert_close(together.indices[b : b + 1], alone.indices, rtol=0, atol=0)
        assert (together.merge is None) == (alone.merge is None)
        if alone.merge is not None:
            torch.testing.assert_close(together.merge[b : b + 1], alone.merge)


@pytest.mark.parametrize("name", METHODS)
def test_deterministic_and_merges_something(name: str) -> None:
    inputs = _random_inputs(budget=12)
    first, second = METHODS[name](inputs), METHODS[name](inputs)
    assert torch.equal(first.indices, second.indices)
    assert first.merge is not None and torch.equal(first.merge, second.merge)
    rows_merging = (first.merge > 0).sum(-1) > 1  # [B, K]
    assert bool(rows_merging.any(dim=-1).all()), "each image should have at least one merged survivor"


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("budget", [40, 41, 1000])
def test_budget_at_least_n_keeps_every_token(name: str, budget: int) -> None:
    selection = METHODS[name](_random_inputs(budget=budget))
    assert torch.equal(selection.indices, torch.arange(40).expand(2, 40))
    assert selection.merge is None


@pytest.mark.parametrize("name", METHODS)
def test_half_precision_input_gives_the_float32_answer(name: str) -> None:
    inputs = _random_inputs()
    half = _replace(inputs, hidden=inputs.hidden.half())
    expected = METHODS[name](_replace(inputs, hidden=half.hidden.float()))
    got = METHODS[name](half)
    assert torch.equal(got.indices, expected.indices)
    torch.testing.assert_close(got.merge, expected.merge)


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("budget", [0, -3, 2.5, True])
def test_bad_budget_raises(name: str, budget: object) -> None:
    with pytest.raises(ValueError, match="budget"):
        METHODS[name](_replace(_random_inputs(), budget=budget))


# --- missing evidence and bad knobs ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "missing"),
    [
        (visionzip, "vision_cls"),
        (visionzip, "vision_keys"),
        (visionzip, "vision_features"),
        (prumerge, "vision_cls_last"),
        (prumerge, "vision_keys_last"),
        (prumerge, "vision_features"),
    ],
)
def test_vision_methods_without_cls_evidence_raise(method: Callable[..., Selection], missing: str) -> None:
    inputs = _replace(_random_inputs(), **{missing: None})
    with pytest.raises(ValueError, match=rf"{missing}.*no \[CLS\].*divprune"):
        method(inputs)


@pytest.mark.parametrize("missing", ["text_rows", "text_embeddings", "text_after", "visual_embeddings"])
def test_sparsevlm_without_its_evidence_raises(missing: str) -> None:
    with pytest.raises(ValueError, match=rf"inputs\.{missing} missing.*input_embeddings"):
        sparsevlm(_replace(_random_inputs(), **{missing: None}))


def test_sparsevlm_evidence_of_wrong_shape_raises() -> None:
    inputs = _random_inputs()
    with pytest.raises(ValueError, match=r"text_embeddings \[B, R, D\]"):
        sparsevlm(_replace(inputs, text_embeddings=inputs.text_embeddings[:, :3]))


def test_priortr_merge_without_attention_raises() -> None:
    with pytest.raises(ValueError, match=r"inputs\.attention"):
        priortr_merge(_replace(_random_inputs(), attention=None))


def test_priortr_merge_adaptive_without_text_rows_raises() -> None:
    with pytest.raises(ValueError, match="text_rows"):
        priortr_merge(_replace(_random_inputs(), text_valid=None), adaptive=True)


def test_image_without_valid_instruction_row_raises() -> None:
    inputs = _random_inputs()
    valid = inputs.text_valid.clone()
    valid[1] = False
    with pytest.raises(ValueError, match="image 1 has no valid instruction row"):
        priortr_merge(_replace(inputs, text_valid=valid), adaptive=True)


def test_vision_keys_of_wrong_shape_raise() -> None:
    inputs = _random_inputs()
    with pytest.raises(ValueError, match=r"vision_keys must be \[B, H, N, d\]"):
        visionzip(_replace(inputs, vision_keys=inputs.vision_keys[:, :, :10]))


@pytest.mark.parametrize(
    ("method", "knobs", "message"),
    [
        (visionzip, {"contextual_ratio": 1.5}, "contextual_ratio"),
        (visionzip, {"contextual_ratio": float("nan")}, "contextual_ratio"),
        (prumerge, {"neighbours": 0}, "neighbours"),
        (prumerge, {"adaptive": "yes"}, "True or False"),
        (sparsevlm, {"recycle_ratio": 0.0}, "recycle_ratio"),
        (sparsevlm, {"tokens_per_cluster": 0}, "tokens_per_cluster"),
        (sparsevlm, {"clustering": "agglomerative"}, "clustering"),
        (sparsevlm, {"recycling": "inside"}, "recycling"),
        (priortr_merge, {"adaptive": 1}, "adaptive"),
        (priortr_merge, {"clustering": "spectral"}, "clustering"),
    ],
)
def test_bad_knobs_raise(method: Callable[..., Selection], knobs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        method(_random_inputs(), **knobs)


# --- clustering helpers ---------------------------------------------------------------------------

# Three blobs of three points, interleaved; DPC-KNN's density uses the C = 3 nearest points, so each
# blob needs at least three.
BLOBS = torch.tensor(
    [[10.0, 0.0], [-10.0, 0.0], [0.0, 10.0], [10.5, 0.3], [-9.6, -0.2], [0.2, 9.7], [9.8, -0.4], [-10.1, 0.5],
     [-0.3, 10.4]]
)  # fmt: skip
BLOB_OF = [0, 1, 2, 0, 1, 2, 0, 1, 2]


def _partition(labels: torch.Tensor) -> set[frozenset[int]]:
    return {frozenset((labels == c).nonzero().flatten().tolist()) for c in labels.unique().tolist()}


@pytest.mark.parametrize("cluster", [kmeans, dpc_knn])
def test_clustering_recovers_separated_blobs(cluster: Callable[..., torch.Tensor]) -> None:
    expected = _partition(torch.tensor(BLOB_OF))
    assert _partition(cluster(BLOBS, 3)) == expected
    assert _partition(cluster(BLOBS, 2)) != expected  # negative control: two clusters cannot match


def test_kmeans_labels_start_from_point_zero() -> None:
    labels = kmeans(BLOBS, 3)
    assert labels[0] == 0 and labels.tolist() == BLOB_OF


@pytest.mark.parametrize("cluster", [kmeans, dpc_knn])
def test_clustering_never_leaves_a_cluster_empty(cluster: Callable[..., torch.Tensor]) -> None:
    identical = torch.ones(5, 3)
    labels = cluster(identical, 3)
    assert torch.bincount(labels, minlength=3).min() >= 1


@pytest.mark.parametrize("n_clusters", [0, 10, 2.0])
def test_clustering_rejects_bad_cluster_count(n_clusters: object) -> None:
    with pytest.raises(ValueError, match="n_clusters"):
        kmeans(BLOBS, n_clusters)


# --- recycling counts -----------------------------------------------------------------------------


def test_recycle_counts_follow_sparsevlm() -> None:
    assert recycle_counts(528, 0.3, 10) == (159, 16)  # int(528 * 0.3) + 1, int(159 / 10) + 1
    assert recycle_counts(396, 0.3, 10) == (119, 12)
    assert recycle_counts(0, 0.3, 10) == (0, 0)
    assert recycle_counts(2, 1.0, 1) == (2, 2)


def test_split_budget_examples() -> None:
    assert split_budget(576, 64, 0.3, 10) == (48, 16)
    assert split_budget(576, 192, 0.3, 10) == (180, 12)


@pytest.mark.parametrize("n_visual", [40, 576])
def test_split_budget_is_exact_and_keeps_the_most(n_visual: int) -> None:
    for budget in range(1, n_visual):
        kept, clusters = split_budget(n_visual, budget, 0.3, 10)
        assert kept + clusters == budget
        if kept > 0:
            assert clusters == recycle_counts(n_visual - kept, 0.3, 10)[1]
        if kept + 1 < budget:
            assert kept + 1 + recycle_counts(n_visual - kept - 1, 0.3, 10)[1] > budget


# --- VisionZip by hand ----------------------------------------------------------------------------

# Eight tokens. [CLS] attention makes 0 and 2 dominant; the remaining tokens 1, 3, 4, 5, 6, 7 (R = 6)
# with C = 2 contextual give step 3 and targets 1 and 5. Head-mean keys: 1 -> (1, 0), 5 -> (0, 1);
# 3 -> (1, 0.1) and 6 -> (0.9, 0.2) join 1; 4 -> (0.1, 1) and 7 -> (0.2, 0.9) join 5. Token 3's head 0
# alone, (0, 1), would send it to 5: the average over heads decides.
VZ_CLS = torch.tensor([[0.30, 0.05, 0.25, 0.04, 0.03, 0.02, 0.01, 0.10]])
VZ_HEAD0 = [[1, 0], [1, 0], [1, 0], [0, 1], [0.1, 1], [0, 1], [0.9, 0.2], [0.2, 0.9]]
VZ_HEAD1 = [[1, 0], [1, 0], [1, 0], [2, -0.8], [0.1, 1], [0, 1], [0.9, 0.2], [0.2, 0.9]]
VZ_KEYS = torch.tensor([[VZ_HEAD0, VZ_HEAD1]])  # [1, 2, 8, 2]
VZ_HIDDEN = torch.arange(8 * 3, dtype=torch.float32).reshape(1, 8, 3) ** 1.5


def _vz_inputs(budget: int = 4) -> StageInputs:
    return StageInputs(
        budget=budget, hidden=VZ_HIDDEN, vision_cls=VZ_CLS, vision_keys=VZ_KEYS, vision_features=VZ_HIDDEN
    )


def test_visionzip_dominant_and_contextual_groups_by_hand() -> None:
    selection = visionzip(_vz_inputs(), contextual_ratio=0.5, cls_takes_a_slot=False)
    assert selection.indices.tolist() == [[0, 1, 2, 5]]
    assert selection.merge_space == "features"
    h = VZ_HIDDEN[0]
    # the authors' contextual token: the target plus the mean of the tokens that joined it
    expected = torch.stack([h[0], h[1] + h[[3, 6]].mean(0), h[2], h[5] + h[[4, 7]].mean(0)])
    torch.testing.assert_close(_merged(selection, VZ_HIDDEN)[0], expected)
    assert selection.merge[0, 0].tolist() == [1, 0, 0, 0, 0, 0, 0, 0]  # dominant rows are one-hot
    mean_of_all = h[[1, 3, 6]].mean(0)  # negative control: the library's earlier average
    assert not torch.allclose(_merged(selection, VZ_HIDDEN)[0, 1], mean_of_all)


def test_visionzip_cls_takes_one_of_the_dominant_slots() -> None:
    # K = 4, C = 2: [CLS] + 1 dominant patch (0); the rest 1..7 in order, step 3: targets 1 and 4
    selection = visionzip(_vz_inputs(), contextual_ratio=0.5)
    assert selection.indices.tolist() == [[0, 1, 4]]


def test_visionzip_without_contextual_tokens_is_top_k_cls() -> None:
    selection = visionzip(_vz_inputs(), contextual_ratio=0.0, cls_takes_a_slot=False)
    assert selection.indices.tolist() == [[0, 1, 2, 7]]
    assert selection.merge is None
    assert visionzip(_vz_inputs(), contextual_ratio=0.0).indices.tolist() == [[0, 2, 7]]


def test_visionzip_default_split_is_53_plus_cls_plus_10_for_64() -> None:
    n_visual = 576
    cls = torch.linspace(1.0, 0.0, n_visual)[None]  # token i ranks i-th
    inputs = StageInputs(
        budget=64,
        hidden=torch.randn(1, n_visual, 4),
        vision_cls=cls,
        vision_keys=torch.ones(1, 1, n_visual, 2),
        vision_features=torch.randn(1, n_visual, 3),
    )
    kept = visionzip(inputs).indices[0].tolist()
    targets = [53 + 52 * i for i in range(10)]  # R = 523 remaining, step 523 // 10 = 52
    assert kept == list(range(53)) + targets


# --- PruMerge by hand -----------------------------------------------------------------------------

# Six tokens whose last-layer keys (all heads concatenated) are (x, y). [CLS] attention keeps 0 and 2.
# Nearest by key: 0 -> 4, 1 and 2 -> 3, 5.
PM_CLS = torch.tensor([[0.40, 0.10, 0.30, 0.05, 0.10, 0.05]])
PM_KEYS = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9], [0.95, 0.05], [0.2, 0.8]])[None]
PM_HIDDEN = torch.tensor([[[6.0, 0.0], [0.0, 12.0], [3.0, 3.0], [24.0, 0.0], [0.0, 36.0], [48.0, 6.0]]])


def _pm_inputs(budget: int, cls: torch.Tensor, keys: torch.Tensor, features: torch.Tensor) -> StageInputs:
    hidden = torch.randn(*features.shape[:2], 3)
    return StageInputs(
        budget=budget, hidden=hidden, vision_cls_last=cls, vision_keys_last=keys, vision_features=features
    )


def test_prumerge_neighbours_weighted_by_cls_attention_by_hand() -> None:
    selection = prumerge(_pm_inputs(2, PM_CLS, PM_KEYS, PM_HIDDEN), neighbours=2)
    assert selection.indices.tolist() == [[0, 2]]
    assert selection.merge_space == "features"
    h = PM_HIDDEN[0]
    centre_0 = h[0] + 0.10 * h[4] + 0.10 * h[1]  # the authors' x_i + sum_j a_j x_j, not normalised
    centre_2 = h[2] + 0.05 * h[3] + 0.05 * h[5]
    torch.testing.assert_close(_merged(selection, PM_HIDDEN)[0], torch.stack([centre_0, centre_2]))
    assert not torch.allclose(_merged(selection, PM_HIDDEN)[0, 0], centre_0 / 1.2)  # the earlier mean


def _outlier_cls(n_outliers: int) -> torch.Tensor:
    """Twelve tokens: ``n_outliers`` with high [CLS] attention at the end, the rest equal."""
    cls = torch.full((12,), 0.02)
    cls[12 - n_outliers :] = torch.linspace(0.5, 0.3, n_outliers)
    return cls


def test_prumerge_adaptive_keeps_the_iqr_outliers_whatever_the_budget() -> None:
    inputs = _pm_inputs(5, _outlier_cls(2)[None], torch.randn(1, 12, 4), torch.randn(1, 12, 3))
    assert prumerge(inputs, adaptive=True).indices.tolist() == [[10, 11]]
    assert prumerge(inputs).indices.shape[1] == 5  # negative control: the fixed budget keeps K


def test_prumerge_adaptive_with_different_counts_per_image_raises() -> None:
    cls = torch.stack([_outlier_cls(2), _outlier_cls(3)])
    inputs = _pm_inputs(5, cls, torch.randn(2, 12, 4), torch.randn(2, 12, 3))
    with pytest.raises(ValueError, match="one per batch"):
        prumerge(inputs, adaptive=True)


def test_prumerge_plus_fixed_budget_adds_evenly_spaced_tokens() -> None:
    cls = torch.full((1, 16), 0.01)
    cls[0, 0], cls[0, 5] = 0.5, 0.4
    inputs = _pm_inputs(8, cls, torch.randn(1, 16, 4), torch.randn(1, 16, 3))
    # ceil(8 / 4) = 2 by [CLS] (0, 5); 6 more at positions floor((i + 0.5) * 14 / 6) of the other 14 tokens
    assert prumerge(inputs, plus=True).indices.tolist() == [[0, 2, 4, 5, 7, 10, 12, 14]]


def test_prumerge_plus_adaptive_adds_the_authors_grid() -> None:
    inputs = _pm_inputs(5, _outlier_cls(2)[None], torch.randn(1, 12, 4), torch.randn(1, 12, 3))
    # outliers 10, 11: ratio 2 / 12, int(int(1 / ratio) / 3) = 2: grid arange(0, 11, 2), 10 already kept
    assert prumerge(inputs, adaptive=True, plus=True).indices.tolist() == [[0, 2, 4, 6, 8, 10, 11]]


def test_prumerge_plus_grid_stops_before_the_last_token() -> None:
    """The authors' grid is ``arange(0, 575, step)`` for 576 tokens: the last token is never a grid
    token, even when the step divides N - 1 (one outlier of 16: stride int(16 / 3) = 5, 15 = 3 * 5)."""
    cls = torch.full((1, 16), 0.01)
    cls[0, 7] = 0.9
    inputs = _pm_inputs(5, cls, torch.randn(1, 16, 4), torch.randn(1, 16, 3))
    assert prumerge(inputs, adaptive=True, plus=True).indices.tolist() == [[0, 5, 7, 10]]


# --- SparseVLM and PriorTR+Merging by hand ----------------------------------------------------------

# Ten tokens in two obvious groups of hidden states: {2, 4, 6, 8} near (10, 0), {0, 3, 5, 7, 9} near
# (-10, 0) (token 0 only matters for PriorTR+Merging), token 1 anywhere.
HIDDEN = torch.tensor(
    [[-10.2, 0.3], [0.0, 5.0], [10.0, 0.0], [-10.0, 0.0], [10.4, 0.4], [-9.5, -0.5], [9.7, -0.3],
     [-10.3, 0.2], [10.1, 0.6], [-9.8, 0.1]]
)[None]  # fmt: skip
RECYCLE_ALL = {"recycle_ratio": 1.0, "tokens_per_cluster": 5}  # K = 4 of 10: kept 2, clusters 2 of 8


def _text_inputs(rows: list[list[float]], budget: int, text: list[list[float]] | None = None) -> StageInputs:
    """One image: instruction rows' attention ``rows`` [R][N]; every visual input embedding is (1, 0),
    text input embeddings ``text`` [R][2] (default: all equal, so every row rates)."""
    text_rows = torch.tensor([rows])
    n_rows, n_visual = text_rows.shape[1:]
    valid = torch.ones(1, n_rows, dtype=torch.bool)
    return StageInputs(
        budget=budget,
        hidden=torch.randn(1, n_visual, 3, generator=torch.Generator().manual_seed(0)),
        text_rows=text_rows,
        text_valid=valid,
        text_embeddings=torch.tensor([text or [[0.0, 0.0]] * n_rows]),
        text_after=valid,
        visual_embeddings=torch.tensor([[1.0, 0.0]]).expand(1, n_visual, 2),
    )


def test_sparsevlm_raters_by_hand() -> None:
    # m = mean over the image of softmax(visual . text): visual (1, 0) and (0, 1), text (2, 0), (0, 2),
    # (0, 0): m = (e^2 + 1, e^2 + 1, 2) / (2 (e^2 + 2)) = (0.447, 0.447, 0.106), mean 1/3: rows 0 and 1.
    visual = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    text = torch.tensor([[[2.0, 0.0], [0.0, 2.0], [0.0, 0.0]]])
    after = torch.ones(1, 3, dtype=torch.bool)
    assert sparsevlm_raters(text, after, visual).tolist() == [[True, True, False]]
    # Only rows after the image take part; with no row above the mean, all of them rate.
    after = torch.tensor([[False, True, True]])
    assert sparsevlm_raters(text, after, visual).tolist() == [[False, True, False]]
    equal = torch.zeros(1, 3, 2)
    assert sparsevlm_raters(equal, after, visual).tolist() == [[False, True, True]]


def test_sparsevlm_raters_are_chosen_from_the_input_embeddings() -> None:
    # Rows 0 and 1 carry the instruction's attention; row 2 is a weak row that prefers token 4. The
    # input embeddings make rows 0 and 1 the raters: m = (0.497, 0.497, 0.003), mean 1/3.
    rows = [[0.5, 0.1, 0.1, 0.1, 0.1, 0.1], [0.1, 0.5, 0.1, 0.1, 0.1, 0.1], [0.0, 0.0, 0.0, 0.0, 0.05, 0.0]]
    text = [[6.0, 0.0], [6.0, 0.0], [0.0, 0.0]]
    # K = 3 of 6: raters score 0, 1 at 0.3 and 2..5 at 0.1 (ties: lower index): kept 0, 1, 2; of the 3
    # pruned, int(0.9) + 1 = 1 is recycled as its own cluster, on top: 4 survivors.
    selection = sparsevlm(_text_inputs(rows, 3, text))
    assert selection.indices.tolist() == [[0, 1, 2, 3]]
    # Negative control: every row rating (equal text embeddings) keeps token 4 and recycles token 2.
    assert sparsevlm(_text_inputs(rows, 3)).indices.tolist() == [[0, 1, 2, 4]]
    # The budget-exact option fits the recycled cluster into K: kept 2 + 1 cluster.
    assert sparsevlm(_text_inputs(rows, 3, text), recycling="in_budget").indices.tolist() == [[0, 1, 2]]


@pytest.mark.parametrize("clustering", ["kmeans", "dpc_knn"])
def test_sparsevlm_recycles_pruned_tokens_into_cluster_means(clustering: str) -> None:
    scores = [[1.0, 0.9, 0.5, 0.45, 0.4, 0.35, 0.3, 0.25, 0.2, 0.15]]
    inputs = _replace(_text_inputs(scores, 4), hidden=HIDDEN)
    selection = sparsevlm(inputs, recycling="in_budget", clustering=clustering, **RECYCLE_ALL)
    assert selection.indices.tolist() == [[0, 1, 2, 3]]
    h = HIDDEN[0]
    expected = torch.stack([h[0], h[1], h[[2, 4, 6, 8]].mean(0), h[[3, 5, 7, 9]].mean(0)])
    torch.testing.assert_close(_merged(selection, HIDDEN)[0], expected)
    assert selection.merge[0, 1].tolist() == [0, 1, 0, 0, 0, 0, 0, 0, 0, 0]  # plainly kept: one-hot
    # The authors' default: the clusters come on top of K = 4 (kept 4, clusters 2 of the 6 pruned).
    on_top = sparsevlm(inputs, clustering=clustering, **RECYCLE_ALL)
    assert on_top.indices.shape[1] == 4 + 2


def _priortr_evidence() -> Evidence:
    """Token 0 is an attention sink (prior 0.91, posterior 0.3): the largest P but the lowest S."""
    prior = torch.tensor([[0.91] + [0.01] * 9])
    posterior = torch.tensor([[0.3, 0.2, 0.15] + [0.05] * 7])
    return Evidence(prior=prior, posterior=posterior, last=posterior)


def test_priortr_merge_ranks_by_prior_corrected_score_and_merges_clusters() -> None:
    inputs = StageInputs(budget=4, hidden=HIDDEN, attention=_priortr_evidence())
    selection = priortr_merge(inputs, **RECYCLE_ALL)
    # S ranks 1, 2 (kept), then 3..9 tied, then the sink 0; the 8 pruned form {0, 3, 5, 7, 9} (slot 3,
    # its highest S) and {4, 6, 8} (slot 4)
    assert selection.indices.tolist() == [[1, 2, 3, 4]]
    h = HIDDEN[0]
    expected = torch.stack([h[1], h[2], h[[3, 5, 7, 9, 0]].mean(0), h[[4, 6, 8]].mean(0)])
    torch.testing.assert_close(_merged(selection, HIDDEN)[0], expected)
    assert 0 not in selection.indices.tolist()[0]  # negative control: raw posterior would keep token 0 first


def _rank_inputs(rows_per_image: list[list[list[float]]], valid: list[list[bool]]) -> StageInputs:
    batch = len(rows_per_image)
    evidence = _priortr_evidence()
    return StageInputs(
        budget=3,
        hidden=HIDDEN.expand(batch, -1, -1),
        attention=Evidence(
            *(t.expand(batch, -1) for t in (evidence.prior, evidence.posterior, evidence.last))
        ),
        text_rows=torch.tensor(rows_per_image),
        text_valid=torch.tensor(valid),
    )


RANK_2 = [
    [0.2, 0.1, 0.0, 0.1, 0.0, 0.1, 0.0, 0.1, 0.0, 0.1],
    [0.0, 0.3, 0.2, 0.0, 0.1, 0.0, 0.1, 0.0, 0.1, 0.0],
]
RANK_2_ROWS = [*RANK_2, [a + b for a, b in zip(*RANK_2, strict=True)], [9.0] + [0.0] * 9]


def test_priortr_merge_adaptive_keeps_the_attention_rank() -> None:
    # Three valid rows of rank 2 (row 2 = row 0 + row 1); the invalid fourth row must be ignored.
    inputs = _rank_inputs([RANK_2_ROWS], [[True, True, True, False]])
    selection = priortr_merge(inputs, adaptive=True)
    # kept 2 (S: tokens 1, 2), then 8 pruned: int(8 * 0.3) + 1 = 3 candidates, 1 cluster: total 3
    assert selection.indices.shape[1] == 3
    assert {1, 2} <= set(selection.indices[0].tolist())
    counted_padding = priortr_merge(_rank_inputs([RANK_2_ROWS], [[True] * 4]), adaptive=True)
    assert counted_padding.indices.shape[1] == 4  # negative control: the fourth row raises the rank to 3


def test_priortr_merge_adaptive_with_different_totals_per_image_raises() -> None:
    inputs = _rank_inputs([RANK_2_ROWS, RANK_2_ROWS], [[True, True, True, False], [True] * 4])
    with pytest.raises(ValueError, match="one per batch"):
        priortr_merge(inputs, adaptive=True)


def test_priortr_merge_adaptive_ignores_the_budget() -> None:
    valid = [[True, True, True, False]]
    small, large = (
        priortr_merge(_replace(_rank_inputs([RANK_2_ROWS], valid), budget=k), adaptive=True) for k in (1, 9)
    )
    assert torch.equal(small.indices, large.indices)


# --- SparseVLM schedule ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("budget", "expected"),
    [
        (64, [(2, 66), (6, 30), (15, 17)]),
        (96, [(2, 238), (6, 48), (15, 26)]),
        (128, [(2, 303), (6, 110), (15, 36)]),
        (192, [(2, 300), (6, 200), (15, 110)]),
    ],
)
def test_sparsevlm_stages_published_for_llava_1_5_7b(budget: int, expected: list[tuple[int, int]]) -> None:
    assert sparsevlm_stages(budget, 576, 32) == expected


def test_sparsevlm_stages_scale_to_other_budgets_and_depths() -> None:
    assert sparsevlm_stages(128, 576, 40) == [(3, 303), (8, 110), (19, 36)]  # layers x 40 / 32
    assert sparsevlm_stages(256, 1152, 32) == [(2, 606), (6, 220), (15, 72)]  # same share, counts x 2
    stages = sparsevlm_stages(100, 300, 8)
    layers, counts = zip(*stages, strict=True)
    assert list(layers) == sorted(set(layers)) and max(layers) <= 6
    assert list(counts) == sorted(counts, reverse=True) and max(counts) <= 300 and min(counts) >= 1


def test_sparsevlm_stages_edge_cases() -> None:
    assert sparsevlm_stages(576, 576, 32) == []
    with pytest.raises(ValueError, match="at least 4 decoder layers"):
        sparsevlm_stages(64, 576, 3)
    with pytest.raises(ValueError, match="budget"):
        sparsevlm_stages(0, 576, 32)


def test_every_public_selector_cites_its_paper() -> None:
    for fn, venue in [(visionzip, "CVPR 2025"), (prumerge, "ICCV 2025"), (sparsevlm, "ICML 2025")]:
        assert venue in (fn.__doc__ or "")
    assert "PriorTR+Merging" in (priortr_merge.__doc__ or "")


def test_merge_space_decides_whether_rows_must_sum_to_one() -> None:
    """Hidden-space merges average (rows sum to 1); feature-space merges carry the authors' weights."""
    kept = torch.tensor([[0, 2]])
    weights = torch.tensor([[[1.0, 0.5, 0.0], [0.0, 0.0, 1.0]]])
    with value_checks_enabled(True):
        assert Selection(indices=kept, merge=weights, merge_space="features").merge_space == "features"
        with pytest.raises(ValueError, match="sum to 1"):
            Selection(indices=kept, merge=weights)
        with pytest.raises(ValueError, match="non-negative"):
            Selection(indices=kept, merge=-weights, merge_space="features")
    with pytest.raises(ValueError, match="merge_space must be one of"):
        Selection(indices=kept, merge=weights, merge_space="pixels")
