"""Analytic FLOPs (``priortr.tools.flops``) and the shipped true-shape configs
(``priortr.frontend.configs``)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText

import priortr
from priortr.frontend.configs import config_dict, load_config, shipped_configs
from priortr.tools import flops
from priortr.tools.flops import (
    LayerProfile,
    ModelShape,
    TextShape,
    VisionShape,
    decoder_layer_flops,
    inference_flops,
    kv_cache_bytes,
    layer_flops,
    llm_prefill_flops,
    priortr_profile,
)
from tests.helpers.tiny import llava_batch, tiny_llava

MIB = 2**20

# A toy model small enough to count by hand: D=4, H=6, 4 layers, vocab 10; a 1-layer "CLIP" with
# D=2, H=3, 6 patches of 3 pixels, a class token that the projector does not see (so N = 6).
TOY = ModelShape(
    "llava",
    TextShape(hidden=4, intermediate=6, layers=4, heads=2, kv_heads=2, head_dim=2, vocab=10),
    VisionShape(
        family="clip",
        hidden=2,
        intermediate=3,
        layers=1,
        patch_pixels=3,
        mlp_matrices=2,
        cls_token=True,
        drops_first=True,
        fixed_patches=6,
    ),
)


def toy_f(p: int) -> int:
    """F(P) = 8 P D^2 + 2 P^2 D + 6 P D H with D=4, H=6: 272 P + 8 P^2."""
    return 272 * p + 8 * p * p


# -- per-layer formula --------------------------------------------------------------------------------


def test_layer_flops_matches_the_paper_formula_by_hand():
    # P=2, D=3, H=5: 8*2*9 + 2*4*3 + 6*2*3*5 = 144 + 24 + 180
    assert layer_flops(2, 3, 5) == 348
    assert layer_flops(10, 4, 6) == toy_f(10) == 3520
    # a GELU MLP has 2 matrices: 4 P D H instead of 6 P D H
    assert layer_flops(2, 3, 5, mlp_matrices=2) == 144 + 24 + 120
    # one query against 7 keys: 8 D^2 + 2*7*D + 6 D H
    assert layer_flops(1, 4, 6, keys=7) == 128 + 56 + 144


def test_exact_layer_flops_counts_both_attention_products_and_gqa():
    # MHA: only the attention term differs from the paper's (4 P^2 D instead of 2 P^2 D)
    assert layer_flops(2, 3, 5, exact=True) == 72 + 72 + 48 + 180
    # GQA, P=3, D=4, A=4, D_kv=2, H=5: 4*3*4*4 + 4*3*4*2 + 4*3*3*4 + 6*3*4*5
    assert layer_flops(3, 4, 5, attn_dim=4, kv_dim=2, exact=True) == 192 + 96 + 144 + 360
    # the paper's formula over-counts the K/V projections of a GQA model
    gqa = flops.model_shape("qwen2.5-vl-7b").text
    assert gqa.kv_dim < gqa.hidden
    paper = flops.decoder_layer_flops(gqa, 100, keys=0)
    exact = flops.decoder_layer_flops(gqa, 100, keys=0, exact=True)
    assert exact == paper - 4 * 100 * gqa.hidden * (gqa.hidden - gqa.kv_dim)


# -- pruned formula on the toy model -------------------------------------------------------------------


def test_pruned_llm_prefill_is_the_papers_piecewise_formula():
    # 4 text + 6 visual tokens, K = 2, L = 2 full layers: 2 F(10) + 2 F(6)
    assert llm_prefill_flops(TOY, 10, 6, 2) == 2 * toy_f(10) + 2 * toy_f(6) == 10880
    assert llm_prefill_flops(TOY, 10, 6, 4) == 4 * toy_f(10)
    with pytest.raises(ValueError, match="full_layers"):
        llm_prefill_flops(TOY, 10, 6, 5)


def test_layer_maps_to_layer_plus_one_full_layers():
    profile = priortr_profile(2, layer=1)  # score at layer 1: layers 0 and 1 see every token
    assert profile.visual_per_layer(6, 4) == [6, 6, 2, 2]
    assert flops.profile_of_stages([(1, 2)]) == LayerProfile("stages", ((2, 2),))  # (scored layer, kept)
    pruned = inference_flops(TOY, profile, text_tokens=4, decode_steps=0)
    assert pruned.llm_prefill == llm_prefill_flops(TOY, 10, 6, 2)
    assert "layers 0..2 (3 layers" in flops.layer_mapping(2, 32, 48, 576)


def test_every_term_of_the_toy_model_by_hand():
    vanilla = inference_flops(TOY, None, text_tokens=4, decode_steps=2)
    pruned = inference_flops(TOY, priortr_profile(2, layer=1), text_tokens=4, decode_steps=2)
    # ViT: patch embedding 2*6*3*2, one layer on 7 tokens: 8*7*4 + 2*49*2 + 4*7*2*3
    assert vanilla.vit == pruned.vit == 72 + 224 + 196 + 168
    # projector on the 6 patch tokens: 2 N (Dv D + D D)
    assert vanilla.projector == pruned.projector == 2 * 6 * (2 * 4 + 4 * 4)
    assert vanilla.llm_prefill == 4 * toy_f(10)
    # decode step s attends to cache + s keys in each of 4 layers: 272 + 8 k per layer
    assert vanilla.decode == 4 * ((272 + 8 * 11) + (272 + 8 * 12))
    assert pruned.decode == 4 * ((272 + 8 * 7) + (272 + 8 * 8))  # every layer's cache is pruned
    # LM head: 2 D V for the last prefill position and each step
    assert vanilla.lm_head == pruned.lm_head == 2 * 4 * 10 * 3
    assert inference_flops(TOY, None, text_tokens=4, decode_steps=2, all_prefill_logits=True).lm_head == (
        2 * 4 * 10 * (10 + 2)
    )
    terms = (vanilla.vit, vanilla.projector, vanilla.llm_prefill, vanilla.decode, vanilla.lm_head)
    assert vanilla.total() == sum(terms) == vanilla.as_dict()["total"]
    assert vanilla.total(["vit", "projector"]) == 660 + 288


# -- PyramidDrop's profile ------------------------------------------------------------------------------


def test_pyramid_drop_profile_caches_what_each_stage_processed():
    shape = flops.model_shape("llava-1.5-7b")
    profile = flops.pyramid_drop_profile(192, 576, 32)
    assert profile.cuts == ((8, 399), (16, 277), (24, 192))
    assert not profile.compact_cache
    per_token_layer = MIB // 64  # 2 x 32 heads x 128 x 2 bytes
    cached = sum(48 + n for n in (576, 399, 277, 192))  # 8 layers per stage
    assert flops.cache_bytes(shape, profile, 48, 576) == per_token_layer * 8 * cached


# -- properties -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["priortr", "pdrop"])
def test_flops_increase_with_the_budget(method):
    report = flops.flops_report("llava-1.5-7b", list(range(1, 576, 25)), methods=[method])
    percents = [row["percent"] for row in report["rows"]]
    assert percents == sorted(percents) and len(set(percents)) == len(percents)
    assert 0 < percents[0] < percents[-1] < 100


@pytest.mark.parametrize("method", ["priortr", "pdrop"])
def test_a_budget_covering_every_visual_token_is_exactly_vanilla(method):
    report = flops.flops_report("llava-1.5-7b", [576, 1000], methods=[method])
    for row in report["rows"]:
        assert row["kept"] == 576
        assert row["percent"] == 100.0
        assert row["flops"] == report["vanilla"]["flops"]
        assert row["kv_cache_bytes"] == report["vanilla"]["kv_cache_bytes"]


def test_ratio_budgets_and_json_report():
    report = flops.flops_report("llava-1.5-7b", [0.5], text_tokens=10, decode_steps=5, layer=1)
    (row,) = report["rows"]
    assert row["kept"] == 288 and row["cuts"] == [[2, 288]]
    assert (row["layer"], row["full_layers"]) == (1, 2)
    assumptions = report["assumptions"]
    assert (assumptions["layer"], assumptions["text_tokens"], assumptions["decode_steps"]) == (1, 10, 5)
    assert json.loads(json.dumps(report)) == report
    table = flops.format_table(report)
    assert "layers 0..1 (2 layers" in table and "| vanilla | - | 576 |" in table
    assert "| priortr | 1 | 288 |" in table


def test_each_method_is_counted_at_the_layer_apply_scores_by_default():
    assert flops.DEFAULT_LAYER is priortr.methods.registry.DEFAULT_LAYER
    assert priortr.get_method("priortr").default_layer == flops.DEFAULT_LAYER == 2
    assert priortr.get_method("fastv").default_layer == priortr.get_method("fastv").layer == 1
    assert priortr.get_method("visionzip").default_layer is None
    report = flops.flops_report("llava-1.5-7b", [64], methods=["priortr", "fastv", "pdrop"])
    layers = {row["method"]: (row["layer"], row["full_layers"]) for row in report["rows"]}
    assert layers == {"priortr": (2, 3), "fastv": (1, 2), "pdrop": (None, None)}
    assert report["assumptions"]["layer"] is None and len(report["assumptions"]["mapping"]) == 2
    percent = {row["method"]: row["percent"] for row in report["rows"]}
    assert percent["fastv"] < percent["priortr"]  # one full layer fewer
    table = flops.format_table(report)
    assert "| fastv | 1 | 64 |" in table and "| pdrop | cuts 8/16/24 | 64: 277/133/64 |" in table
    # a layer, or full_layers, puts every one-layer method there
    at_two = flops.flops_report("llava-1.5-7b", [64], methods=["priortr", "fastv"], layer=2)
    assert [row["layer"] for row in at_two["rows"]] == [2, 2]
    at_l2 = flops.flops_report("llava-1.5-7b", [64], methods=["priortr", "fastv"], full_layers=2)
    assert [row["full_layers"] for row in at_l2["rows"]] == [2, 2]


def test_every_counted_method_has_the_stages_the_engine_runs():
    """Each method's cuts are what a pruned prefill of a tiny 8-layer LLaVA (16 visual tokens) kept, stage by
    stage, read from ``handle.last``: the engine's own record, not the schedule the report is built from."""
    model = tiny_llava(text={"num_hidden_layers": 8})
    batch = llava_batch(model)
    built_in = {"clse", "dart", "diff", "divprune", "downsample", "entropy", "fastv", "logratio", "pdrop"}
    built_in |= {"pdrop+priortr"}
    built_in |= {"posterior", "prior", "priortr", "priortr+merge", "prumerge", "prumerge+", "random"}
    counted = [name for name in flops.METHODS if not name.startswith("test-")]  # test modules' own
    assert set(counted) == built_in | {"visionzip", "vispruner"}  # all but sparsevlm
    report = flops.flops_report(model.config, [6], methods=counted)
    for row in report["rows"]:
        with priortr.apply(model, method=row["method"], budget=6) as handle, torch.no_grad():
            model(**batch.kwargs())
        ran = [[stage.layer + 1, stage.kept.shape[1]] for stage in handle.last.stages]
        assert row["cuts"] == ran, row["method"]
    cuts = {row["method"]: row["cuts"] for row in report["rows"]}
    assert cuts["divprune"] == [[0, 6]] and cuts["visionzip"] == [[0, 5]]  # before layer 0; [CLS]'s slot
    assert cuts["downsample"] == [[0, 4]]  # the 4 x 4 grid pooled to 2 x 2
    assert cuts["clse"] == [[1, 10], [3, 6], [5, 1]]  # prune layers 1, 3, 5; int(6 x 1.72 / 1.09 / 0.32)
    assert cuts["pdrop"] == [[2, 12], [4, 8], [6, 6]]  # 16 x (6/16)^(i/3), rounded


def test_staged_and_pre_llm_methods_on_llava_by_hand():
    report = flops.flops_report("llava-1.5-7b", [64], methods=["clse", "visionzip"], decode_steps=0)
    clse, visionzip = report["rows"]
    assert clse["cuts"] == [[1, 110], [11, 70], [21, 20]]  # the authors' LLaVA preset and prune layers
    assert (clse["layer"], clse["kept"]) == (None, 64)
    text = flops.model_shape("llava-1.5-7b").text
    assert clse["flops"]["llm_prefill"] == sum(
        n * decoder_layer_flops(text, 48 + kept) for n, kept in ((1, 576), (10, 110), (10, 70), (11, 20))
    )
    assert visionzip["cuts"] == [[0, 63]]  # the authors' 54 dominant + 10 contextual, [CLS] among them
    assert visionzip["flops"]["llm_prefill"] == 32 * decoder_layer_flops(text, 48 + 63)
    vanilla = report["vanilla"]["flops"]
    assert all(visionzip["flops"][term] == vanilla[term] for term in ("vit", "projector"))
    assert clse["kv_cache_bytes"] == kv_cache_bytes("llava-1.5-7b", 48 + 20)
    table = flops.format_table(report)
    assert "| clse | cuts 1/11/21 | 64: 110/70/20 |" in table and "| visionzip | cuts 0 | 64: 63 |" in table


def test_downsample_counts_its_pooled_grid():
    """LLaVA-1.5's 24 x 24 grid pooled to 13 x 13, 11 x 11, 8 x 8 and 5 x 5 before layer 0; a token count
    that is no square grid is refused."""
    report = flops.flops_report("llava-1.5-7b", [192, 128, 64, 32], methods=["downsample"], decode_steps=0)
    assert [row["cuts"] for row in report["rows"]] == [[[0, 169]], [[0, 121]], [[0, 64]], [[0, 25]]]
    assert [row["kept"] for row in report["rows"]] == [192, 128, 64, 32]  # the budgets asked for
    text = flops.model_shape("llava-1.5-7b").text
    assert report["rows"][0]["flops"]["llm_prefill"] == 32 * decoder_layer_flops(text, 48 + 169)
    assert report["rows"][0]["kv_cache_bytes"] == kv_cache_bytes("llava-1.5-7b", 48 + 169)
    vanilla = report["vanilla"]["flops"]
    assert all(report["rows"][0]["flops"][term] == vanilla[term] for term in ("vit", "projector"))
    with pytest.raises(ValueError, match="600 tokens are no square grid"):
        flops.flops_report("qwen2.5-vl-7b", [64], methods=["downsample"], image_tokens=600)


def test_terms_restrict_the_total():
    report = flops.flops_report("llava-1.5-7b", [64], terms=["llm_prefill"], decode_steps=0)
    (row,) = report["rows"]
    assert row["flops"]["total"] == row["flops"]["llm_prefill"]
    assert row["flops"]["llm_prefill"] == llm_prefill_flops("llava-1.5-7b", 624, 112, 3)  # layer=2
    with pytest.raises(ValueError, match="unknown terms"):
        flops.flops_report("llava-1.5-7b", [64], terms=["vision"])


def test_report_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown method 'pyramid'"):
        flops.flops_report("llava-1.5-7b", [64], methods=["pyramid"])
    with pytest.raises(ValueError, match="does not count sparsevlm: it recycles clusters"):
        flops.flops_report("llava-1.5-7b", [64], methods=["sparsevlm"])
    with pytest.raises(ValueError, match="layer must be"):
        flops.flops_report("llava-1.5-7b", [64], layer=31)
    with pytest.raises(ValueError, match="fixed 576"):
        flops.flops_report("llava-1.5-7b", [64], image_tokens=100)
    with pytest.raises(ValueError, match="increasing layers"):
        LayerProfile("bad", ((8, 100), (4, 50))).visual_per_layer(576, 32)


def test_dynamic_resolution_models_take_the_image_token_count():
    small = inference_flops("qwen2.5-vl-7b", None, image_tokens=64, decode_steps=0)
    large = inference_flops("qwen2.5-vl-7b", None, image_tokens=1024, decode_steps=0)
    assert small.vit < large.vit and small.projector * 16 == large.projector
    report = flops.flops_report("qwen2.5-vl-7b", [64], image_tokens=256)
    assert report["assumptions"]["image_tokens"] == 256 and report["rows"][0]["percent"] < 100


# -- KV cache -------------------------------------------------------------------------------------------


def test_kv_cache_bytes_reproduces_the_papers_column():
    config = load_config("llava-1.5-7b")
    assert kv_cache_bytes(config, 1) == MIB // 2  # 2 x 32 layers x 32 heads x 128 x 2 bytes
    for kept, mib in [(576, 312), (192, 120), (128, 88), (64, 56)]:
        assert kv_cache_bytes(config, 48 + kept, 2, 1) == mib * MIB
    assert kv_cache_bytes(config, 112, dtype_bytes=4, batch=3) == 3 * 2 * 56 * MIB
    # early layers unpruned (a method that leaves their cache alone): 3 layers of 624, 29 of 112
    assert kv_cache_bytes(config, 112, pruned_from=3, full_tokens=624) == (3 * 624 + 29 * 112) * MIB // 64
    with pytest.raises(ValueError, match="full_tokens"):
        kv_cache_bytes(config, 112, pruned_from=3)


def test_kv_cache_of_a_gqa_model_counts_kv_heads():
    qwen = load_config("qwen2.5-vl-7b")
    assert kv_cache_bytes(qwen, 1, 2) == 2 * 28 * 4 * 128 * 2


# -- shipped configs ------------------------------------------------------------------------------------

EXPECTED = {
    "llava-1.5-7b": ("LlavaForConditionalGeneration", (4096, 32, 32, 32, 11008, 32064), 7.06e9),
    "llava-1.5-13b": ("LlavaForConditionalGeneration", (5120, 40, 40, 40, 13824, 32064), 13.35e9),
    "qwen2.5-vl-7b": ("Qwen2_5_VLForConditionalGeneration", (3584, 28, 28, 4, 18944, 152064), 8.29e9),
}


def test_shipped_names():
    assert shipped_configs() == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_shipped_configs_load_and_build_on_meta(name):
    architecture, shape, parameters = EXPECTED[name]
    config = load_config(name)
    assert config is not load_config(name)  # a fresh object each time
    text = config.get_text_config(decoder=True)
    got = (
        text.hidden_size,
        text.num_hidden_layers,
        text.num_attention_heads,
        text.num_key_value_heads,
        text.intermediate_size,
        text.vocab_size,
    )
    assert got == shape
    data = config_dict(name)
    assert type(AutoConfig.for_model(**data)) is type(config)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    assert type(model).__name__ == architecture
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(parameters, rel=0.01)


def test_shipped_vision_and_token_ids():
    llava = load_config("llava-1.5-7b")
    vision = llava.vision_config
    assert (vision.hidden_size, vision.num_hidden_layers, vision.num_attention_heads) == (1024, 24, 16)
    assert (vision.intermediate_size, vision.image_size, vision.patch_size) == (4096, 336, 14)
    assert (llava.image_token_index, llava.vision_feature_layer, llava.image_seq_length) == (32000, -2, 576)
    assert llava.projector_hidden_act == "gelu"
    assert flops.model_shape(llava).default_image_tokens == 576
    qwen = load_config("qwen2.5-vl-7b")
    qv = qwen.vision_config
    assert (qv.depth, qv.hidden_size, qv.intermediate_size, qv.num_heads, qv.out_hidden_size) == (
        32,
        1280,
        3420,
        16,
        3584,
    )
    assert (qv.patch_size, qv.spatial_merge_size, qv.temporal_patch_size, qv.window_size) == (14, 2, 2, 112)
    assert list(qv.fullatt_block_indexes) == [7, 15, 23, 31]
    ids = (qwen.image_token_id, qwen.video_token_id, qwen.vision_start_token_id, qwen.vision_end_token_id)
    assert ids == (151655, 151656, 151652, 151653)
    rope = qwen.get_text_config(decoder=True).rope_parameters
    assert rope["rope_theta"] == 1e6 and list(rope["mrope_section"]) == [16, 24, 24]


def test_load_config_from_a_directory_or_file(tmp_path):
    load_config("llava-1.5-13b").save_pretrained(tmp_path)
    for source in (tmp_path, tmp_path / "config.json"):
        config = load_config(str(source))
        assert config.get_text_config(decoder=True).hidden_size == 5120


def test_unknown_config_names_the_shipped_ones(tmp_path):
    with pytest.raises(ValueError, match=r"llava-1\.5-7b, qwen2\.5-vl-7b"):
        load_config("llava-2-70b")
    with pytest.raises(ValueError, match="shipped configs"):
        load_config(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="unknown config"):
        config_dict("nope")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        load_config(str(tmp_path))


def test_unsupported_model_type_for_flops():
    with pytest.raises(ValueError, match="no FLOPs model"):
        flops.model_shape(AutoConfig.for_model("llama", num_hidden_layers=2))
    # the text-only helpers accept any decoder config
    assert kv_cache_bytes(AutoConfig.for_model("llama", num_hidden_layers=2), 1) == 2 * 2 * 4096 * 2


def test_flops_command(capsys):
    from priortr.cli import main

    assert main(["flops", "--model", "llava-1.5-7b", "--budgets", "64", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert json.dumps(report)  # one JSON document
    assert main(["flops", "--methods", "priortr", "fastv", "--budgets", "64"]) == 0
    table = capsys.readouterr().out
    assert "| priortr | 2 | 64 |" in table and "| fastv | 1 | 64 |" in table  # each method's own layer
