"""Logging set-up: readable lines on a terminal, one JSON object per line for collectors.

Every line is bounded and is one line: a value read from a file, the API or a socket may be megabytes long
or hold a line break that would forge a second log entry. Each string argument of a message is cut to
``MAX_ARG`` characters and the whole message to ``MAX_MESSAGE``; control characters (line breaks, escape
sequences) are written as escapes (``\\n``, ``\\x1b``) in text and JSON alike. A traceback keeps its lines,
each indented under the entry it belongs to.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any

MAX_ARG = 1024  # characters of one string argument of a log message
MAX_MESSAGE = 8192  # characters of one log message
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _escape(match: re.Match[str]) -> str:
    ch = match.group()
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(ch) or (
        f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}"
    )


def cut(text: str, limit: int) -> str:
    """``text`` of at most about ``limit`` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def one_line(text: str, limit: int = MAX_MESSAGE) -> str:
    """``text`` cut to ``limit`` characters, its control characters escaped: one bounded line."""
    return _CONTROL.sub(_escape, cut(text, limit))


def _bounded_arg(value: Any) -> Any:
    if isinstance(value, str | bytes) and len(value) > MAX_ARG:
        return cut(value if isinstance(value, str) else repr(value[:MAX_ARG]), MAX_ARG)
    return value


def message(record: logging.LogRecord) -> str:
    """The record's message with each string argument and the whole cut, control characters escaped."""
    if isinstance(record.args, tuple) and record.args:
        record.args = tuple(_bounded_arg(a) for a in record.args)
    elif isinstance(record.args, dict):
        record.args = {k: _bounded_arg(v) for k, v in record.args.items()}
    try:
        text = record.getMessage()
    except ValueError:  # an integer argument beyond the digit limit of int -> str
        text = f"{record.msg} (arguments not shown)"
    return one_line(text)


def _indented(exc_text: str) -> str:
    return "\n".join("    " + _CONTROL.sub(_escape, line) for line in exc_text.splitlines())


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        record.message = message(record)
        record.asctime = self.formatTime(record, self.datefmt)
        line = self.formatMessage(record)
        if record.exc_info:
            line += "\n" + _indented(self.formatException(record.exc_info))
        if record.stack_info:
            line += "\n" + _indented(self.formatStack(record.stack_info))
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": message(record),
        }
        for key, value in record.__dict__.items():
            if key.startswith("na_"):
                doc[key[3:]] = _bounded_arg(value)
        if record.exc_info:
            doc["exc"] = cut(self.formatException(record.exc_info), 4 * MAX_MESSAGE)
        return json.dumps(doc, default=lambda v: cut(str(v), MAX_ARG))


def setup_logging(fmt: str = "text", level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("kubernetes", "urllib3", "apscheduler", "watchdog", "grpc"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
