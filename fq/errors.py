"""The one error type fq raises for bad input or refused operations.

CLI entry points print ``str(err)`` as a single line and exit non-zero; library callers catch it.
Subclassing ValueError keeps ``except ValueError`` working for codec callers. The message is made
printable (``fq.display.printable``) when the error is made: names it embeds come from files and
documents fq does not control, and must not reach a terminal as control characters or lookalikes.
"""
from fq.display import printable


class FqError(ValueError):
    """Bad input or a refused operation; the message names the file/tensor, the field and what was expected."""

    def __init__(self, message: object = "", *args):
        super().__init__(printable(str(message)), *args)


class SignatureError(FqError):
    """A signed document with no valid signature by the pinned key: signed by another key, or altered after
    signing. ``keyids``: the (unauthenticated) key ids its signatures name, for a one-line wrong-key report."""

    def __init__(self, message: str, keyids: tuple[str, ...] = ()):
        super().__init__(message)
        self.keyids = tuple(keyids)
