"""Text from datasets, models and reward functions made safe before a terminal shows it.

A prompt, a response, a judgement or a data source name is data another party wrote. Shown
raw, its control characters drive the terminal that reads it: ESC sequences set the window
title, write the clipboard (OSC 52), move the cursor up and erase lines (a forged sample
header), hide text (SGR 8); a carriage return overwrites a line; bidi overrides show text in
an order other than the bytes'. `safe` shows each such character escaped instead:

- C0 controls (U+0000-U+001F) but newline and tab, DEL (U+007F) and the C1 controls
  (U+0080-U+009F, among them the 8-bit CSI U+009B and OSC U+009D): `\\x1b`, `\\x7f`, `\\x9b`;
- the bidi embeddings, overrides and isolates (U+202A-U+202E, U+2066-U+2069): `\\u202e`.

An escape sequence loses its ESC, so what follows it is plain printable text. `safe` is
idempotent (its output holds none of those characters). `SafeLogs` is the logging filter
the job's and the command line's handlers carry, so log files and the console get the
same treatment. Standard library only, imports nothing of the project: every layer may
use it.
"""
from __future__ import annotations

import logging
import re

_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_UNSAFE_LINES = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _escaped(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def safe(text: object, *, lines: bool = True) -> str:
    """`text` (str() of it) with every control character and bidi override shown escaped;
    `lines=False` escapes newline and tab too (one line that nothing can break)."""
    return (_UNSAFE if lines else _UNSAFE_LINES).sub(_escaped, str(text))


class SafeLogs(logging.Filter):
    """A handler's filter: the record's message (arguments applied), its exception text and
    stack made `safe`. Newlines stay (tracebacks, the project's multi-line messages)."""

    _fmt = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = safe(record.getMessage()), None
        if record.exc_info and not record.exc_text:
            record.exc_text = self._fmt.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = safe(record.exc_text)
        if record.stack_info:
            record.stack_info = safe(record.stack_info)
        return True


def safe_logs(logger: logging.Logger | None = None) -> None:
    """Give every handler of `logger` (the root logger by default) the `SafeLogs` filter."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, SafeLogs) for f in handler.filters):
            handler.addFilter(SafeLogs())
