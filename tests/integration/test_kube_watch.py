"""The own-Node watch against the REAL kube-apiserver: stopping it from another thread is clean.

A watch thread blocked in a read while ``stop`` runs must end without a traceback and without leaving a
thread behind, whatever moment the stop hits (before the first event, while idle, while data arrives).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from nodeagent.kube.client import KubeClient, WatchStream
from nodeagent.kube.node import NodeClient, NodeView, NodeWatch
from tests.integration import _kube


@pytest.fixture
def thread_errors(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every exception that escapes a thread while the test runs (instead of pytest's warning)."""
    seen: list[str] = []

    def hook(args: threading.ExceptHookArgs) -> None:
        name = args.thread.name if args.thread is not None else "?"
        seen.append(f"{name}: {args.exc_type.__name__}: {args.exc_value}")

    monkeypatch.setattr(threading, "excepthook", hook)
    return seen


def wait_for(cond: Callable[[], Any], timeout: float = 10.0) -> Any:
    return _kube.wait_for(cond, timeout, interval=0.01)


def watch_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(("node-watch-", "stream-reader"))}


def test_node_watch_start_stop_repeatedly_is_clean(
    kube: KubeClient, node_name: str, thread_errors: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    nc = NodeClient(kube, node_name)
    before = set(threading.enumerate())
    for i in range(24):
        seen: list[NodeView] = []
        in_callback = threading.Event()

        def on_node(view: NodeView, seen: list[NodeView] = seen, busy: threading.Event = in_callback) -> None:
            seen.append(view)
            if view.labels.get("example.com/slow"):
                busy.set()
                time.sleep(0.1)  # like a publisher re-applying: the stream is not being read meanwhile

        w = NodeWatch(nc, on_node, watch_timeout_s=60)
        w.start()
        mode = i % 4
        if mode == 1:  # stop while the thread is blocked reading an idle stream
            wait_for(lambda s=seen: s)  # type: ignore[misc]
            wait_for(lambda w=w: w._stream is not None)  # type: ignore[misc]
        elif mode == 2:  # stop while changes arrive
            wait_for(lambda s=seen: s)  # type: ignore[misc]
            nc.patch_labels({"example.com/round": str(i), "example.com/slow": None})
        elif mode == 3:  # stop while the callback runs, between two reads of the stream
            wait_for(lambda s=seen: s)  # type: ignore[misc]
            nc.patch_labels({"example.com/round": str(i), "example.com/slow": "yes"})
            assert in_callback.wait(5)
        w.stop(timeout=5)
        assert w._thread is not None and not w._thread.is_alive(), f"round {i}: watch thread still running"
        assert w.errors == 0, f"round {i}: {w.errors} watch error(s)"
    assert thread_errors == []
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    assert set(threading.enumerate()) - before == set()


def test_stream_closed_from_another_thread_ends_quietly(
    kube: KubeClient, node_name: str, thread_errors: list[str]
) -> None:
    """The stream itself: one thread iterates, another closes, many times over one connection pool."""
    nc = NodeClient(kube, node_name)
    before = set(threading.enumerate())
    for i in range(18):
        stream = nc.open_watch("", 60)
        got: list[dict[str, Any]] = []
        first = threading.Event()
        done = threading.Event()
        mode = i % 3

        def read(s: WatchStream = stream, out: list[dict[str, Any]] = got, slow: bool = mode == 0,
                 first: threading.Event = first, done: threading.Event = done) -> None:
            for ev in s:
                out.append(ev)
                first.set()
                if slow:
                    time.sleep(0.1)  # busy with the event: close lands between two reads
            done.set()

        t = threading.Thread(target=read, name=f"stream-reader-{i}")
        t.start()
        assert first.wait(5)  # the initial ADDED event: the reader is in the stream
        if mode == 1:
            time.sleep(0.02)  # let it block in the read again
        stream.close()
        stream.close()  # twice is harmless
        assert done.wait(5), f"round {i}: the reader did not end after close"
        t.join(5)
        assert got[0]["type"] == "ADDED"
    assert thread_errors == []
    assert set(threading.enumerate()) - before == set()
    # the connection pool still works after all those interrupted streams
    assert nc.get().name == node_name


def test_closing_before_iterating_and_after_the_end(kube: KubeClient, node_name: str) -> None:
    nc = NodeClient(kube, node_name)
    early = nc.open_watch("", 60)
    early.close()
    assert list(early) == []
    # a stream the server ends by itself (timeoutSeconds) finishes normally; closing after is a no-op
    _, rv = nc.list_one()
    short = nc.open_watch(rv, 1)
    assert [e for e in short if e.get("type") == "ERROR"] == []
    short.close()
    assert short.closed
