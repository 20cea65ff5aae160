"""Which image-text models of the installed transformers priortr prunes, for ``priortr families``.

Every class transformers' image-text auto mappings list (``priortr.compat.model_classes``) is one row, marked
from the adapter registry (``priortr.adapters``), so a family whose adapter is registered shows as
supported with no edit here, and a family a new transformers release adds shows as ``not yet``:

* ``supported``: an adapter is registered for its ``model_type`` (named in the row);
* ``refused``: priortr knows it cannot prune it exactly (``adapters.register_refusal``; the reason);
* ``not yet``: no adapter. Where its class is one an adapter serves under another model type (a
  checkpoint variant such as ShieldGemma 2 on Gemma 3's class), the row says so: ``priortr.apply``
  keys on ``config.model_type`` and refuses it all the same.

Registered model types the installed release does not ship (an adapter for a newer family, on an older
release) are listed apart (``absent``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from priortr import adapters, compat

STATUSES = ("supported", "refused", "not yet")


@dataclass(frozen=True)
class FamilySupport:
    """One image-text model class: its ``model_type``, the class transformers' auto model builds for
    it, its ``status`` (one of ``STATUSES``), the priortr adapter that serves it (``supported`` only)
    and a ``note`` (a refusal's reason, or the supported model type whose class it shares)."""

    model_type: str
    model_class: str
    status: str
    adapter: str | None = None
    note: str = ""


def family_support() -> list[FamilySupport]:
    """Every image-text model class of the installed transformers, by model type, with its support."""
    classes = compat.model_classes.image_text_classes()
    supported = set(adapters.supported_model_types())
    refused = adapters.refusals()
    served = {classes[t]: t for t in sorted(supported) if t in classes}  # class -> a model type it serves
    rows = []
    for model_type, model_class in classes.items():
        if model_type in supported:
            adapter = adapters.adapter_for_type(model_type).name
            rows.append(FamilySupport(model_type, model_class, "supported", adapter))
        elif model_type in refused:
            rows.append(FamilySupport(model_type, model_class, "refused", note=refused[model_type]))
        elif model_class in served:
            note = f"its class is {served[model_class]!r}'s, but this model type has no adapter"
            rows.append(FamilySupport(model_type, model_class, "not yet", note=note))
        else:
            rows.append(FamilySupport(model_type, model_class, "not yet"))
    return rows


def absent_model_types() -> list[str]:
    """Model types with an adapter or a refusal that the installed release ships no image-text class
    for (families newer than the release)."""
    shipped = compat.model_classes.image_text_classes()
    known = set(adapters.supported_model_types()) | set(adapters.refusals())
    return sorted(known - set(shipped))


def as_json(rows: list[FamilySupport]) -> dict:
    """The listing as one JSON-ready document: the release, every row, and the absent model types."""
    return {
        "transformers": compat.release.installed(),
        "families": [asdict(row) for row in rows],
        "absent": absent_model_types(),
    }


def format_table(rows: list[FamilySupport]) -> str:
    """A plain-text table of ``rows``: model type, class, status and the adapter or note, then a count
    per status and the absent model types."""
    lines = [f"image-text models of transformers {compat.release.installed()}:"]
    width_type = max(len("model type"), *(len(row.model_type) for row in rows))
    width_class = max(len("class"), *(len(row.model_class) for row in rows))
    lines.append(f"{'model type':<{width_type}}  {'class':<{width_class}}  {'status':<9}  adapter / note")
    for row in rows:
        detail = f"adapter {row.adapter}" if row.adapter else row.note
        line = f"{row.model_type:<{width_type}}  {row.model_class:<{width_class}}  {row.status:<9}  {detail}"
        lines.append(line.rstrip())
    counts = ", ".join(f"{sum(row.status == s for row in rows)} {s}" for s in STATUSES)
    lines.append(f"{len(rows)} classes: {counts}")
    absent = absent_model_types()
    if absent:
        lines.append(f"adapters for model types this release does not ship: {', '.join(absent)}")
    return "\n".join(lines)
