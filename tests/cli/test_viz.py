"""Token-to-region mapping and the prior/posterior/score figure (``priortr.tools.viz``, ``priortr viz``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, BatchFeature

from priortr.adapters import adapter_for
from priortr.cli import main
from priortr.tools import families, viz
from tests.helpers.checkpoint import save_tiny_llava_checkpoint
from tests.helpers.tiny import (
    QWEN_IMAGE_ID,
    QWEN_VISION_END_ID,
    QWEN_VISION_START_ID,
    qwen_batch,
    tiny_llava,
    tiny_qwen2_5_vl,
    tiny_qwen2_vl,
)

try:  # without torchvision, transformers 5 has the PIL backends only
    from transformers import LlavaImageProcessorPil as LlavaImageProcessor
    from transformers import Qwen2VLImageProcessorPil as QwenImageProcessor
except ImportError:  # pragma: no cover
    from transformers import LlavaImageProcessor
    from transformers import Qwen2VLImageProcessor as QwenImageProcessor

PROMPT = "what color is the cat"


def gradient(width: int, height: int) -> Image.Image:
    """An RGB image whose red channel encodes x and green channel encodes y, so every crop differs."""
    xs = torch.linspace(0, 255, width).round().to(torch.uint8)
    ys = torch.linspace(0, 255, height).round().to(torch.uint8)
    pixels = torch.stack(
        [xs[None].expand(height, width), ys[:, None].expand(height, width), torch.full((height, width), 90)],
        dim=-1,
    ).to(torch.uint8)
    return Image.frombytes("RGB", (width, height), pixels.contiguous().numpy().tobytes())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llava_checkpoint(tmp_path_factory.mktemp("viz") / "tiny-llava")


@pytest.fixture(scope="module")
def llava(checkpoint: Path):
    """(model, processor) of the saved tiny LLaVA checkpoint (28x28 CLIP input, 4x4 visual tokens)."""
    return AutoModelForImageTextToText.from_pretrained(checkpoint).eval(), AutoProcessor.from_pretrained(
        checkpoint
    )


# -- pure mapping ----------------------------------------------------------------------------------------


def test_token_boxes_of_a_2x3_grid_over_60x40() -> None:
    boxes = viz.token_boxes((2, 3), (60, 40))
    expected = [
        [0, 0, 20, 20],
        [20, 0, 40, 20],
        [40, 0, 60, 20],
        [0, 20, 20, 40],
        [20, 20, 40, 40],
        [40, 20, 60, 40],
    ]
    assert boxes.tolist() == expected


def test_token_boxes_tile_an_uneven_image_exactly() -> None:
    boxes = viz.token_boxes((3, 7), (50, 20)).double()
    widths, heights = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    assert torch.allclose(widths, torch.full((21,), 50 / 7, dtype=torch.float64)) and torch.allclose(
        heights, torch.full((21,), 20 / 3, dtype=torch.float64)
    )
    assert math.isclose(float((widths * heights).sum()), 50 * 20, rel_tol=1e-6)
    assert boxes[6].tolist() == pytest.approx([50 * 6 / 7, 0, 50, 20 / 3], rel=1e-6)  # end of row 0
    assert boxes[7].tolist() == pytest.approx([0, 20 / 3, 50 / 7, 40 / 3], rel=1e-6)  # start of row 1


def test_scores_to_grid_is_raster_order() -> None:
    grid = viz.scores_to_grid(torch.arange(12.0), (3, 4))
    assert grid.shape == (3, 4)
    for i in range(12):
        assert grid[i // 4, i % 4] == i
    with pytest.raises(ValueError, match="do not fill a 3x5 token grid"):
        viz.scores_to_grid(torch.arange(12.0), (3, 5))


# -- families: visual_grid and image_view ------------------------------------------------------------------


def test_llava_visual_grid_is_square_patch_grid() -> None:
    model = tiny_llava(dtype=torch.float32)
    adapter = adapter_for(model)
    assert families.visual_grid(adapter, model.config, {}, 0) == (4, 4)
    model.config.image_seq_length = 17  # e.g. CLS kept ("full" strategy): no grid
    with pytest.raises(ValueError, match="not the 4x4 patch grid"):
        families.visual_grid(adapter, model.config, {}, 0)


@pytest.mark.parametrize("build", [tiny_qwen2_vl, tiny_qwen2_5_vl])
def test_qwen_visual_grid_is_merged_patch_grid_in_raster_order(build) -> None:
    model = build(dtype=torch.float32)
    batch = qwen_batch(model, batch_size=2, grid=(1, 4, 8))  # 4 x 8 patches, merged 2x2: 2 rows, 4 cols
    inputs = batch.kwargs()
    adapter = adapter_for(model)
    assert families.visual_grid(adapter, model.config, inputs, 0) == (2, 4)
    assert families.visual_grid(adapter, model.config, inputs, 1) == (2, 4)
    # The model's own M-RoPE height/width ids of the visual tokens say where each token sits.
    positions, _ = model.model.get_rope_index(
        batch.input_ids,
        batch.mm_token_type_ids,
        image_grid_thw=batch.image_grid_thw,
        attention_mask=batch.attention_mask,
    )  # [3, B, S]: temporal, height, width
    for row in range(2):
        visual = slice(batch.image_start[row], batch.image_end[row])
        height, width = positions[1, row, visual], positions[2, row, visual]
        index = torch.arange(batch.n_visual)
        assert torch.equal(height - height.min(), index // 4)
        assert torch.equal(width - width.min(), index % 4)


def test_qwen_visual_grid_from_the_image_processor_of_a_wide_image() -> None:
    model = tiny_qwen2_5_vl(dtype=torch.float32)
    processor = QwenImageProcessor(min_pixels=28 * 28, max_pixels=64 * 28 * 28, patch_size=14, merge_size=2)
    inputs = processor(Image.new("RGB", (112, 56)), return_tensors="pt")  # width 112, height 56
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 8]]
    assert families.visual_grid(adapter_for(model), model.config, inputs, 0) == (2, 4)


@pytest.mark.parametrize(
    ("size", "box"),
    [((80, 40), (20, 0, 60, 40)), ((40, 80), (0, 20, 40, 60)), ((28, 28), (0, 0, 28, 28))],
)
def test_llava_image_view_is_the_processor_centre_crop(llava, size, box) -> None:
    model, processor = llava
    image = gradient(*size)
    view = families.image_view(adapter_for(model), image, processor)
    assert view.size == (box[2] - box[0], box[3] - box[1])
    assert view.tobytes() == image.crop(box).tobytes()
    # The processor sees the same pixels in the view as in the whole image (up to resampling).
    pixels = processor.image_processor(image, return_tensors="pt")["pixel_values"]
    again = processor.image_processor(view, return_tensors="pt")["pixel_values"]
    assert (pixels - again).abs().mean() < 0.05


def test_llava_image_view_with_do_pad_is_the_padded_square() -> None:
    model = tiny_llava(dtype=torch.float32)
    processor = LlavaImageProcessor(
        do_pad=True, size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}
    )
    image = gradient(80, 40)
    view = families.image_view(adapter_for(model), image, processor)
    assert view.size == (80, 80)
    assert view.crop((0, 20, 80, 60)).tobytes() == image.tobytes()
    assert view.getpixel((0, 0)) == tuple(int(m * 255) for m in processor.image_mean)


def test_qwen_image_view_is_the_whole_image() -> None:
    model = tiny_qwen2_5_vl(dtype=torch.float32)
    image = gradient(90, 50)
    view = families.image_view(adapter_for(model), image, QwenImageProcessor())
    assert view.size == (90, 50) and view.tobytes() == image.tobytes()


# -- maps and figure ---------------------------------------------------------------------------------------


def distinct_colours(path: Path) -> int:
    with Image.open(path) as png:
        return len(png.convert("RGB").getcolors(maxcolors=1 << 24))


def test_attention_maps_and_render_on_the_tiny_checkpoint(llava, tmp_path: Path) -> None:
    model, processor = llava
    image = gradient(60, 40)
    results = viz.attention_maps(model, processor, image, PROMPT, layers=(1, 2), budgets=(4, 0.5))
    assert [(r.layer, r.budget, r.n_kept, r.n_visual) for r in results] == [
        (1, 4, 4, 16),
        (1, 0.5, 8, 16),
        (2, 4, 4, 16),
        (2, 0.5, 8, 16),
    ]
    for maps in results:
        assert maps.grid == (4, 4) and maps.kept.shape == (4, 4)
        assert float(maps.prior.sum()) == pytest.approx(1, abs=1e-5)
        assert float(maps.posterior.sum()) == pytest.approx(1, abs=1e-5)
        p, q = maps.posterior, maps.prior
        assert torch.allclose(maps.scores, p * torch.log((p + 1e-6) / (q + 1e-6)), atol=1e-6)
        top = maps.scores.flatten().topk(maps.n_kept).indices
        assert set(top.tolist()) == set(maps.kept.flatten().nonzero().flatten().tolist())
    assert not torch.equal(results[0].scores, results[2].scores)  # layers 1 and 2 differ

    view = families.image_view(adapter_for(model), image, processor)
    path = viz.render(results, view, tmp_path / "sub" / "maps.png", title="tiny")
    assert path.stat().st_size > 10_000
    assert distinct_colours(path) > 1_000
    with Image.open(path) as png:
        assert png.size[1] > png.size[0] * 0.5  # four rows of panels


class StubQwenProcessor:
    """A processor for the tiny Qwen2.5-VL: the real Qwen image processor (grid from the image size) and
    a hand-laid prompt ``[text x 3, <vision_start>, <image_pad> x N, <vision_end>, text x 4]``."""

    def __init__(self) -> None:
        self.image_processor = QwenImageProcessor(
            min_pixels=28 * 28, max_pixels=64 * 28 * 28, patch_size=14, merge_size=2
        )

    def apply_chat_template(self, messages, **kwargs) -> BatchFeature:
        image = messages[0]["content"][0]["image"]
        features = dict(self.image_processor(image, return_tensors="pt"))
        n_visual = int(features["image_grid_thw"][0].prod()) // 4
        ids = [
            10,
            11,
            12,
            QWEN_VISION_START_ID,
            *[QWEN_IMAGE_ID] * n_visual,
            QWEN_VISION_END_ID,
            13,
            14,
            15,
            16,
        ]
        input_ids = torch.tensor([ids])
        return BatchFeature(
            {
                **features,
                "input_ids": input_ids,
                "attention_mask": torch.ones_like(input_ids),
                "mm_token_type_ids": (input_ids == QWEN_IMAGE_ID).long(),
            }
        )


def test_attention_maps_on_a_wide_qwen_image(tmp_path: Path) -> None:
    model = tiny_qwen2_5_vl(dtype=torch.float32)
    processor = StubQwenProcessor()
    image = gradient(168, 56)  # 4 x 12 patches (h x w), merged 2x2: 2 rows of 6 tokens
    (maps,) = viz.attention_maps(model, processor, image, PROMPT, layers=(2,), budgets=(5,))
    assert maps.grid == (2, 6) and maps.n_kept == 5 and maps.n_visual == 12
    view = families.image_view(adapter_for(model), image, processor)
    path = viz.render([maps], view, tmp_path / "qwen.png")
    assert path.stat().st_size > 10_000


# -- command line ------------------------------------------------------------------------------------------


def test_cli_viz_writes_the_png_and_reports_kept_counts(checkpoint, tmp_path, capsys) -> None:
    image = tmp_path / "image.png"
    gradient(60, 40).save(image)
    out = tmp_path / "maps.png"
    argv = ["viz", "--model", str(checkpoint), "--image", str(image), "--prompt", PROMPT, "--out", str(out)]
    code = main([*argv, "--layers", "1", "2", "--budgets", "0.5"])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    assert stdout.splitlines() == [
        str(out),
        "layer 1, budget 0.5: visual tokens kept: 8 / 16",
        "layer 2, budget 0.5: visual tokens kept: 8 / 16",
    ]
    assert out.stat().st_size > 10_000


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--image", "does-not-exist.png"], "cannot read image 'does-not-exist.png'"),
        (["--layers", "9"], "layer must be an int in [0, 2]"),
        (["--method", "nope"], "unknown method 'nope'"),
    ],
)
def test_cli_viz_bad_input_exits_2(checkpoint, tmp_path, capsys, extra, message) -> None:
    image = tmp_path / "image.png"
    gradient(30, 30).save(image)
    out = tmp_path / "maps.png"
    argv = ["viz", "--model", str(checkpoint), "--image", str(image), "--prompt", PROMPT, "--out", str(out)]
    code = main([*argv, *extra])
    stdout, err = capsys.readouterr()
    assert code == 2 and stdout == ""
    assert f"priortr: error: {message}" in err and "Traceback" not in err
    assert not out.exists()
