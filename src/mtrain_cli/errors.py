"""Errors shown to users as one line (exit code 2, no traceback)."""


class UserError(Exception):
    """Bad input from the user: the message names the field, the value and the fix."""
