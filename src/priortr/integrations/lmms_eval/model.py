"""lmms-eval model ``priortr``: a Hugging Face image-text model with PriorTR visual-token pruning.

    lmms-eval --model priortr \\
        --model_args pretrained=llava-hf/llava-1.5-7b-hf,method=priortr,budget=64,layer=2 \\
        --tasks gqa --batch_size 8 --output_path results/

The model is loaded by ``priortr.frontend.loading.load`` (``AutoProcessor`` +
``AutoModelForImageTextToText``, the CLI's loader and checks), prompts are built by
``priortr.frontend.prompts.prompt_text``, and ``priortr.apply`` is attached once; every request then runs
the stock ``generate()`` / forward call of the pruned model. Registered through the ``lmms_eval.models``
entry point (``priortr.integrations.lmms_eval.manifest``). This module imports ``lmms_eval`` and is only
imported by lmms-eval itself; ``import priortr`` does not import it.

Requests, in lmms-eval's "simple" model format:

* ``generate_until``: greedy ``generate()`` on the chat-template prompt (image(s) first, then the
  context), batches of ``batch_size`` requests with the same generation kwargs, left padding; the answer
  is cut at the first ``until`` string.
* ``loglikelihood`` (``multiple_choice`` and ``loglikelihood`` tasks): one call over prompt +
  continuation (prompt = chat template with the generation prompt, continuation = the tokens the text
  adds to it), inside ``handle.prompt_ends``: the kept set is the prompt's own, so every option of a
  question is scored on the same kept tokens, and the continuation's logits are those of cached, pruned
  decoding (``priortr.engine.continuation``). Returns ``(-sum log p(continuation), is_greedy)``: a
  loss, because lmms-eval's ``multiple_choice`` picks the choice with the *smallest* value (its
  built-in models return a token-mean loss).

Kept/total visual tokens are recorded per batch and reported through lmms-eval's throughput log
(``results.json["throughput"]["avg_kept_tokens"]``, ``avg_visual_tokens``, ``avg_budget``).

Placement follows lmms-eval's distributed model contract (as its ``llava_hf`` model does):

* one process: the model on ``device``, or split over devices with ``device_map`` (model parallel);
* ``accelerate launch --num_processes N`` (data parallel): lmms-eval's evaluator gives each process
  (rank from the ``RANK`` / ``WORLD_SIZE`` environment) its share of the documents and gathers the
  results; each process loads the whole model on its own device (``Accelerator().device``). The padding
  requests that lmms-eval adds to even out the shards are answered without running the model (they
  exist for models that synchronise inside forward; this one never does, and their answers are
  dropped). The statistics are summed over the processes when lmms-eval calls ``clean()`` on every
  process after the last request, so results.json holds them for the whole run.
* the two modes are not combined: lmms-eval's own HF models drop ``device_map`` under several
  processes; this plug-in refuses it with a message instead.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Sequence
from importlib.metadata import version
from typing import Any

import torch
from lmms_eval import evaluator as lmms_evaluator
from lmms_eval import utils as lmms_utils
from lmms_eval.api.instance import GenerationResult, Instance
from lmms_eval.api.model import lmms
from loguru import logger as eval_logger
from PIL import Image

import priortr
from priortr.config_file import parse_budget
from priortr.frontend.loading import DTYPES, load
from priortr.frontend.prompts import prompt_text
from priortr.frontend.timing import Clock
from priortr.integrations.lmms_eval.placement import placement
from priortr.integrations.lmms_eval.stats import KeptStats, report_stats

# keys that lmms-eval itself may pass on top of --model_args (lmms.create_from_arg_string)
_IGNORED_KWARGS = ("max_batch_size",)
REQUEST_TYPES = ("loglikelihood", "generate_until")
# lmms-eval's mark on the copies of a request that even out the ranks' shards (evaluator, api/task.py)
PADDING_KEY = "__padding_only__"


def is_padding(request: Instance) -> bool:
    """Whether lmms-eval added ``request`` only to even out the processes' shards (its answer is dropped)."""
    return bool((request.metadata or {}).get(PADDING_KEY))


def _check_filelock() -> None:
    """Refuse, before any model is loaded, a filelock that lmms-eval's evaluator cannot start with: lmms-eval
    0.7 imports ``filelock._api`` right after it builds the model (``_enable_reentrant_filelocks``), and
    filelock 4.3 removed that module. ``priortr[eval]`` pins ``filelock<4.3``; lmms-eval installed on its
    own does not."""
    imports_api = hasattr(lmms_evaluator, "_enable_reentrant_filelocks")
    if imports_api and importlib.util.find_spec("filelock._api") is None:
        raise RuntimeError(
            f"priortr: lmms-eval {version('lmms_eval')} imports filelock._api when an evaluation starts, and "
            f"filelock {version('filelock')} has no such module; install filelock<4.3 "
            "(pip install 'filelock<4.3', or pip install 'priortr[eval]')"
        )


def _check_model_args(extra: dict[str, Any], batch_size: int | str, dtype: str) -> None:
    """Refuse model_args the plug-in does not know, a batch size that is not a positive integer and an
    unknown dtype, before anything is loaded."""
    unknown = sorted(k for k in extra if k not in _IGNORED_KWARGS)
    if unknown:
        raise TypeError(f"priortr: unknown model_args {unknown}; see docs/lmms-eval.md")
    if not (str(batch_size).strip().isdigit() and int(batch_size) >= 1):
        raise ValueError(f"priortr: batch_size must be a positive integer; got {batch_size!r}")
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"priortr: dtype must be auto or one of {', '.join(DTYPES)}; got {dtype!r}")


def cut_at_stop(text: str, until: Sequence[str]) -> str:
    """``text`` up to the first occurrence of any (non-empty) stop string."""
    cut = len(text)
    for stop in until:
        if stop:
            found = text.find(stop)
            if found != -1:
                cut = min(cut, found)
    return text[:cut]


class PriorTRLMMs(lmms):
    """lmms-eval model ``priortr``. ``--model_args`` (all optional except ``pretrained``):

    Args:
        pretrained: hub id or local checkpoint directory of a model supported by priortr.
        method: any method of ``priortr methods``, default ``priortr``.
        budget: kept visual tokens per image: int K, or a ratio in (0, 1). Default: apply's (64).
        layer: 0-indexed decoder layer scored by one-layer methods (paper: 2); default: the method's.
        device: ``cuda``, ``cuda:0``, ``cpu``...; default ``cuda`` when available, else ``cpu``. Under
            data parallel each process takes its own (``cuda:LOCAL_RANK``), so leave it unset there.
        device_map: model parallel in one process: passed to ``from_pretrained`` (``auto``,
            ``balanced``, ``sequential``...); inputs go to ``device``. Refused under data parallel.
        dtype: ``auto`` (the checkpoint's), ``float32``, ``float16``, ``bfloat16`` or ``float64``.
        batch_size: requests per forward / generate call (lmms-eval's ``--batch_size``).
        max_new_tokens: generation length when a task does not set one (lmms-eval's llava_hf: 1024).
        heads, posterior_rows: passed to ``priortr.apply``.
        config: a config file of ``priortr.apply`` keywords (``priortr calibrate``'s ``recommended.json``);
            its settings replace the defaults of the arguments above, and one set differently is refused.
        attn_implementation: passed to ``from_pretrained`` (``sdpa``, ``eager``...).
    """

    is_simple = True

    def __init__(
        self,
        pretrained: str,
        method: str = "priortr",
        budget: int | float | str | None = None,
        layer: int | str | None = None,
        device: str | None = None,
        device_map: str | None = None,
        dtype: str = "auto",
        batch_size: int | str = 1,
        max_new_tokens: int = 1024,
        heads: str = "mean",
        posterior_rows: str = "from_separator",
        attn_implementation: str | None = None,
        config: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        _check_filelock()
        _check_model_args(kwargs, batch_size, dtype)
        self.batch_size = int(batch_size)  # the CLI passes --batch_size as a string
        place = placement(device, device_map)
        self.device = place.device
        if place.accelerator is not None:
            self.accelerator = place.accelerator  # lmms-eval's evaluator gathers through lm.accelerator
            self._rank, self._world_size = place.rank, place.world_size
        self.max_new_tokens = int(max_new_tokens)
        self._load(pretrained, dtype, device_map, attn_implementation)
        self.handle = priortr.apply(
            self.model,
            method=method,
            budget=parse_budget(budget),
            layer=None if layer in (None, "", "None") else int(layer),
            heads=heads,
            posterior_rows=posterior_rows,
            **({"config": config} if config else {}),
        )
        self.budget = self.handle.config.budget
        self._stats = {kind: KeptStats() for kind in REQUEST_TYPES}
        where = f"device_map={device_map}" if device_map else str(self.device)
        if self.world_size > 1:
            where += f" (process {self.rank} of {self.world_size}, data parallel)"
        eval_logger.info(
            f"priortr: {pretrained} ({type(self.model).__name__}, {self.model.dtype}) on {where}, "
            f"method={self.handle.config.method.name} budget={self.budget} layer={self.handle.config.layer} "
            f"batch_size={self.batch_size}"
        )

    def _load(
        self, pretrained: str, dtype: str, device_map: str | None, attn_implementation: str | None
    ) -> None:
        """The processor and model, straight onto this process's device (no host copy per process) or
        split by ``device_map``; batched generation pads on the left, so every row ends at the last column."""
        self.processor, self.model = load(
            pretrained,
            dtype,
            str(self.device),
            attn_implementation=attn_implementation,
            device_map=device_map or str(self.device),
            option="pretrained",
        )
        if getattr(self.processor, "chat_template", None) is None:
            raise ValueError(f"priortr: the processor of {pretrained!r} has no chat template")
        self.tokenizer = self.processor.tokenizer
        self.image_token_id = self.model.config.image_token_id
        self.tokenizer.padding_side = "left"
        self.pad_token_id = (
            self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else self.tokenizer.eos_token_id
        )

    # -- shared helpers ------------------------------------------------------------------------------

    def _images(self, doc_to_visual: Callable, task: str, split: str, doc_id: int) -> list[Image.Image]:
        visuals = doc_to_visual(self.task_dict[task][split][doc_id]) or []
        visuals = [v for v in visuals if v is not None]
        for visual in visuals:
            if not isinstance(visual, Image.Image):
                raise NotImplementedError(
                    f"priortr: task {task!r} gives a {type(visual).__name__} visual; only images are "
                    "supported"
                )
        return [v.convert("RGB") for v in visuals]

    def _encode(self, texts: list[str], images: list[list[Image.Image]]) -> Any:
        """Left-padded batch of prompt texts (special tokens come from the template) and their images."""
        flat = [image for row in images for image in row]
        inputs = self.processor(
            text=texts,
            images=flat or None,
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        )
        return inputs.to(self.device, dtype=self.model.dtype)  # only floating tensors (pixels) are cast

    def _with_continuations(self, prompts: Any, tails: list[list[int]]) -> tuple[dict[str, Any], int]:
        """The encoded prompts (left padded) followed by each row's continuation tokens ``tails``,
        right padded; and P, the prompts' columns. Per-token inputs other than the ids (token types)
        get 0 on the continuation, as text."""
        ids = prompts["input_ids"]
        batch, end = ids.shape
        width = max(map(len, tails))
        tail_ids = torch.full((batch, width), self.pad_token_id, dtype=ids.dtype)
        tail_mask = torch.zeros(batch, width, dtype=ids.dtype)
        for row, tail in enumerate(tails):
            tail_ids[row, : len(tail)] = torch.tensor(tail, dtype=ids.dtype)
            tail_mask[row, : len(tail)] = 1
        inputs = dict(prompts)
        for name, value in prompts.items():
            if isinstance(value, torch.Tensor) and value.shape == ids.shape:  # per token: ids, mask, types
                extra = {"input_ids": tail_ids, "attention_mask": tail_mask}.get(
                    name, torch.zeros_like(tail_ids)
                )
                inputs[name] = torch.cat([value, extra.to(value.device, value.dtype)], dim=1)
        return inputs, end

    def _text_ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _kept(self, before: Any) -> tuple[int, int, int]:
        """(rows with images, K, N) summed over the rows of the prefill just run; (0, 0, 0) when priortr
        skipped it (no row has an image)."""
        last = self.handle.last
        if last is None or last is before:
            return 0, 0, 0
        return int((last.n_visual > 0).sum()), int((last.kept >= 0).sum()), int(last.n_visual.sum())

    def clean(self) -> None:
        """lmms-eval calls this on every process once every request has run: log the statistics of each
        request type (summed over the processes of a data-parallel run) on the first process, which writes
        results.json, then free the model as the base class does."""
        for kind in REQUEST_TYPES:
            stats = self._stats[kind]
            if self.world_size > 1:
                stats = stats.summed_over_processes(self.accelerator, self.device)
            if self.rank == 0 and stats.requests:
                report_stats(kind, stats, self.budget)
        self._stats = {kind: KeptStats() for kind in REQUEST_TYPES}
        super().clean()

    # -- generate_until ------------------------------------------------------------------------------

    def generate_until(self, requests: list[Instance]) -> list[str]:
        """Greedy answers in request order; lmms-eval's padding requests get "" without running."""
        answers: list[str] = [""] * len(requests)
        items = [(index, request.args) for index, request in enumerate(requests) if not is_padding(request)]
        collator = lmms_utils.Collator(
            items, lambda item: (-len(item[1][0]), item[0]), group_fn=lambda item: item[1][1], grouping=True
        )
        stats = self._stats["generate_until"]
        for chunk in collator.get_batched(n=self.batch_size):
            indices = [index for index, _ in chunk]
            gen_kwargs = dict(chunk[0][1][1] or {})
            until = gen_kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new_tokens = int(gen_kwargs.pop("max_new_tokens", None) or self.max_new_tokens)
            if float(gen_kwargs.get("temperature") or 0) > 0 or gen_kwargs.get("do_sample"):
                eval_logger.warning("priortr: the task asks for sampling; the plug-in decodes greedily")
            images = [self._images(d2v, task, split, doc_id) for _, (_, _, d2v, doc_id, task, split) in chunk]
            prompts = [
                prompt_text(self.processor, args[0], len(imgs))
                for (_, args), imgs in zip(chunk, images, strict=True)
            ]
            inputs = self._encode(prompts, images)
            before = self.handle.last
            clock = Clock(self.device)
            clock.mark("start")
            with torch.inference_mode():
                output = self.model.generate(
                    **inputs,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    num_beams=1,
                    pad_token_id=self.pad_token_id,
                )
            clock.mark("end")
            stats.elapsed += clock.elapsed_ms("start", "end") / 1e3
            stats.add(len(chunk), *self._kept(before))
            new_tokens = output[:, inputs["input_ids"].shape[1] :]
            stats.gen_tokens += int((new_tokens != self.pad_token_id).sum())
            texts = self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
            for index, text in zip(indices, texts, strict=True):
                answers[index] = cut_at_stop(text, until).strip()
        return answers

    # -- loglikelihood -------------------------------------------------------------------------------

    def loglikelihood(self, requests: list[Instance]) -> list[GenerationResult]:
        """(negative log-likelihood of the continuation, whether it is the greedy continuation), per request.

        lmms-eval 0.7 treats this value as a loss: ``multiple_choice`` takes ``argmin`` over the choices.
        Here it is ``-sum(log p)`` over the continuation's tokens, the exact negation of lm-eval's
        log-likelihood, so the choice ranking is lm-eval's (lmms-eval's llava_hf returns the token mean
        instead; both rank single-token choices identically). Returned as
        ``GenerationResult(text=(nll, is_greedy))``: lmms-eval 0.7 passes every model output through
        ``unwrap_generation_output``, which turns a bare tuple into its string. lmms-eval's padding
        requests get ``(nan, False)`` without running.
        """
        results = [GenerationResult(text=(math.nan, False))] * len(requests)  # type: ignore[arg-type]
        rows = []
        for index, request in enumerate(requests):
            if is_padding(request):
                continue
            context, target, d2v, doc_id, task, split = request.args
            continuation = target if isinstance(target, str) else target(self.task_dict[task][split][doc_id])
            rows.append((index, context, continuation, d2v, doc_id, task, split))
        collator = lmms_utils.Collator(rows, lambda row: (-len(row[1]) - len(row[2]), row[0]))
        stats = self._stats["loglikelihood"]
        for chunk in collator.get_batched(n=self.batch_size):
            images = [self._images(row[3], row[5], row[6], row[4]) for row in chunk]
            clock = Clock(self.device)
            clock.mark("start")
            scored = self._score([row[1] for row in chunk], [row[2] for row in chunk], images, stats)
            for row, (ll, greedy) in zip(chunk, scored, strict=True):
                results[row[0]] = GenerationResult(text=(-ll, greedy))  # type: ignore[arg-type]
            clock.mark("end")
            stats.elapsed += clock.elapsed_ms("start", "end") / 1e3
        return results

    def _score(
        self,
        contexts: list[str],
        continuations: list[str],
        images: list[list[Image.Image]],
        stats: KeptStats | None = None,
    ) -> list[tuple[float, bool]]:
        """(sum of log-probs, is_greedy) of each continuation after its prompt, in one call (rows with
        different visual-token counts, several images or none are one batch).

        The continuation's tokens are those of tokenize(prompt + continuation) past tokenize(prompt), as
        lm-eval splits them. The batch is laid out as [prompt, left padded | continuation, right
        padded], so that every prompt ends at one column P: the call runs in ``handle.prompt_ends(P)``
        and returns the prompt's rows (``handle.last.positions``, its last one the prompt's last token:
        text after the image is always kept) followed by one row per continuation column. The row of
        position p predicts the token at p + 1.
        """
        prompts = [
            prompt_text(self.processor, context, len(imgs))
            for context, imgs in zip(contexts, images, strict=True)
        ]
        tails = []
        for prompt, continuation in zip(prompts, continuations, strict=True):
            whole = self._text_ids(prompt + continuation)
            n = len(whole) - len(self._text_ids(prompt))
            if n < 1:
                raise ValueError(f"priortr: the continuation {continuation!r} adds no token to the prompt")
            tails.append(whole[-n:])
        out: list[tuple[float, bool]] = []
        inputs, end = self._with_continuations(self._encode(prompts, images), tails)
        before = self.handle.last
        with torch.inference_mode(), self.handle.prompt_ends(at=end):
            logits = self.model(**inputs, use_cache=False).logits  # [B, S' + T, V]
        kept = self._kept(before)
        if stats is not None:
            stats.add(len(prompts), *kept)
        prompt_rows = logits.shape[1] - (inputs["input_ids"].shape[1] - end)  # S'
        if kept[0] > 0:
            positions = self.handle.last.positions  # [B, S'] the prompt's rows
            if positions.shape[1] != prompt_rows or not bool((positions[:, -1] == end - 1).all()):
                raise RuntimeError("priortr: the prompt's last token is not the last of its logits rows")
        for row, tail in enumerate(tails):
            n = len(tail)
            target = inputs["input_ids"][row, end : end + n]
            rows_logits = logits[row, prompt_rows - 1 : prompt_rows - 1 + n]
            # at least float32 (fp16/bf16 models), float64 stays float64
            dtype = torch.promote_types(rows_logits.dtype, torch.float32)
            log_probs = torch.log_softmax(rows_logits.to(dtype), dim=-1)
            ll = float(log_probs.gather(1, target[:, None]).sum())
            greedy = bool((log_probs.argmax(dim=-1) == target).all())
            out.append((ll, greedy))
        return out

    def generate_until_multi_round(self, requests: list[Instance]) -> list[str]:
        raise NotImplementedError("priortr: multi-round generation is not supported by the priortr plug-in")
