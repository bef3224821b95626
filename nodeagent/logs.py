"""Logging set-up: readable lines on a terminal, one JSON object per line for collectors.

Every line is bounded and is one line: a value read from a file, the API or a socket may be megabytes long
or hold a line break that would forge a second log entry. Each string argument of a message is cut to
``MAX_ARG`` characters and the whole message to ``MAX_MESSAGE``; control characters (line breaks, escape
sequences) are written as escapes (``\\n``, ``\\x1b``) in text and JSON alike. A traceback keeps its lines,
each indented under the entry it belongs to.

Lines a client can make the agent write (a refused request, a refused claim) go through ``RefusalLog``: each
reason cut to ``MAX_REASON`` characters and at most a burst of such lines a minute, the next one written
telling how many were left out.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

MAX_ARG = 1024  # characters of one string argument of a log message
MAX_MESSAGE = 8192  # characters of one log message
MAX_REASON = 512  # characters of a reason in a refusal line
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


def cut_within(text: str, limit: int) -> str:
    """``text`` of at most ``limit`` characters (the rest replaced by a count of what was left out)."""
    if len(text) <= limit:
        return text
    tail = f"… ({len(text) - limit} more characters)"
    return text[: max(0, limit - len(tail))] + tail


def one_line(text: str, limit: int = MAX_MESSAGE) -> str:
    """``text`` cut to ``limit`` characters, its control characters escaped: one bounded line."""
    return _CONTROL.sub(_escape, cut(text, limit))


class LineBudget:
    """At most ``burst`` lines in any ``window_s`` seconds. ``take()`` says whether one more may be written
    now and, when it may, how many were refused since the last one written (to be told in that line). Safe
    from any thread."""

    def __init__(self, burst: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._burst = burst
        self._window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._window_start = -window_s
        self._written = 0
        self.left_out = 0

    def take(self) -> int | None:
        """None: over the budget (counted as left out); else the count left out before this line."""
        with self._lock:
            now = self._clock()
            if now - self._window_start >= self._window_s:
                self._window_start, self._written = now, 0
            if self._written >= self._burst:
                self.left_out += 1
                return None
            self._written += 1
            left_out, self.left_out = self.left_out, 0
            return left_out


class RefusalLog:
    """Warnings about refused requests (``<what> refused: <reason>``): each reason cut to ``MAX_REASON``
    characters, at most ``burst`` lines in any ``window_s`` seconds; the next line logged after a quiet
    stretch tells how many were left out. Safe from any thread."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        burst: int = 20,
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._budget = LineBudget(burst, window_s, clock)

    def refused(self, what: str, reason: str) -> None:
        self._warn(what, "refused", reason)

    def ended(self, what: str, reason: str) -> None:
        """A stream ended by the server (``<what> ended: <reason>``), within the same bounds."""
        self._warn(what, "ended", reason)

    def _warn(self, what: str, done: str, reason: str) -> None:
        left_out = self._budget.take()
        if left_out is None:
            return
        text = cut_within(reason, MAX_REASON)
        if left_out:
            self._log.warning("%s %s: %s (%d lines before it not logged)", what, done, text, left_out)
        else:
            self._log.warning("%s %s: %s", what, done, text)


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
