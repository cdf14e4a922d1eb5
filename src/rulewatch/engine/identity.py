"""One identity rule for transaction ids and grouping keys, the same in silver, keying and rule filters.

Two values name the same thing when they are equal after ``canonical``: surrounding white space
(Unicode's White_Space, plus the zero-width space and the byte-order mark, which no one sees)
removed, then Unicode NFC. Without it ``"g "`` was a duplicate of ``"g"`` (silver trimmed ids only)
while ``"payee "`` and ``"payee"``, or ``é`` and ``e`` + combining accent, were different keys: a cheap
way to split one payee's payments below a limit. Inner white space and letter case are kept: ids
differing there are different ids.
"""

from __future__ import annotations

import unicodedata

# Unicode White_Space (PropList.txt), then U+200B ZERO WIDTH SPACE and U+FEFF BYTE ORDER MARK.
EDGE_CHARACTERS = (
    "\t\n\u000b\u000c\r \u0085\u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000\u200b\ufeff"
)


def trimmed(text: str) -> str:
    return text.strip(EDGE_CHARACTERS)


def composed(text: str | None) -> str | None:
    """NFC of ``text`` (None stays None); ASCII text is NFC already."""
    return text if text is None or text.isascii() else unicodedata.normalize("NFC", text)


def canonical(text: str) -> str:
    """The value an id or key is compared by: trimmed, then NFC."""
    return composed(trimmed(text))
