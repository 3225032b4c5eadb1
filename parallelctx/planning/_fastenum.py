"""Fast ``SomeEnum.MEMBER`` lookups on Python 3.11.

On 3.11 ``EnumType`` defines ``__getattr__``, which routes every class attribute access through
a slow generic hook (about 70-90 ns for ``ParallelMode.TENSOR``, more than the query it feeds).
Python 3.12 removed that method; there this module changes nothing.

On 3.11 an enum built with its own subclass of :class:`FastEnumType` as metaclass is switched,
once built, by :func:`speed_up`: its metaclass then reads attributes with ``object.__getattribute__`` (the
C fast path: the metaclass's data descriptors, then the class's own ``__dict__``, where the
members live) and falls back to the full ``type.__getattribute__`` for everything else. Names
of the class's own ``__dict__`` that the fast path would return unbound (classmethods) are
stored bound, so every non-dunder attribute reads exactly as with ``EnumType`` (the tests
compare them all). Dunder methods read through the *class* (``ParallelMode.__len__``) may
resolve to the metaclass's; instances, ``repr()``, ``hash()``, ``==``, iteration, pickling and
copying are unchanged.
"""

from __future__ import annotations

import sys
from enum import EnumType
from typing import Any

__all__ = ["FastEnumType", "speed_up"]

_FAST = sys.version_info < (3, 12)


class FastEnumType(EnumType):
    """Base of a metaclass for one enum that :func:`speed_up` switches to fast member lookups.

    Give each such enum a subclass of its own (``class _ModeType(FastEnumType): pass``), so
    switching it affects nothing else.
    """

    if _FAST:

        def __getattr__(cls, attr: str) -> Any:
            try:
                return type.__getattribute__(cls, attr)
            except AttributeError:
                return EnumType.__getattr__(cls, attr)  # type: ignore[attr-defined]


def speed_up(cls: Any) -> Any:
    """Switch ``cls`` (built with its own subclass of :class:`FastEnumType` as metaclass) to fast
    member lookups; a no-op on Python 3.12 and later.

    Returns:
        ``cls``.

    Raises:
        TypeError: ``cls``'s metaclass is not a subclass of FastEnumType of its own.
    """
    if not _FAST:
        return cls
    meta = type(cls)
    if not issubclass(meta, FastEnumType) or meta is FastEnumType or type.__subclasses__(meta):
        raise TypeError(f"{cls.__name__}'s metaclass must be a subclass of FastEnumType of its own")
    classes: list[type] = [*cls.__mro__, *type.mro(meta)]
    names = {n for k in classes for n in vars(k)}
    fixes: dict[str, Any] = {}
    for name in names:
        if name.startswith("__") and name.endswith("__"):
            continue  # writing a dunder would change the class's C slots
        try:
            want = type.__getattribute__(cls, name)
            got = object.__getattribute__(cls, name)
        except AttributeError:
            continue
        if got is not want and got != want:
            fixes[name] = want
    for name, value in fixes.items():
        type.__setattr__(cls, name, value)
    type.__setattr__(meta, "__getattribute__", object.__getattribute__)
    return cls
