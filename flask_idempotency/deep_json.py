"""Leaving members out of a JSON document too deep to parse: ``fingerprint_exclude`` at
any depth (SPEC §16).

A document nested deeper than Python's recursion allows (``json.loads`` and ``rfc8785``
recurse) is fingerprinted by its bytes. The members its JSON pointers designate are still
left out: :func:`blank_pointers` walks the bytes once, with a stack of its own (no
recursion, whatever the depth), and replaces each designated value with ``null``. What
remains is hashed as it came (key order and whitespace then count, as for any document
that is not canonicalised).
"""

from __future__ import annotations

import json
import re

#: a string token (with its escapes), a literal (number, true, false, null), or one of
#: the structural characters
_TOKEN = re.compile(rb'\s*("(?:[^"\\]|\\.)*"|[-0-9A-Za-z.+]+|[{}\[\]:,])', re.DOTALL)
_PLACEHOLDER = b"null"


def blank_pointers(body: bytes, pointers: tuple[tuple[str, ...], ...]) -> bytes:
    """*body* with the value each pointer designates replaced by ``null``; *body* as it is
    if it is not JSON this scanner reads, or no pointer designates anything."""
    wanted = {tokens for tokens in pointers if tokens}
    if not wanted:
        return body
    deepest = max(len(tokens) for tokens in wanted)
    spans = _spans(body, wanted, deepest)
    if not spans:
        return body
    parts, last = [], 0
    for start, end in spans:
        parts += [body[last:start], _PLACEHOLDER]
        last = end
    parts.append(body[last:])
    return b"".join(parts)


def _spans(body: bytes, wanted: set[tuple[str, ...]], deepest: int) -> list[tuple[int, int]]:
    """The (start, end) byte spans of the values at the *wanted* paths, in order; [] when
    *body* cannot be read."""
    scanner = _Scanner(wanted, deepest)
    position = 0
    while position < len(body):
        match = _TOKEN.match(body, position)
        if match is None:
            if body[position:].strip():
                return []  # not JSON
            break
        position = match.end()
        if not scanner.step(match.group(1), match.start(1), position):
            return []
    return scanner.spans if not scanner.stack else []


class _NotJson(ValueError):
    pass


class _Scanner:
    """Where in the document each token is, with a stack of its own."""

    def __init__(self, wanted: set[tuple[str, ...]], deepest: int) -> None:
        self.wanted, self.deepest = wanted, deepest
        #: the path of the value being read (its last part is filled in as it goes)
        self.path: list[str] = []
        #: per open container: [is an object, a key comes next]
        self.stack: list[list[bool]] = []
        self.spans: list[tuple[int, int]] = []
        #: (start, depth) of the value being left out
        self.blanking: tuple[int, int] | None = None

    def step(self, token: bytes, start: int, end: int) -> bool:
        """Take one token; False if the document is not JSON this scanner reads."""
        try:
            if self.stack and self.stack[-1][0] and self.stack[-1][1]:
                self._key(token, end)
            elif token == b",":
                self._comma()
            elif token in (b"}", b"]"):
                self._close(end)
            elif token != b":":
                self._value(token, start, end)
        except _NotJson:
            return False
        return True

    def _key(self, token: bytes, end: int) -> None:
        if token == b"}":  # an empty object
            self._close(end)
            return
        try:
            key = json.loads(token)
        except ValueError:
            raise _NotJson() from None
        if not isinstance(key, str):
            raise _NotJson()
        self.path[-1] = key
        self.stack[-1][1] = False

    def _comma(self) -> None:
        if not self.stack:
            raise _NotJson()
        if self.stack[-1][0]:
            self.stack[-1][1] = True
        else:
            self.path[-1] = str(int(self.path[-1]) + 1)

    def _close(self, end: int) -> None:
        if not self.stack:
            raise _NotJson()
        self.stack.pop()
        self.path.pop()
        self._ended(end)

    def _value(self, token: bytes, start: int, end: int) -> None:
        path = self.path
        if self.blanking is None and len(path) <= self.deepest and tuple(path) in self.wanted:
            self.blanking = (start, len(self.stack))
        if token in (b"{", b"["):
            self.stack.append([token == b"{", token == b"{"])
            path.append("" if token == b"{" else "0")
        else:
            self._ended(end)

    def _ended(self, end: int) -> None:
        """A value ended at *end*: the value being left out ends here if it started at the
        depth the document is back to."""
        if self.blanking is not None and self.blanking[1] == len(self.stack):
            self.spans.append((self.blanking[0], end))
            self.blanking = None
