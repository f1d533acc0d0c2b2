"""The run's JSON-lines logs as bytes read once: the text ``Path.read_text`` would give,
and whether a rewrite through ``write_text`` would leave the file as it is, both from
the one read (a resume of a million-step run read its logs whole twice for these)."""

from __future__ import annotations

import locale

# What ``open`` reads and writes a text file in, without an encoding named.
TEXT_ENCODING = locale.getpreferredencoding(False)


def as_read_text(raw: bytes) -> str:
    """``raw`` as ``read_text`` reads it: decoded (a ``UnicodeDecodeError`` where it is not
    text), with universal newlines ("\\r\\n" and "\\r" read as "\\n")."""
    return raw.decode(TEXT_ENCODING).replace("\r\n", "\n").replace("\r", "\n")


def as_rewritten(raw: bytes) -> bool:
    """Whether ``raw`` is what writing its lines (cut at "\\n", as ``as_read_text`` gives
    them) back, each ended by a newline, writes: no torn last line, no carriage return
    (which the read turns into a newline), and text that encodes back to the same bytes."""
    try:
        text = raw.decode(TEXT_ENCODING)
    except UnicodeDecodeError:
        return False
    whole = not text or text.endswith("\n")
    return whole and "\r" not in text and text.encode(TEXT_ENCODING) == raw
