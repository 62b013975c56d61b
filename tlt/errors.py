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


# A failure of this kind repeats when the same code runs again on the same inputs (a bug, a model or
# setting tlt cannot handle); an outage, a lost connection, a killed worker or an OOM (OSError,
# RuntimeError) may not, so only those are worth a retry.
_DETERMINISTIC = (ValueError, LookupError, AttributeError, TypeError, NotImplementedError, ImportError,
                  AssertionError, ArithmeticError)


def deterministic(exc: BaseException | None) -> bool:
    """True when a retry would fail the same way: a `UserError` anywhere in the exception's chain, or
    the exception itself one of the deterministic kinds above (a KeyError in a model's config, ...)."""
    if exc is None:
        return False
    return isinstance(exc, _DETERMINISTIC) or any(isinstance(e, UserError) for e in exception_chain(exc))
