"""Assorted text helpers used by the command line tools.

Nothing here depends on third-party packages. Each function is small and has
a doctest showing typical input and output; run ``python -m doctest -v
text_utils.py`` to check them.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Iterable, Iterator, List, Sequence

_WS = re.compile(r"\s+")
_NON_SLUG = re.compile(r"[^a-z0-9]+")


def normalise_whitespace(text: str) -> str:
    """Collapse runs of whitespace into single spaces and strip the ends.

    >>> normalise_whitespace("  hello \\t\\n  world  ")
    'hello world'
    """
    return _WS.sub(" ", text).strip()


def slugify(text: str, max_length: int = 60) -> str:
    """Turn a title into a URL-friendly slug.

    Accented letters are reduced to their base letter, everything that is not
    a letter or digit becomes a hyphen, and the result is cut at a word
    boundary if it is longer than ``max_length``.

    >>> slugify("Crème Brûlée: A Beginner's Guide!")
    'creme-brulee-a-beginner-s-guide'
    >>> slugify("   ")
    ''
    """
    decomposed = unicodedata.normalize("NFKD", text)
    ascii_only = decomposed.encode("ascii", "ignore").decode("ascii").lower()
    slug = _NON_SLUG.sub("-", ascii_only).strip("-")
    if len(slug) > max_length:
        slug = slug[:max_length].rsplit("-", 1)[0]
    return slug


def wrap(text: str, width: int = 72) -> List[str]:
    """Greedy word wrap. Words longer than ``width`` get a line of their own.

    >>> wrap("the quick brown fox jumps over the lazy dog", width=15)
    ['the quick brown', 'fox jumps over', 'the lazy dog']
    """
    lines: List[str] = []
    current: List[str] = []
    length = 0
    for word in text.split():
        extra = len(word) + (1 if current else 0)
        if current and length + extra > width:
            lines.append(" ".join(current))
            current, length = [word], len(word)
        else:
            current.append(word)
            length += extra
    if current:
        lines.append(" ".join(current))
    return lines


def truncate(text: str, limit: int, ellipsis: str = "…") -> str:
    """Shorten ``text`` to at most ``limit`` characters, ending on a word.

    >>> truncate("Short enough", 20)
    'Short enough'
    >>> truncate("This sentence is a little too long", 20)
    'This sentence is a…'
    """
    if len(text) <= limit:
        return text
    cut = text[: max(0, limit - len(ellipsis))]
    if " " in cut:
        cut = cut.rsplit(" ", 1)[0]
    return cut.rstrip(" ,.;:") + ellipsis


def levenshtein(a: str, b: str) -> int:
    """Edit distance between two strings (insertions, deletions, swaps of one char).

    Uses two rows of the dynamic programming table, so memory is O(len(b)).

    >>> levenshtein("kitten", "sitting")
    3
    >>> levenshtein("", "abc")
    3
    """
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            cost = 0 if ca == cb else 1
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + cost))
        previous = current
    return previous[-1]


def closest(word: str, candidates: Iterable[str], max_distance: int = 2) -> str | None:
    """Return the candidate nearest to ``word``, for "did you mean" hints.

    >>> closest("stauts", ["status", "start", "stop"])
    'status'
    >>> closest("xyz", ["status", "start"]) is None
    True
    """
    best, best_distance = None, max_distance + 1
    for candidate in candidates:
        d = levenshtein(word, candidate)
        if d < best_distance:
            best, best_distance = candidate, d
    return best


def chunks(items: Sequence[str], size: int) -> Iterator[Sequence[str]]:
    """Yield consecutive slices of ``items`` with at most ``size`` elements.

    >>> list(chunks(["a", "b", "c", "d", "e"], 2))
    [['a', 'b'], ['c', 'd'], ['e']]
    """
    if size < 1:
        raise ValueError("size must be at least 1")
    for start in range(0, len(items), size):
        yield items[start : start + size]


def human_join(items: Sequence[str], conjunction: str = "and") -> str:
    """Join words the way a person would write them.

    >>> human_join(["apples"])
    'apples'
    >>> human_join(["apples", "pears"])
    'apples and pears'
    >>> human_join(["apples", "pears", "plums"], "or")
    'apples, pears, or plums'
    """
    if not items:
        return ""
    if len(items) == 1:
        return items[0]
    if len(items) == 2:
        return f"{items[0]} {conjunction} {items[1]}"
    return f"{', '.join(items[:-1])}, {conjunction} {items[-1]}"


if __name__ == "__main__":
    import doctest

    raise SystemExit(doctest.testmod().failed)
