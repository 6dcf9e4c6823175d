r"""Registries of classes by name, which refuse a name already taken by another class.

One map from a name to a class, used by ``fit`` (engines), ``load`` (posterior kinds and
models) and the contract tests that run every entry; registering the same class again
(the same module and qualified name: a module reloaded, a test's class defined anew) is
allowed and takes the newer definition; another class under a taken name is not.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Callable, Generic, TypeVar

from aml_ppl.errors import AmlPplError

Entry = TypeVar("Entry", bound=type)


class Registry(Mapping[str, Entry], Generic[Entry]):
    r"""Classes by name; read as a mapping, written only through :meth:`register`.

    Args:
        what: What the entries are, for messages (``"engine"``).
        name_of: The name a class registers under (its ``name`` attribute, say).

    Example:
        >>> engines = Registry("engine", lambda cls: cls.name)
        >>> class Gibbs:
        ...     name = "gibbs"
        >>> engines.register(Gibbs) is Gibbs, sorted(engines)
        (True, ['gibbs'])
        >>> class Other:
        ...     name = "gibbs"
        >>> engines.register(Other)
        Traceback (most recent call last):
        ...
        aml_ppl.errors.AmlPplError: engine name 'gibbs' is taken by Gibbs; give Other another name.
    """

    def __init__(self, what: str, name_of: Callable[[type], str]) -> None:
        self.what = what
        self.name_of = name_of
        self._entries: dict[str, Entry] = {}

    def register(self, cls: Entry) -> Entry:
        r"""Add ``cls`` under its name (a class decorator).

        Raises:
            AmlPplError: If another class holds the name.
        """
        name = self.name_of(cls)
        taken = self._entries.get(name)
        if taken is not None and (taken.__module__, taken.__qualname__) != (cls.__module__, cls.__qualname__):
            raise AmlPplError(
                f"{self.what} name {name!r} is taken by {taken.__qualname__}; give {cls.__qualname__} another name."
            )
        self._entries[name] = cls
        return cls

    def __getitem__(self, name: str) -> Entry:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
