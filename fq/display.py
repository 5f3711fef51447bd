"""Showing names fq did not choose (file names in a tree, names inside signed documents, arguments) in
one-line messages without letting them act on the terminal.

``printable(text)`` keeps printable ASCII and the two marks fq's own messages use (``…``, ``—``) and
escapes everything else the way Python spells it in a string literal: control characters (``\\x1b``,
``\\r``, ``\\n``), DEL, every other non-ASCII character — including letters that look like ASCII ones
(Cyrillic ``а`` is ``\\u0430``) and bidi overrides — and bytes that were not UTF-8 in a file name
(``\\xff``, from Python's surrogate escapes). A file named ``\\x1b[2K\\r\\nok: …`` cannot erase a line
or start a fake one. It is applied to every ``FqError`` message (``fq.errors``) and to every line
``fq verify`` prints; escaping twice changes nothing.
"""
from __future__ import annotations

import re

_KEEP = "…—"
_UNSAFE = re.compile(f"[^\x20-\x7e{_KEEP}]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(m: re.Match) -> str:
    ch = m.group()
    o = ord(ch)
    if ch in _NAMED:
        return _NAMED[ch]
    if 0xDC80 <= o <= 0xDCFF:  # a byte of a file name that was not UTF-8 (os.fsdecode's surrogateescape)
        return f"\\x{o - 0xDC00:02x}"
    if o < 0x100:
        return f"\\x{o:02x}"
    return f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def printable(text: str) -> str:
    """``text`` with every control, non-ASCII or lookalike character escaped (fq's ``…`` and ``—`` kept)."""
    return _UNSAFE.sub(_escape, text)
