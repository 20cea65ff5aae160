"""The LLaVA-NeXT, LLaVA-OneVision and Video-LLaVA adapters against the stock transformers models: visual
items of every batch layout, AnyRes token counts, the image run's layout, the vision probe and what
``generate()`` hands the multimodal model.

Each check reads the model's own tensors or calls (hooks on the stock modules), so a transformers change to
any of these facts fails here first.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from packaging.version import Version

from priortr.adapters.llava_next import LlavaNextAdapter, LlavaOnevisionAdapter
from priortr.adapters.video_llava import VideoLlavaAdapter
from priortr.engine.attention import cls_attention
from tests.helpers.tiny import TEXT_HI, TEXT_LO, Batch
from tests.helpers.tiny_llava_family import (
    IMAGE_ID,
    RAGGED_SIZES,
    VIDEO_ID,
    anyres_pixels,
    feature_lengths,
    llava_next_batch,
    llava_next_ragged_batch,
    llava_onevision_batch,
    llava_onevision_multi_image_batch,
    llava_onevision_video_batch,
    video_llava_batch,
    video_llava_multi_image_batch,
    video_llava_video_batch,
)

ADAPTERS = {
    "llava-next": LlavaNextAdapter,
    "llava-onevision": LlavaOnevisionAdapter,
    "video-llava": VideoLlavaAdapter,
}
TEXT_BEFORE = 3  # the builders' rows: [bos, text x (3 + 2r), item, text x 2, item, ..., text x (6 + 2r)]

# builder -> (family, per-row items as (modality, visual tokens)); counts as the builders' docstrings derive
LAYOUTS = {
    llava_next_batch: ("llava-next", lambda r: [("image", 70)]),
    llava_next_ragged_batch: ("llava-next", lambda r: [("image", (70, 36, 66)[r])]),
    llava_onevision_batch: ("llava-onevision", lambda r: [("image", 44)]),
    llava_onevision_video_batch: ("llava-onevision", lambda r: [("video", 13)]),
    llava_onevision_multi_image_batch: ("llava-onevision", lambda r: [("image", 17), ("image", 17)]),
    video_llava_batch: ("video-llava", lambda r: [("image", 16)]),
    video_llava_video_batch: ("video-llava", lambda r: [("video", 34)]),
    video_llava_multi_image_batch: ("video-llava", lambda r: [("image", 16), ("video", 34)]),
}


def _expected_items(batch: Batch, layout) -> list[tuple[int, list[int], int, str]]:
    """(row, positions, separator, modality) from the builders' row layout, independent of the adapter."""
    expected = []
    for row in range(batch.batch_size):
        position = int((batch.attention_mask[row] == 0).sum()) + 1 + TEXT_BEFORE + 2 * row
        for modality, count in layout(row):
            expected.append((row, list(range(position, position + count)), position + count, modality))
            position += count + 2
    return expected


@pytest.mark.parametrize("make_batch", LAYOUTS, ids=lambda f: f.__name__)
def test_visual_items_are_the_placeholder_runs(models, make_batch):
    family, layout = LAYOUTS[make_batch]
    model = models[family]
    batch = make_batch(model, 3)
    items = ADAPTERS[family]().visual_items(model.config, batch.input_ids)
    found = [(i.row, i.positions.tolist(), i.separator, i.modality) for i in items]
    assert found == _expected_items(batch, layout)
    placeholder = {"image": IMAGE_ID, "video": VIDEO_ID}
    for item in items:
        assert (batch.input_ids[item.row, item.positions] == placeholder[item.modality]).all()
        assert TEXT_LO <= int(batch.input_ids[item.row, item.separator]) < TEXT_HI  # a text token
    covered = torch.zeros_like(batch.input_ids, dtype=torch.bool)
    for item in items:
        covered[item.row, item.positions] = True
    assert torch.equal(covered, batch.visual_mask())  # every placeholder is in exactly one item
    if batch.image_start:  # one run per row: the spans the shared suites read agree
        spans = list(zip(batch.image_start, batch.image_end, strict=True))
        assert [(int(i.positions[0]), i.separator) for i in items] == spans


def test_ragged_rows_differ_and_spans_are_empty(models):
    batch = llava_next_ragged_batch(models["llava-next"], 3)
    assert batch.visual_mask().sum(1).tolist() == [70, 36, 66]
    assert batch.image_start == batch.image_end == [] and batch.n_visual == 0


@pytest.mark.parametrize("family", ["llava-next", "llava-onevision"])
def test_anyres_token_count_matches_the_model(models, family):
    """``anyres_tokens`` (unpadding, newlines, OneVision's ``anyres_max`` downsampling) and ``anyres_crops``
    equal what ``get_image_features`` produces, over sizes of every aspect ratio."""
    model, adapter = models[family], ADAPTERS[family]()
    sizes = [*RAGGED_SIZES, (20, 150), (150, 20), (61, 33), (84, 84), (100, 50)]
    pixels = anyres_pixels(model, sizes, torch.Generator().manual_seed(0))
    truth = feature_lengths(model, pixel_values=pixels, image_sizes=torch.tensor(sizes))
    assert [adapter.anyres_tokens(model.config, *s) for s in sizes] == truth
    crops = [adapter.anyres_crops(model.config, *s) for s in sizes]
    assert max(crops) == pixels.shape[1] and len(set(truth)) > 5
    if family == "llava-onevision":  # 84 x 84: 3 x 3 tiles = 12 x 12 patches, over the cap: 5 x 5
        assert adapter.anyres_tokens(model.config, 84, 84) == 16 + 5 * 5 + 5


def test_llava_next_run_is_base_then_tile_rows_each_ending_in_a_newline(models):
    """The features scattered into a 40 x 60 image's 70-token run: the base crop's 16, then 6 unpadded
    rows of 8 tile patches, each followed by ``image_newline``; newlines are part of the run."""
    model = models["llava-next"]
    batch = llava_next_batch(model, 1)
    with torch.no_grad():
        features = model.model.get_image_features(
            batch.pixel_values, batch.extra["image_sizes"]
        ).pooler_output[0]  # [70, D]
    item = LlavaNextAdapter().visual_items(model.config, batch.input_ids)[0]
    assert features.shape[0] == item.size == 16 + 6 * (8 + 1)
    is_newline = (features == model.model.image_newline).all(-1)
    assert is_newline.nonzero().flatten().tolist() == [16 + 9 * row + 8 for row in range(6)]


def test_vision_probe_only_where_cls_maps_onto_the_tokens(models):
    """NeXT's CLIP has a [CLS] token but no 1:1 map (LLaVA-1.5's probe would wrongly accept it); SigLIP has
    none; Video-LLaVA's image_tower [CLS] row covers exactly an image's 16 tokens."""
    assert LlavaNextAdapter().vision_probe(models["llava-next"]) is None
    assert LlavaOnevisionAdapter().vision_probe(models["llava-onevision"]) is None
    model = models["video-llava"]
    probe = VideoLlavaAdapter().vision_probe(model)
    tower = model.model.image_tower
    attention = getattr(tower, "vision_model", tower).encoder.layers[0].self_attn  # feature layer -2 of 2
    assert probe.query_projection is attention.q_proj and probe.first_token == 1
    last = getattr(tower, "vision_model", tower).encoder.layers[-1].self_attn  # PruMerge's layer
    assert probe.last_query_projection is last.q_proj and probe.last_key_projection is last.k_proj
    assert probe.projector is model.model.multi_modal_projector and probe.width == attention.embed_dim
    captured = {}
    handles = [
        probe.query_projection.register_forward_hook(lambda m, a, out: captured.__setitem__("q", out)),
        probe.key_projection.register_forward_hook(lambda m, a, out: captured.__setitem__("k", out)),
    ]
    batch = video_llava_batch(model, 2)
    with torch.no_grad():
        model(**batch.kwargs())
    for handle in handles:
        handle.remove()
    cls, _ = cls_attention(captured["q"], captured["k"], probe.heads, probe.scaling, probe.first_token)
    assert cls.shape == (2, batch.n_visual)


@pytest.mark.parametrize(
    "family, make_batch",
    [
        ("llava-next", llava_next_ragged_batch),
        ("llava-onevision", llava_onevision_multi_image_batch),
        ("llava-onevision", llava_onevision_video_batch),
        ("video-llava", video_llava_multi_image_batch),
    ],
)
@pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.23"),
    reason="pins how 5.23's generate() pre-encodes images",
)
def test_generate_pre_encodes_and_passes_text_positions(models, family, make_batch):
    """What the multimodal model receives from ``generate()``: in prefill the whole prompt, the images and
    videos pre-encoded in ``mm_encoder_outputs`` (no pixels), position ids ``cumsum(mask) - 1`` (0 on
    padding) [B, S]; each decode step [B, 1], one past the last; a second turn on the returned cache only
    the unseen tokens, positions continuing over the whole conversation's mask. LLaVA-NeXT passes
    ``input_ids`` positionally."""
    model, adapter = models[family], ADAPTERS[family]()
    batch = make_batch(model, 2)
    calls = []

    def record(module, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        encoded = sorted((kwargs.get("mm_encoder_outputs") or {}).keys())
        pixels = [k for k in ("pixel_values", "pixel_values_videos") if kwargs.get(k) is not None]
        calls.append((len(args), ids, kwargs["position_ids"], encoded, pixels))

    handle = model.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        out = model.generate(
            **batch.kwargs(), max_new_tokens=3, do_sample=False, return_dict_in_generate=True
        )
        question = torch.full((2, 4), TEXT_LO)
        history = torch.cat([out.sequences, question], dim=1)
        mask = torch.cat([batch.attention_mask, torch.ones_like(history[:, batch.seq_len :])], dim=1)
        turn = {k: v for k, v in batch.kwargs().items() if k not in ("pixel_values", "pixel_values_videos")}
        model.generate(
            **{**turn, "input_ids": history, "attention_mask": mask},
            past_key_values=out.past_key_values,
            max_new_tokens=1,
            do_sample=False,
        )
    finally:
        handle.remove()
    positional = 1 if family == "llava-next" else 0
    assert [c[0] for c in calls] == [positional] * 4
    prefill, decode, _, turn2 = calls
    expected_modalities = sorted({i.modality for i in adapter.visual_items(model.config, batch.input_ids)})
    assert prefill[3] == expected_modalities and prefill[4] == []
    assert torch.equal(prefill[1], batch.input_ids)
    full = (batch.attention_mask.cumsum(1) - 1).clamp(min=0)
    assert torch.equal(adapter.text_positions(model, prefill[2]), full)
    assert torch.equal(adapter.text_positions(model, decode[2]), full[:, -1:] + 1)
    assert decode[3] == [] and turn2[3] == []
    seen = batch.seq_len + 2  # the cache holds the prompt and the first two generated tokens
    assert torch.equal(turn2[1], history[:, seen:])
    assert torch.equal(adapter.text_positions(model, turn2[2]), (mask.cumsum(1) - 1)[:, seen:])
