"""The text rows' attention is reduced a chunk of rows at a time (``evidence.RowAttention``): every
method that reads attention evidence chooses and scores as with one unchunked tensor, and a long chat's
evidence stays within the bound docs/how-it-works.md states ("Memory"), where one [B, H, R, S'] tensor
(main before issue 46) exceeds it.

Peak memory is measured, not estimated: torch's profiler records every CPU allocation and free of the
evidence call (``profile_memory``), and the peak is the running sum's maximum.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import priortr
from priortr.engine import evidence
from priortr.methods import available_methods, get_method
from tests.helpers.tiny import llava_batch, tiny_llava

ATTENTION_METHODS = sorted(
    name for name in available_methods() if get_method(name).needs & {"attention", "next_attention"}
)
TEXT_AFTER = 40  # R = 42 recomputed rows: chunks of 1 and 5 rows cut them unevenly


def pruned(model, batch, method: str, chunk: int | None, monkeypatch, heads: str = "mean") -> Any:
    """The last prefill's record under ``method`` (aggregating ``heads``) with chunks of ``chunk``
    elements (None: the default, one chunk here)."""
    if chunk is not None:
        monkeypatch.setattr(evidence, "ROW_CHUNK_ELEMENTS", chunk)
    one_layer = get_method(method).where == "layer"
    settings = {"budget": 6, "layer": 1} if one_layer else {"stages": [(1, 8), (2, 4)]}
    settings["heads"] = heads
    with priortr.apply(model, method=method, **settings) as handle, torch.no_grad():
        model(**batch.kwargs())
    monkeypatch.undo()
    return handle.last


@pytest.fixture(scope="module")
def float64_model():
    model = tiny_llava(torch.float64)
    return model, llava_batch(model, 2, text_after=(TEXT_AFTER,))


@pytest.mark.parametrize(
    ("method", "heads"), [*((name, "mean") for name in ATTENTION_METHODS), ("priortr", "max")]
)
def test_chunked_rows_choose_and_score_as_one_tensor(float64_model, method, heads, monkeypatch):
    """Float64 model, two left-padded rows: chunks of one row and of five rows against one chunk. The
    prior and last rows are picked, not computed, so they match bit for bit; the posterior is a sum over
    rows in another order, equal within 1e-12 (float64 running sums, float32 evidence: equal here to
    the last bit)."""
    model, batch = float64_model
    whole = pruned(model, batch, method, None, monkeypatch, heads)
    row = 2 * model.config.text_config.num_attention_heads * batch.seq_len  # B H S' elements
    for rows in (1, 5):
        chunked = pruned(model, batch, method, row * rows, monkeypatch, heads)
        assert torch.equal(chunked.kept, whole.kept), rows
        assert (chunked.prior is None) == (whole.prior is None)  # a merging method records no prior
        if whole.prior is not None:
            assert torch.equal(chunked.prior, whole.prior), rows
            torch.testing.assert_close(chunked.posterior, whole.posterior, rtol=0, atol=1e-12)
            torch.testing.assert_close(chunked.scores, whole.scores, rtol=0, atol=1e-12)


def test_a_chunk_holds_at_least_one_row():
    queries, keys = torch.zeros(2, 4, 10, 8), torch.zeros(2, 2, 30, 8)
    spec = evidence.RowSpec(torch.zeros(2, 10, dtype=torch.long), torch.ones(2, 30, dtype=torch.bool))
    rows = evidence.RowAttention(queries, keys, spec, 1.0, heads=4)
    assert rows.chunks(1) == [slice(i, i + 1) for i in range(10)]
    assert rows.chunks(2 * 4 * 30 * 4) == [slice(0, 4), slice(4, 8), slice(8, 10)]
    assert rows.chunks(1 << 30) == [slice(0, 10)]


def peak_bytes(call: Callable[[], Any]) -> int:
    """The most bytes ``call`` held at once on the CPU beyond what was allocated before it: each
    operator's own allocations net of its frees, and the profiler's bare allocation and free events,
    summed in time order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    steps = sorted(
        (
            event.time_range.start,
            event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage,
        )
        for event in prof.events()
    )
    held = peak = 0
    for _, change in steps:
        held += change
        peak = max(peak, held)
    return peak


CHUNK = 1 << 18  # elements of one chunk in the long chat below: 1 MiB of float32
LONG_CHAT = 2400  # text rows after the image


def bound(heads: int, kv_heads: int, dim: int, seq: int, rows: int, visual: int) -> int:
    """docs/how-it-works.md's bound on one prompt's (B = 1) evidence in float32 (4 bytes): four chunks
    of max(CHUNK, H S') elements (the softmax's input and output, the mask's fill and the visual
    columns gathered), the rows' queries and the keys after RoPE, twice (before and after rotation),
    and the [R, n] head aggregates a method that weighs rows reads (``text_rows``), once each."""
    chunk = max(CHUNK, heads * seq)
    return 4 * (4 * chunk + 2 * (heads * rows + kv_heads * seq) * dim + rows * visual)


@pytest.mark.parametrize("method", ["priortr", "priortr+merge"])
def test_a_long_chats_evidence_stays_within_the_bound(method, monkeypatch):
    """R = 2402 rows, S' = 2422 columns, H = 4: one [1, H, R, S'] float32 tensor is 93 MiB, and the
    bound with 1 MiB chunks is about 6 MiB. The peak of the stage's attention evidence (the gatherer
    that computes it) is measured; main's code holds the whole tensor, several times over."""
    model = tiny_llava(torch.float32, text={"max_position_embeddings": 4096})
    batch = llava_batch(model, 1, text_after=(LONG_CHAT,))
    text = model.config.text_config
    dim = text.hidden_size // text.num_attention_heads
    rows = LONG_CHAT + 2
    limit = bound(
        text.num_attention_heads, text.num_key_value_heads, dim, batch.seq_len, rows, batch.n_visual
    )
    whole = 4 * text.num_attention_heads * rows * batch.seq_len
    assert whole > 10 * limit  # the test can tell one tensor from chunks
    monkeypatch.setattr(evidence, "ROW_CHUNK_ELEMENTS", CHUNK, raising=False)
    key = next(needs for needs in evidence.GATHERERS if "attention" in needs)
    gatherer = evidence.GATHERERS[key]
    peaks: list[int] = []

    def measured(sources, group):
        out: dict[str, Any] = {}
        peaks.append(peak_bytes(lambda: out.update(gatherer(sources, group))))
        return out

    monkeypatch.setitem(evidence.GATHERERS, key, measured)
    with priortr.apply(model, method=method, budget=6, layer=1), torch.no_grad():
        model(**batch.kwargs())
    assert len(peaks) == 1
    assert 0 < peaks[0] <= limit, (peaks[0], limit, whole)
