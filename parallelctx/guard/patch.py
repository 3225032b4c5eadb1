"""Replacing attributes of torch (a module's functions, a class's methods) and putting them back.

The hang report wraps ``ProcessGroup``'s collective methods and the dry run wraps
``torch.distributed``'s functions; both must restore exactly what was there, and must leave alone
what someone else replaced since (a test's monkeypatch, a second wrapper).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Patches"]

_ABSENT = object()


class Patches:
    """Attributes this object replaced, to put back with :meth:`restore`.

    On a class the class's own attribute is saved (``vars(cls)[name]``, e.g. pybind's
    instancemethod, which binds ``self`` once set back; the function ``getattr`` gives would
    not), on a module the attribute itself. Not thread-safe: patch and restore from one thread.
    """

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any, Any]] = []  # (owner, name, original, replacement)

    def replace(self, owner: Any, name: str, make: Callable[[Any], Any]) -> Any:
        """Set ``owner.name`` to ``make(current)``, where ``current`` is what ``getattr`` gives
        now; the replacement gets ``__wrapped__ = current``.

        Returns:
            The replacement.

        Raises:
            AttributeError: ``owner`` has no attribute ``name``.
        """
        current = getattr(owner, name)
        original = vars(owner).get(name, _ABSENT) if isinstance(owner, type) else current
        replacement = make(current)
        try:
            replacement.__wrapped__ = current
        except (AttributeError, TypeError):
            pass
        setattr(owner, name, replacement)
        self._saved.append((owner, name, original, replacement))
        return replacement

    def restore(self) -> None:
        """Put back every attribute :meth:`replace` set, last first, unless it was replaced
        again since (then that one is left in place); returns None. Calling it twice is harmless."""
        while self._saved:
            owner, name, original, replacement = self._saved.pop()
            now = vars(owner).get(name, _ABSENT) if isinstance(owner, type) else getattr(owner, name, _ABSENT)
            if now is not replacement:
                continue
            if original is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, original)

    def __bool__(self) -> bool:
        return bool(self._saved)
