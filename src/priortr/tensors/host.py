"""Moving planning data between the host and the model's device without stalling the device's queue.

The engine reads the prompt once (``to_host``: the only blocking copy of a prefill) and sends the
index tensors it plans back with copies that do not wait for the device (``to_device``).
"""

from __future__ import annotations

import torch


def to_host(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Host copies of same-shaped integer or boolean ``tensors``, in one device-to-host transfer."""
    if all(tensor.device.type == "cpu" for tensor in tensors):
        return tensors
    stacked = torch.stack([tensor.long() for tensor in tensors]).cpu()
    return tuple(part.to(tensor.dtype) for part, tensor in zip(stacked, tensors, strict=True))


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` (on the host) on ``device``; the copy is queued, the host does not wait for it."""
    return tensor.to(device, non_blocking=True)
