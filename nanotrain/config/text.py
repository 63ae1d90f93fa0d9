"""What a config string may contain: one checker for the loader and for the sbatch values.

Config strings end up in paths, log lines, terminals and the sbatch script. Besides the ASCII
controls, Unicode has characters that break a line (NEL U+0085, U+2028, U+2029), C1 controls
that terminals act on, and bidi overrides/isolates/marks that make a shown value read differently
from what it is ("Trojan Source"), and other format characters (zero-width spaces and joiners,
the byte-order mark, soft hyphens) that make two different values look the same in a path, a
partition or a batch script. None belongs in a config value, so all are refused here.
"""

from __future__ import annotations

import unicodedata

# Cc: C0/C1 controls and DEL; Zl/Zp: line and paragraph separators; Cs: lone surrogates;
# Cf: format characters (invisible: zero-width space/joiners, BOM, soft hyphen, bidi controls).
_REFUSED_CATEGORIES = {"Cc", "Zl", "Zp", "Cs", "Cf"}
# Bidi embeddings/overrides, isolates, and marks (LRM, RLM, ALM): named apart in the message.
_BIDI = {chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x061C)}


def escaped(text: str) -> str:
    """`text` with every non-printable character written as a Python escape ('\\u202e'), so an
    error message that echoes user text never prints a control or bidi character raw."""
    return "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape", "backslashreplace").decode("ascii") for ch in text
    )


def unsafe_char(text: str) -> tuple[int, str] | None:
    """(position, escaped character) of the first character a config string may not hold, or None."""
    for i, ch in enumerate(text):
        if ch in _BIDI or unicodedata.category(ch) in _REFUSED_CATEGORIES:
            return i, escaped(ch)
    return None


def problem(text: str) -> str | None:
    """A one-line description of what is wrong with `text` (for '<field>: ...'), or None."""
    found = unsafe_char(text)
    if found is None:
        return None
    i, shown = found
    ch = text[i]
    if unicodedata.category(ch) == "Cs":
        kind = "a lone surrogate, which is not a Unicode character"
    elif ch in _BIDI:
        kind = "a bidirectional-text control character"
    elif unicodedata.category(ch) in ("Zl", "Zp"):
        kind = "a line separator"
    elif unicodedata.category(ch) == "Cf":
        kind = "an invisible format character"
    else:
        kind = "a control character"
    return f"contains '{shown}' at position {i} ({kind}): one line of printable text, please"
