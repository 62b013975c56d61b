"""User-facing errors: the CLI prints their message (no traceback) and exits 2."""
from __future__ import annotations

from collections.abc import Iterator


class UserError(ValueError):
    """A problem the user can fix; the message names it and says how."""


def exception_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc`, then its cause (or context), and so on; each exception once."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__
