"""torch DDP internals with no counterpart in gradsync: a method that says so, instead of an AttributeError."""

from __future__ import annotations

from typing import Any, Callable


def torch_internal(name: str, instead: str) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"DistributedDataParallel.{name} is an internal of torch's C++-reducer DDP with no "
            f"counterpart in gradsync; {instead}"
        )

    method.__name__ = method.__qualname__ = name
    return method
