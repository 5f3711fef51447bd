"""The one error type fq raises for bad input or refused operations.

CLI entry points print ``str(err)`` as a single line and exit non-zero; library callers catch it.
Subclassing ValueError keeps ``except ValueError`` working for codec callers.
"""


class FqError(ValueError):
    """Bad input or a refused operation; the message names the file/tensor, the field and what was expected."""
