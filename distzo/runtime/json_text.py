"""JSON from a file someone else wrote, whose nesting is no traceback.

``json.loads`` recurses once per level of nesting: a line of a thousand ``[`` (a data row,
a seed log record, a model's index) raises ``RecursionError``, which no ``except
json.JSONDecodeError`` catches, so a hostile or corrupt file ended the job in a traceback
instead of the one-line error every other malformed line gets. ``loads`` raises it as the
``JSONDecodeError`` it is.
"""

from __future__ import annotations

import json
from typing import Any

NESTED_TOO_DEEPLY = "nested too deeply"  # the JSONDecodeError's msg for such a document


def loads(text: str | bytes) -> Any:
    """``json.loads``, with nesting past Python's recursion limit a ``JSONDecodeError``
    (msg ``NESTED_TOO_DEEPLY``, at the first character) like any other malformed text."""
    try:
        return json.loads(text)
    except RecursionError:
        document = text.decode(errors="replace") if isinstance(text, bytes) else text
        raise json.JSONDecodeError(NESTED_TOO_DEEPLY, document, 0) from None
