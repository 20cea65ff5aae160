"""Where the plug-in's model runs: one process on ``device`` (or split by ``device_map``), or one whole model
per process of a data-parallel run (``accelerate launch``), each on its own device."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Placement:
    """This process's ``device``; under data parallel its ``accelerator`` (lmms-eval gathers through
    it), its ``rank`` among ``world_size`` processes."""

    device: torch.device
    accelerator: Any | None = None
    rank: int = 0
    world_size: int = 1


def placement(device: str | None, device_map: str | None) -> Placement:
    """The placement that ``device`` and ``device_map`` ask for; ``cuda`` when available, else ``cpu``."""
    accelerator = data_parallel_accelerator(device, device_map)
    if accelerator is None:
        return Placement(torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")))
    return Placement(accelerator.device, accelerator, accelerator.process_index, accelerator.num_processes)


def data_parallel_accelerator(device: str | None, device_map: str | None) -> Any | None:
    """This process's ``Accelerator`` when lmms-eval runs several processes (``WORLD_SIZE`` > 1, as its
    evaluator reads it to shard the documents), else None.

    Each process then runs the whole model on its own device (``accelerator.device``: ``cuda:LOCAL_RANK``,
    or ``cpu``); a ``device`` naming another one, or a ``device_map``, is refused with the fix.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return None
    if device_map:
        raise ValueError(
            f"priortr: device_map={device_map} (one model split over devices) cannot be combined with "
            f"{world_size} data-parallel processes; run one process with device_map, or "
            "accelerate launch without device_map (each process then holds the whole model)"
        )
    from accelerate import Accelerator

    accelerator = Accelerator()
    own = accelerator.device
    asked = torch.device(device) if device else own
    if asked.type != own.type or (asked.index is not None and asked != own):
        raise ValueError(
            f"priortr: under {world_size} data-parallel processes each process uses its own device "
            f"(this one: {own}); drop device={device} from --model_args and --device"
        )
    return accelerator
