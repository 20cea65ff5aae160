"""Local lmms-eval tasks ``priortr_local_gen`` and ``priortr_local_mc`` (no hub, no network).

The task YAMLs read ``priortr_local.jsonl`` from the current directory; write it (and its PNGs) with

    python -m tests.helpers.lmms_task.utils DIR        # then run lmms-eval with DIR as working directory

and pass ``--include_path tests/helpers/lmms_task``. Each record holds an absolute image path, a question in
the tiny test tokenizer's vocabulary (``tests/helpers/checkpoint.py``), its answer and the answer choices.

With ``PRIORTR_LOCAL_CALLS=FILE`` in the environment, every ``doc_to_visual`` call appends
``"<process id> <record id>"`` to FILE: the plug-in calls it once per request it runs, so the test of
data-parallel runs counts the requests that each process ran.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from PIL import Image

DATA_FILE = "priortr_local.jsonl"
CALLS_ENV = "PRIORTR_LOCAL_CALLS"
CHOICES = ["red", "blue", "cat"]
# (colour, image size, question, answer): sizes differ, the processor resizes every image to 28x28
RECORDS = [
    ((220, 30, 30), (40, 30), "what color is the image", "red"),
    ((30, 30, 220), (28, 28), "what color is the image", "blue"),
    ((30, 30, 220), (64, 48), "what color is this picture", "blue"),
    ((220, 30, 30), (30, 40), "describe the color in the picture", "red"),
    ((128, 128, 128), (32, 32), "what is in the image", "cat"),
]


def write_local_dataset(directory: str | Path) -> Path:
    """Write ``DATA_FILE`` and one PNG per record into ``directory``; return the JSONL path."""
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, (colour, size, question, answer) in enumerate(RECORDS):
        image = Image.new("RGB", size, colour)
        image.paste((255, 255, 255), (size[0] // 4, size[1] // 4, size[0] // 2, size[1] // 2))
        path = directory / f"image{i}.png"
        image.save(path)
        record = {"id": i, "image": str(path), "question": question, "answer": answer, "choices": CHOICES}
        lines.append(json.dumps(record))
    data = directory / DATA_FILE
    data.write_text("\n".join(lines) + "\n")
    return data


def doc_to_visual(doc: dict) -> list[Image.Image]:
    calls = os.environ.get(CALLS_ENV)
    if calls:
        with open(calls, "a") as log:  # one short append per call: whole lines, even from two processes
            log.write(f"{os.getpid()} {doc['id']}\n")
    return [Image.open(doc["image"]).convert("RGB")]


def doc_to_text(doc: dict, lmms_eval_specific_kwargs: dict | None = None) -> str:
    kwargs = lmms_eval_specific_kwargs or {}
    return f"{kwargs.get('pre_prompt', '')}{doc['question']}{kwargs.get('post_prompt', '')}"


def doc_to_target(doc: dict) -> str:
    return doc["answer"]


def doc_to_choice(doc: dict) -> list[str]:
    return doc["choices"]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m tests.helpers.lmms_task.utils OUTPUT_DIR")
    print(write_local_dataset(sys.argv[1]))
