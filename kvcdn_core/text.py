"""The one rule for strings that people give kvcdn and that it shows back: artifact names, manifest
labels (model ids, versions, tensor names...), listing prefixes.

Such strings end up in terminals and listings, so they may hold no character that is invisible,
that rewrites the terminal, or that would make two different strings look the same:

- no control (C0, DEL, C1), format (bidi overrides and isolates, zero-width, word joiners, the
  Arabic letter mark, the Mongolian vowel separator, tags), private-use, unassigned or lone
  surrogate code points, nor line or paragraph separators;
- no white space but the plain space (no no-break, ideographic or other wide spaces);
- none of the characters that draw nothing although Unicode files them as letters, symbols or
  marks (Hangul fillers, the Braille blank, variation selectors, the combining grapheme joiner...);
- no combining mark at the very start (it would join whatever is printed before it), so a string
  made only of combining marks is refused too.

Names are additionally compared after Unicode NFC normalisation (see :func:`nfc`), so that the
composed and decomposed spellings of one name are one name.
"""

from __future__ import annotations

import unicodedata

#: categories refused outright: controls, formats, private use, unassigned, surrogates, separators
REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Co", "Cn", "Cs", "Zl", "Zp"})
#: characters that draw nothing but are not in a refused category (default-ignorable or blank)
BLANK = frozenset(
    "\u034f"  # combining grapheme joiner
    "\u115f\u1160\u3164\uffa0"  # Hangul fillers
    "\u17b4\u17b5"  # Khmer inherent vowels
    "\u180b\u180c\u180d\u180f"  # Mongolian free variation selectors
    "\u2800"  # Braille pattern blank
    + "".join(chr(c) for c in range(0xFE00, 0xFE10))  # variation selectors
    + "".join(chr(c) for c in range(0xE0100, 0xE01F0))  # variation selectors supplement
)
_MARKS = ("Mn", "Mc", "Me")


def text_problem(value: str) -> str | None:
    """Why ``value`` breaks the text rule (a phrase to follow "must"), or None when it keeps it."""
    if value.isascii() and value.isprintable():  # the common case, at C speed: ASCII without controls
        return None
    for ch in value:
        category = unicodedata.category(ch)
        if category in REFUSED_CATEGORIES:
            return "not contain control, format (bidi, zero-width), private-use, unassigned or line-break characters"
        if category == "Zs" and ch != " ":
            return "not contain white space other than the plain space"
        if ch in BLANK:
            return "not contain characters that draw nothing (fillers, blanks, variation selectors)"
    if value and unicodedata.category(value[0]) in _MARKS:
        return "not start with a combining mark"
    return None


def is_printable_text(value: object) -> bool:
    """True for a string that keeps the text rule."""
    return isinstance(value, str) and text_problem(value) is None


def nfc(value: str) -> str:
    """``value`` in Unicode NFC: the one spelling kvcdn keeps of a name or prefix."""
    return unicodedata.normalize("NFC", value)
