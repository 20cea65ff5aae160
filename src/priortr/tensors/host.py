"""Moving planning data between the host and the model's device without stalling the device's queue.

The engine reads the prompt once (``to_host``: the only blocking copy of a prefill) and sends the
index tensors it plans back in one copy that does not wait for the device (``to_device_once``: one
host-to-device transfer for the whole plan, where one per tensor cost a copy each on a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_ALIGN = 8  # bytes: every packed tensor starts where an int64 or float64 view of the buffer may start


def to_host(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Host copies of same-shaped integer or boolean ``tensors``, in one device-to-host transfer."""
    if all(tensor.device.type == "cpu" for tensor in tensors):
        return tensors
    stacked = torch.stack([tensor.long() for tensor in tensors]).cpu()
    return tuple(part.to(tensor.dtype) for part, tensor in zip(stacked, tensors, strict=True))


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` (on the host) on ``device``; the copy is queued, the host does not wait for it."""
    return tensor.to(device, non_blocking=True)


def to_device_once(tensors: Sequence[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """``tensors`` (on the host) on ``device`` in one queued copy: their bytes packed into one host buffer
    (pinned on a CUDA device, so that the copy does not wait for the host either), copied once, and
    viewed back as each tensor's dtype and shape on the device. No kernel runs on the device."""
    device = torch.device(device)
    if not tensors:
        return []
    parts, spans, offset = [], [], 0
    for tensor in tensors:
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        padding = -data.numel() % _ALIGN
        parts.append(torch.cat([data, data.new_zeros(padding)]) if padding else data)
        spans.append((offset, data.numel()))
        offset += data.numel() + padding
    buffer = torch.cat(parts)
    if device.type == "cuda":
        buffer = buffer.pin_memory()
    copied = buffer.to(device, non_blocking=True)
    return [
        copied[start : start + size].view(tensor.dtype).view(tensor.shape)
        for (start, size), tensor in zip(spans, tensors, strict=True)
    ]
