"""A package's public names imported on first use (PEP 562), so that importing one name
loads the modules that name needs and not the whole package.

A package lists each public name with the module and attribute it comes from, and imports
the same names under ``if TYPE_CHECKING:`` for type checkers and editors::

    _EXPORTS = {"Publisher": ("broker_adapter.client.publisher", "Publisher")}
    if not TYPE_CHECKING:
        __getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

(``tests/unit/test_lazy_exports.py`` checks that the table, ``__all__`` and those
imports name the same objects.)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    namespace: dict[str, Any], exports: Mapping[str, tuple[str, str]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module's ``__getattr__`` and ``__dir__`` for the names of ``exports`` (name ->
    (module, attribute)), ``namespace`` being the module's ``globals()``. A name is
    imported the first time it is asked for, then kept in ``namespace``."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        try:
            module, attribute = exports[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(module), attribute)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
