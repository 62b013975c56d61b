"""User-facing errors: the CLI prints their message (no traceback) and exits 2."""


class UserError(ValueError):
    """A problem the user can fix; the message names it and says how."""
