"""The trained testbed's accuracy smoke check: a fixed subset of each held-out split, with a blind
control (the same questions with the projector zeroed), so that a pass means the model reads the image
(not that the language model guesses well).

Apart from ``test_model.py`` so that the two longest testbed tests (this one and the demo/eval
commands) run on different pytest-xdist workers. It loads the checkpoint from the default cache, which
``scripts/setup.sh`` fills; ``test_model.py`` checks the assembly itself, from scratch.
"""

import pytest
import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration

from priortr.testbed import assemble, data, evaluate

pytestmark = pytest.mark.skipif(
    not assemble.WEIGHTS.is_file(), reason="the trained testbed parts are not in this checkout"
)


@pytest.fixture(scope="module")
def testbed():
    checkpoint = assemble.checkpoint()
    model = LlavaForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(checkpoint)


SMOKE_QUESTIONS = 24
# Measured on the shipped weights (float32, CPU): seeing, letters 24/24, named 23/24, sides 19/24,
# easy-VQA 24/24; blind, letters 1/24, named 5/24, sides 12/24 (chance about 3, 5 and 12).
FLOORS = {"letters": 22, "named": 21, "sides": 17, "easy-vqa": 22}
BLIND_CEILINGS = {"letters": 8, "named": 11, "sides": 14}


def _smoke_sets() -> dict[str, list[data.Sample]]:
    """Letter questions, questions that name a small shape by its shape or colour and ask the other
    (half each), side questions (half of them answered "left", so that one constant answer scores
    half), and a fixed easy-VQA subset, all held out."""
    scenes = data.load_split("scenes-test")
    half = SMOKE_QUESTIONS // 2
    named = [s for s in scenes if s.kind == "colour"][:half] + [s for s in scenes if s.kind == "shape"][:half]
    side = [s for s in scenes if s.kind == "side"]
    left, right = ([s for s in side if s.answer == answer][:half] for answer in ("left", "right"))
    return {
        "letters": [s for s in scenes if s.kind == "letter"][:SMOKE_QUESTIONS],
        "named": named,
        "sides": left + right,
        "easy-vqa": data.load_split("easy-vqa-test", limit=SMOKE_QUESTIONS),
    }


def _correct(model, processor, samples) -> int:
    report = evaluate.evaluate(model, processor, samples, "smoke", methods=["vanilla"], progress=False)
    return report.cells[0].correct


def test_accuracy_smoke_check_with_a_blind_control(testbed):
    """Full-token accuracy on fixed held-out questions (docs/accuracy.md has the full splits), then the
    same questions with the projector zeroed: no visual information reaches the language model, and
    the letters, the named shapes' attributes and their sides, which only the image can tell, fall to
    near chance (8 letters; 7 colours and 4 shapes; 12 of 24 sides for any one constant answer)."""
    model, processor = testbed
    sets = _smoke_sets()
    seeing = {name: _correct(model, processor, samples) for name, samples in sets.items()}
    projector = model.model.multi_modal_projector.linear_2
    saved = {k: v.clone() for k, v in projector.state_dict().items()}
    try:
        with torch.no_grad():
            projector.weight.zero_()
            projector.bias.zero_()
        blind = {name: _correct(model, processor, sets[name]) for name in BLIND_CEILINGS}
    finally:
        projector.load_state_dict(saved)
    assert all(seeing[name] >= floor for name, floor in FLOORS.items()), seeing
    assert all(blind[name] <= ceiling for name, ceiling in BLIND_CEILINGS.items()), blind
