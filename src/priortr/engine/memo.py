"""``memo``: a property computed once per instance, that torch.compile can trace.

``functools.cached_property`` takes an ``RLock`` on Python 3.11, which dynamo cannot enter: every stage
that read one broke the compiled prefill's graph. The objects that use ``memo`` (a stage's sources, a
sequence map) belong to one prefill and one thread, so they need no lock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

Value = TypeVar("Value")


class memo(Generic[Value]):
    """Like ``functools.cached_property`` without its lock: the first read computes the value and stores
    it in the instance's ``__dict__`` (frozen dataclasses too), where later reads find it first."""

    def __init__(self, compute: Callable[[Any], Value]) -> None:
        self.compute = compute
        self.name = compute.__name__
        self.__doc__ = compute.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        value = self.compute(instance)
        instance.__dict__[self.name] = value
        return value
