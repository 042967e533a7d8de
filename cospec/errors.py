"""The one exception type users see.

Anything raised as :class:`CoSpecError` is a user-facing problem (a wrong path, a bad
config value, incompatible models). The CLI prints its message as a single line and exits
with status 2 instead of showing a traceback from deep inside a library.
"""


class CoSpecError(Exception):
    """A problem with the user's input or setup, explained in one line."""
