"""The one list-then-watch loop of nodeagent's API watches.

``WatchLoop`` keeps one watch request open in its own thread: it lists first (the list's resourceVersion is
where the watch starts), resumes from the last resourceVersion seen (events and bookmarks) when the server
ends a watch (``timeoutSeconds``: every watch request is bounded in time), lists again after ``410 Gone``,
and backs off with jitter after errors (a 410 right after a relist too, so a server that always answers 410
is not hammered). The back-off starts over only once a watch has stayed open for ``healthy_after_s``.
Subclasses say what to list, what to open and what an event means: ``NodeWatch`` (kube/node.py) watches the
own Node; ``CollectionWatch`` here watches a whole collection (ComputeDomains, Nodes, templates) and tells its
owner what changed, old and new.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from nodeagent.backoff import Backoff
from nodeagent.errors import KubeError
from nodeagent.kube.client import KubeClient, Query, WatchStream

log = logging.getLogger(__name__)


class WatchLoop:
    """One thread: list, then watch from the list's resourceVersion, for as long as it is not stopped."""

    thread_name = "watch"

    def __init__(
        self,
        what: str,
        *,
        watch_timeout_s: int = 300,
        backoff: Backoff | None = None,
        on_error: Callable[[KubeError], None] | None = None,
        healthy_after_s: float = 10.0,
    ) -> None:
        self.what = what  # for log lines: "node n1", "ComputeDomains"
        self.watch_timeout_s = watch_timeout_s
        self.backoff = backoff or Backoff()
        self.on_error = on_error
        self.healthy_after_s = healthy_after_s  # a watch open this long starts the back-off over
        self.relists = 0
        self.errors = 0
        self.gone = 0  # 410 answers
        self._gone_in_a_row = 0  # 410s with no healthy watch in between
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._stream: WatchStream | None = None
        self._thread: threading.Thread | None = None
        self._rv = ""

    # what the subclass supplies ---------------------------------------------------------------------
    def _list(self) -> str:
        """List (and hand over what was listed); the list's resourceVersion."""
        raise NotImplementedError

    def _open(self, resource_version: str, timeout_s: int) -> WatchStream:
        raise NotImplementedError

    def _event(self, kind: str, obj: Mapping[str, Any]) -> None:
        """One ADDED, MODIFIED or DELETED event."""
        raise NotImplementedError

    # the loop -----------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self.run, name=self.thread_name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        with self._lock:
            stream = self._stream
        if stream is not None:
            stream.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def _relist(self) -> None:
        rv = self._list()
        self.relists += 1
        self._rv = rv

    def _watch_once(self) -> bool:
        """One watch request until the server ends it; True if anything at all arrived."""
        stream = self._open(self._rv, self.watch_timeout_s)
        with self._lock:
            self._stream = stream
        if self._stop.is_set():
            stream.close()
            return False
        got = False
        opened = time.monotonic()
        try:
            for ev in stream:
                got = True
                kind = str(ev.get("type"))
                obj = ev.get("object") or {}
                if kind == "ERROR":
                    code = obj.get("code")
                    msg = obj.get("message", "")
                    raise KubeError(
                        f"watch {self.what}: {code} {msg}".strip(),
                        subject=self.what,
                        retryable=True,
                        status=int(code) if isinstance(code, int) else None,
                    )
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                if rv:
                    self._rv = str(rv)
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    try:
                        self._event(kind, obj)
                    except Exception:
                        log.exception("watch %s: handling a %s event failed", self.what, kind)
                if time.monotonic() - opened >= self.healthy_after_s:
                    self._healthy()
        finally:
            with self._lock:
                self._stream = None
            stream.close()
        return got

    def _healthy(self) -> None:
        self.backoff.reset()
        self._gone_in_a_row = 0

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._rv:
                    self._relist()
                started = time.monotonic()
                got = self._watch_once()
                lasted = time.monotonic() - started
                if not got and lasted < 1.0 and not self._stop.is_set():
                    # a stream that closes at once without a word is treated as an error
                    raise KubeError(f"watch {self.what}: closed immediately", retryable=True)
                if lasted >= self.healthy_after_s:
                    self._healthy()
            except KubeError as e:
                if self._stop.is_set():
                    break
                if e.status == 410:
                    self.gone += 1
                    self._rv = ""
                    self._gone_in_a_row += 1
                    if self._gone_in_a_row == 1:  # the usual expiry: relist at once
                        log.info("watch of %s expired (410); relisting", self.what)
                        continue
                    delay = self.backoff.next()  # 410 again right after a relist: back off
                    log.warning("watch of %s expired again (410, %d in a row); relisting in %.1fs",
                                self.what, self._gone_in_a_row, delay)
                    self._stop.wait(delay)
                    continue
                self.errors += 1
                if self.on_error is not None:
                    self.on_error(e)
                delay = self.backoff.next()
                log.warning("watch of %s failed: %s; retrying in %.1fs", self.what, e, delay)
                self._stop.wait(delay)
            except Exception:
                # a bug below us must not end the watch: log it and try again later
                if self._stop.is_set():
                    break
                self.errors += 1
                delay = self.backoff.next()
                log.exception("watch of %s broke unexpectedly; retrying in %.1fs", self.what, delay)
                self._stop.wait(delay)


def object_key(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace", "")), str(meta.get("name", ""))


class CollectionWatch(WatchLoop):
    """A watch of a whole collection (``path``, e.g. ``/api/v1/nodes``), optionally narrowed by a label
    selector. ``on_change(kind, obj)`` is called when an object is added or deleted, or when the part of it
    that ``relevant`` picks (by default all of it) changed; and once per (re)list with kind ``"LIST"`` (obj
    None): what was missed meanwhile is unknown, so the owner looks at everything again. The watch keeps only
    ``relevant(obj)`` per object; ``synced`` is set after the first list."""

    def __init__(self, kube: KubeClient, path: str, on_change: Callable[[str, Mapping[str, Any] | None], None], *,
                 what: str, label_selector: str | None = None,
                 relevant: Callable[[Mapping[str, Any]], object] | None = None, **kwargs: Any) -> None:
        super().__init__(what, **kwargs)
        self.thread_name = f"watch-{what.replace(' ', '-')}"
        self.kube = kube
        self.path = path
        self.on_change = on_change
        self.label_selector = label_selector
        self.relevant: Callable[[Mapping[str, Any]], object] = relevant or (lambda o: o)
        self.synced = threading.Event()
        self._known: dict[tuple[str, str], object] = {}

    def _query(self) -> Query:
        return {"labelSelector": self.label_selector} if self.label_selector else {}

    def _list(self) -> str:
        data = self.kube.request("GET", self.path, query=self._query(), action=f"list {self.what}")
        self._known = {object_key(o): self.relevant(o) for o in data.get("items") or ()}
        rv = str((data.get("metadata") or {}).get("resourceVersion", ""))
        self.synced.set()
        self.on_change("LIST", None)
        return rv

    def _open(self, resource_version: str, timeout_s: int) -> WatchStream:
        query: dict[str, Any] = {**self._query(), "allowWatchBookmarks": True, "timeoutSeconds": timeout_s}
        if resource_version:
            query["resourceVersion"] = resource_version
        return self.kube.stream(self.path, query=query, timeout=(10.0, float(timeout_s) + 30.0),
                                action=f"watch {self.what}")

    def _event(self, kind: str, obj: Mapping[str, Any]) -> None:
        key = object_key(obj)
        if kind == "DELETED":
            self._known.pop(key, None)
            self.on_change(kind, obj)
            return
        now = self.relevant(obj)
        missing = object()
        if self._known.get(key, missing) != now:
            self._known[key] = now
            self.on_change(kind, obj)
