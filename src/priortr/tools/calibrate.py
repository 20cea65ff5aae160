"""Which method, layer and budget keep a model's answers, and what they save: ``priortr calibrate``.

Without labels, on the user's own prompts, every configuration (method x layer x budget) is compared
with the unpruned model on the same batches:

* agreement: the share of prompts whose greedy answer (its first ``tokens`` tokens, up to the end of
  sequence) is identical to the unpruned model's;
* KL: the mean KL(unpruned || pruned) of the first answer token's distribution, a graded version of
  the same question that also sees changes below the arg-max;
* speed-up: the unpruned language-model prefill time over the pruned one, each the median of repeated
  timed prefills of the first prompt (batch 1) after warm-up on this machine (the paper's efficiency
  protocol times the language model without the vision tower), the unpruned model and every
  configuration timed in the same interleaved rounds, afresh on every run
  (``priortr.tools.bench.interleaved_lm_prefill``); a speed-up within the spread of the timings is flagged
  and counts as none when ranking (``Timing``);
* FLOPs share: the pruned language-model prefill FLOPs over the unpruned, from the stages the engine
  ran (``priortr.tools.flops``).

Per method, the recommendation is the fastest configuration whose agreement reaches the target; it is
written as a config file (``priortr.config_file``) that ``priortr.apply(model, config=PATH)``, the CLI's
``--config`` and the lmms-eval plug-in read. The unpruned answers are computed once per run and every
measured configuration's answers are cached in the output folder, so a re-run with a larger grid
answers only what is new (the timings, taken together, are always taken again).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import nn

from priortr.adapters import adapter_for
from priortr.api import apply
from priortr.frontend.prompts import check_text, prompt_text
from priortr.methods import get_method
from priortr.tools.bench import Spread, interleaved_lm_prefill, resolved
from priortr.tools.flops import scheduled_prefill_flops
from priortr.tools.journal import write_whole

log = logging.getLogger(__name__)

PROMPTS_FILE = "prompts.jsonl"
CACHE_FILE = "calibration-cache.json"
REFERENCE_FILE = "calibration-reference.pt"
DEFAULT_TARGET = 0.95


@dataclass(frozen=True)
class Prompt:
    """One question about one image; ``load`` reads (or renders) the image."""

    id: str
    text: str
    load: Callable[[], Image.Image] = field(compare=False, repr=False)


@dataclass(frozen=True)
class Setting:
    """One configuration of the grid; ``layer`` is None for methods that take none."""

    method: str
    layer: int | None
    budget: int | float

    @property
    def key(self) -> str:
        return f"{self.method}/L{'-' if self.layer is None else self.layer}/K{self.budget}"

    @property
    def label(self) -> str:
        where = "" if self.layer is None else f" L{self.layer}"
        return f"{self.method}{where} K={self.budget}"

    def arguments(self) -> dict[str, Any]:
        """``priortr.apply`` keywords."""
        return {"method": self.method, "budget": self.budget, "layer": self.layer}


@dataclass(frozen=True)
class Timing:
    """The language-model prefill of one configuration and of the unpruned model, in ms, from the
    same interleaved rounds (``priortr.tools.bench.interleaved_lm_prefill``)."""

    lm_prefill: Spread
    unpruned: Spread

    @property
    def speedup(self) -> float:
        """Unpruned over pruned median."""
        return self.unpruned.median / self.lm_prefill.median

    @property
    def resolved(self) -> bool:
        """The medians differ by more than the spread of either side (``priortr.tools.bench.resolved``)."""
        return resolved(self.unpruned, self.lm_prefill)


@dataclass
class Measurement:
    """What one configuration did on every prompt, against the unpruned model; ``timing``: this
    run's (not cached: timings of different runs are not compared)."""

    method: str
    layer: int | None
    budget: int | float
    agreement: float
    kl: float
    flops_share: float
    mean_kept: float
    agree: list[bool]
    kl_each: list[float]
    replies: list[str]
    timing: Timing | None = None

    @property
    def setting(self) -> Setting:
        return Setting(self.method, self.layer, self.budget)

    @property
    def speedup(self) -> float:
        return self.timing.speedup

    @property
    def resolved(self) -> bool:
        return self.timing.resolved

    @property
    def credited_speedup(self) -> float:
        """The speed-up a ranking may use: the measured one where the timings resolve it, else 1 (no
        difference shown)."""
        return self.speedup if self.resolved else 1.0


# -- data ---------------------------------------------------------------------------------------------


def folder_prompts(directory: str | Path) -> list[Prompt]:
    """The prompts of a folder: ``prompts.jsonl`` holds one JSON object per line, ``{"image": PATH,
    "prompt": TEXT}`` with PATH relative to the folder (an optional ``"id"`` names the line in outputs)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"--data {str(directory)!r} is not a folder (nor a built-in split)")
    listing = directory / PROMPTS_FILE
    if not listing.is_file():
        raise ValueError(
            f"--data folder {str(directory)!r} has no {PROMPTS_FILE}; write one JSON object per line, "
            '{"image": "photo.jpg", "prompt": "What is on the table?"}, image paths relative to the folder'
        )
    data = listing.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad_line = data[: exc.start].count(b"\n") + 1
        raise ValueError(
            f"{listing}, line {bad_line} is not valid UTF-8 (byte "
            f"0x{data[exc.start]:02x}); save the file as UTF-8 (or convert it with iconv -t UTF-8)"
        ) from None
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{listing}, line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} is not valid JSON: {exc}") from exc
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f'{where} needs a "prompt" string: {line.strip()[:80]}')
        if not record["prompt"].strip():
            raise ValueError(f"{where}: the prompt is empty; ask a question about the image")
        check_text(record["prompt"], f"{where}: the prompt")
        if not isinstance(record.get("image"), str):
            raise ValueError(
                f'{where} has no "image": every prompt needs an image file (a path relative to the folder), '
                "since pruning acts on its visual tokens"
            )
        path = directory / record["image"]
        if not path.is_file():
            raise ValueError(f"{where}: image {str(path)!r} does not exist")
        try:
            with Image.open(path):  # the header only: a file PIL cannot open, or one too large for it
                pass
        except (OSError, Image.DecompressionBombError) as exc:
            raise ValueError(f"{where}: cannot read image {str(path)!r}: {exc}") from None
        prompts.append(Prompt(str(record.get("id", number)), record["prompt"], _image_reader(path)))
    if not prompts:
        raise ValueError(f"{listing} holds no prompts")
    return prompts


def _image_reader(path: Path) -> Callable[[], Image.Image]:
    def load() -> Image.Image:
        try:
            with Image.open(path) as image:
                return image.convert("RGB")
        except (OSError, Image.DecompressionBombError) as exc:
            raise ValueError(f"cannot read image {str(path)!r}: {exc}") from exc

    return load


def load_prompts(folder: str, limit: int | None = None) -> list[Prompt]:
    """The first ``limit`` prompts (all with None) of a folder with ``prompts.jsonl``."""
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be at least 1, got {limit}")
    return folder_prompts(folder)[:limit]


def grid(methods: Sequence[str], layers: Sequence[int], budgets: Sequence[int | float]) -> list[Setting]:
    """Every (method, layer, budget); a method that takes no layer appears once per budget."""
    if not methods or not budgets or not layers:
        empty = [
            name
            for name, values in (("methods", methods), ("layers", layers), ("budgets", budgets))
            if not values
        ]
        raise ValueError(f"the grid is empty: give at least one value for {', '.join(empty)}")
    settings = []
    for method in methods:
        takes_layer = get_method(method).where == "layer"
        for layer in layers if takes_layer else [None]:
            settings += [Setting(method, layer, budget) for budget in budgets]
    return list(dict.fromkeys(settings))


# -- measuring ----------------------------------------------------------------------------------------


@dataclass
class Reference:
    """The unpruned model's answers: per prompt, the answer tokens and the first token's log-probs."""

    tokens: list[list[int]]
    replies: list[str]
    logprobs: torch.Tensor  # [N, V] float32


class Calibrator:
    """Runs a model over fixed batches of prompts, unpruned once and then under each configuration."""

    def __init__(
        self,
        model: nn.Module,
        processor: Any,
        prompts: Sequence[Prompt],
        tokens: int = 4,
        batch_size: int = 8,
        warmup: int = 1,
        repeats: int = 5,
        progress: Callable[[Iterable], Iterable] | None = None,
    ) -> None:
        if tokens < 1 or batch_size < 1 or warmup < 0 or repeats < 1:
            raise ValueError("tokens, batch_size and repeats must be >= 1 and warmup >= 0")
        self.model, self.processor, self.prompts = model, processor, list(prompts)
        self.tokens, self.batch_size, self.warmup, self.repeats = tokens, batch_size, warmup, repeats
        adapter_for(model)  # refuses an unsupported model before the unpruned reference runs
        self._progress = progress or (lambda items: items)
        self._batches = [self.prompts[i : i + batch_size] for i in range(0, len(self.prompts), batch_size)]
        self._timing_inputs = self._encode(self.prompts[:1])  # one prompt: the unbatched latency
        eos = model.generation_config.eos_token_id
        self._stop = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])

    def _encode(self, batch: Sequence[Prompt]) -> dict[str, torch.Tensor]:
        self.processor.tokenizer.padding_side = "left"  # batched generate: every row ends at the last column
        return self.processor(
            images=[prompt.load() for prompt in batch],
            text=[prompt_text(self.processor, prompt.text) for prompt in batch],
            padding=True,
            return_tensors="pt",
        ).to(self.model.device, dtype=self.model.dtype)

    def _answer(self, inputs: dict[str, torch.Tensor]) -> tuple[list[list[int]], torch.Tensor]:
        out = self.model.generate(
            **inputs,
            max_new_tokens=self.tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        new = out.sequences[:, inputs["input_ids"].shape[1] :].tolist()
        return [self._cut(row) for row in new], torch.log_softmax(out.logits[0].float(), dim=-1)

    def _cut(self, row: list[int]) -> list[int]:
        for i, token in enumerate(row):
            if token in self._stop:
                return row[: i + 1]
        return row

    def time(self, settings: Sequence[Setting]) -> dict[str, Timing]:
        """Each setting's ``Timing`` by key: the language-model prefill of the first prompt, unpruned
        and under every setting, in the same interleaved rounds."""
        arms: dict[str | None, Callable[[], Any]] = {None: nullcontext}
        arms |= {s.key: partial(apply, self.model, **s.arguments(), strict=True) for s in settings}
        spreads = interleaved_lm_prefill(self.model, self._timing_inputs, arms, self.warmup, self.repeats)
        return {s.key: Timing(spreads[s.key], spreads[None]) for s in settings}

    def reference(self) -> Reference:
        """The unpruned answers (computed once per run)."""
        tokens, logprobs = [], []
        with torch.inference_mode():
            for batch in self._progress(self._batches):
                answers, lp = self._answer(self._encode(batch))
                tokens += answers
                logprobs.append(lp)
        replies = self.processor.batch_decode(tokens, skip_special_tokens=True)
        return Reference(tokens, replies, torch.cat(logprobs))

    def measure(self, setting: Setting, reference: Reference) -> Measurement:
        """One configuration on every prompt, against ``reference``."""
        agree, kl, replies, kept, flops, flops_full = [], [], [], [], 0, 0
        image_token = self.model.config.image_token_id
        with apply(self.model, **setting.arguments(), strict=True) as handle, torch.inference_mode():
            start = 0
            for batch in self._progress(self._batches):
                inputs = self._encode(batch)
                answers, lp = self._answer(inputs)
                ref = reference.logprobs[start : start + len(batch)]
                kl += (ref.exp() * (ref - lp)).sum(-1).clamp_min(0).tolist()
                agree += [
                    a == r for a, r in zip(answers, reference.tokens[start : start + len(batch)], strict=True)
                ]
                replies += self.processor.batch_decode(answers, skip_special_tokens=True)
                kept += (handle.last.kept >= 0).sum(1).tolist()
                n_visual = (inputs["input_ids"] == image_token).sum(1).tolist()
                n_text = inputs["attention_mask"].sum(1).tolist()
                # what each stage left in each row, as the engine recorded it: VisionZip leaves K - 1,
                # SparseVLM recycles clusters on top of its schedule's counts (no stage: nothing pruned)
                layers = [stage.layer for stage in handle.last.stages]
                left = [(stage.kept >= 0).sum(1).tolist() for stage in handle.last.stages]  # [stages][B]
                for row, (visual, total) in enumerate(zip(n_visual, n_text, strict=True)):
                    stages = [(layer, counts[row]) for layer, counts in zip(layers, left, strict=True)]
                    flops += scheduled_prefill_flops(self.model.config, total - visual, visual, stages)
                    flops_full += scheduled_prefill_flops(self.model.config, total - visual, visual, [])
                start += len(batch)
        return Measurement(
            method=setting.method,
            layer=setting.layer,
            budget=setting.budget,
            agreement=sum(agree) / len(agree),
            kl=sum(kl) / len(kl),
            flops_share=flops / flops_full,
            mean_kept=sum(kept) / len(kept),
            agree=agree,
            kl_each=kl,
            replies=replies,
        )


# -- cache --------------------------------------------------------------------------------------------


def fingerprint(
    model_name: str, model: nn.Module, prompts: Sequence[Prompt], tokens: int, batch_size: int
) -> str:
    """What a cached measurement depends on: the model, its dtype and device, the prompts, the answer
    length and the batching (padding changes the numbers a little)."""
    text = json.dumps(
        [
            model_name,
            str(model.dtype),
            str(model.device),
            [(p.id, p.text) for p in prompts],
            tokens,
            batch_size,
        ]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Cache:
    """Measured configurations and the unpruned answers in ``directory``, valid for one fingerprint."""

    def __init__(self, directory: Path, key: str) -> None:
        self.path, self.tensor_path, self.key = directory / CACHE_FILE, directory / REFERENCE_FILE, key
        self.measurements: dict[str, Measurement] = {}
        self.reference: Reference | None = None
        if not self.path.is_file():
            return
        document = json.loads(self.path.read_text())
        if document.get("fingerprint") != key:
            log.warning("%s was measured on other prompts or another model; measuring afresh", self.path)
            return
        cached = {f.name for f in fields(Measurement)} - {"timing"}  # older caches also hold timings
        self.measurements = {
            m["key"]: Measurement(**{k: v for k, v in m.items() if k in cached})
            for m in document["measurements"]
        }
        if document.get("reference") and self.tensor_path.is_file():
            answers = {k: v for k, v in document["reference"].items() if k in ("tokens", "replies")}
            self.reference = Reference(logprobs=torch.load(self.tensor_path, weights_only=True), **answers)

    def save(self) -> None:
        """Write the cache, each file replaced whole (an interrupt leaves the previous one)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        reference = None
        if self.reference is not None:
            logprobs = self.reference.logprobs
            write_whole(self.tensor_path, lambda path: torch.save(logprobs, path))
            reference = {k: v for k, v in asdict(self.reference).items() if k != "logprobs"}
        measurements = [
            {"key": m.setting.key, **{k: v for k, v in asdict(m).items() if k != "timing"}}
            for m in self.measurements.values()
        ]
        document = {"fingerprint": self.key, "reference": reference, "measurements": measurements}
        write_whole(self.path, lambda path: path.write_text(json.dumps(document) + "\n"))


# -- the result ---------------------------------------------------------------------------------------


@dataclass
class Calibration:
    """Every measured configuration of one run, and what it recommends."""

    model: str
    data: str
    prompt_ids: list[str]
    target: float
    tokens: int
    reference: Reference
    measurements: list[Measurement]
    rank_by: str = "speedup"

    @property
    def unpruned(self) -> Spread:
        """The unpruned model's LM prefill, timed in the same rounds as every measurement."""
        return self.measurements[0].timing.unpruned

    def _speed(self, m: Measurement) -> tuple[float, float]:
        """Faster first: by the speed-up the timings resolve (FLOPs breaking ties, and deciding among
        speed-ups within noise), or by FLOPs alone where timings are not to be trusted (a shared
        machine)."""
        if self.rank_by == "flops":
            return (-m.flops_share, m.credited_speedup)
        return (m.credited_speedup, -m.flops_share)

    def recommendations(self) -> dict[str, Measurement | None]:
        """Per method, the fastest configuration whose agreement reaches the target (None: none does)."""
        out: dict[str, Measurement | None] = {}
        for method in dict.fromkeys(m.method for m in self.measurements):
            passing = [m for m in self.measurements if m.method == method and m.agreement >= self.target]
            out[method] = max(passing, key=self._speed, default=None)
        return out

    def best(self) -> Measurement | None:
        """The fastest recommendation over all methods."""
        chosen = [m for m in self.recommendations().values() if m is not None]
        return max(chosen, key=self._speed, default=None)

    def pareto(self) -> list[Measurement]:
        """Configurations no other beats in both agreement and resolved speed-up (``credited_speedup``)."""
        return [
            m
            for m in self.measurements
            if not any(
                o.agreement >= m.agreement
                and o.credited_speedup >= m.credited_speedup
                and (o.agreement, o.credited_speedup) != (m.agreement, m.credited_speedup)
                for o in self.measurements
            )
        ]


def calibrate(
    model: nn.Module,
    processor: Any,
    prompts: Sequence[Prompt],
    settings: Sequence[Setting],
    out: str | Path,
    *,
    model_name: str,
    data_name: str,
    target: float = DEFAULT_TARGET,
    tokens: int = 4,
    batch_size: int = 8,
    warmup: int = 1,
    repeats: int = 5,
    rank_by: str = "speedup",
    progress: bool = True,
) -> Calibration:
    """Measure every setting not already in ``out``'s cache and return the whole grid's result."""
    from tqdm import tqdm

    if not settings:
        raise ValueError("the grid is empty: give at least one method, layer and budget")
    if not prompts:
        raise ValueError("no prompts to calibrate on")
    if not 0 < target <= 1:
        raise ValueError(f"--target is an agreement in (0, 1]; got {target}")
    if rank_by not in ("speedup", "flops"):
        raise ValueError(f"rank_by must be speedup or flops; got {rank_by!r}")
    out = Path(out)
    cache = Cache(out, fingerprint(model_name, model, prompts, tokens, batch_size))
    todo = [s for s in settings if s.key not in cache.measurements]
    steps = len(todo) + (cache.reference is None)
    log.info("%d of %d configurations cached in %s", len(settings) - len(todo), len(settings), out)
    bar = tqdm(
        total=steps * -(-len(prompts) // batch_size), desc="calibrate", unit="batch", disable=not progress
    )

    def tick(batches: Iterable) -> Iterable:
        for batch in batches:
            yield batch
            bar.update(1)

    calibrator = Calibrator(model, processor, prompts, tokens, batch_size, warmup, repeats, tick)
    if cache.reference is None:
        bar.set_postfix_str("unpruned")
        cache.reference = calibrator.reference()
        cache.save()
    for setting in todo:
        bar.set_postfix_str(setting.label)
        cache.measurements[setting.key] = calibrator.measure(setting, cache.reference)
        cache.save()  # an interrupted run keeps what it measured
    bar.set_postfix_str("timing")
    timings = calibrator.time(settings)
    bar.close()
    measured = [replace(cache.measurements[s.key], timing=timings[s.key]) for s in settings]
    return Calibration(
        model_name, data_name, [p.id for p in prompts], target, tokens, cache.reference, measured, rank_by
    )
