#!/usr/bin/env bash
# The one test command (README, .ci/run): sets up everything on a fresh machine, then runs
# linters, type checks and the whole test suite against the real peers.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${NODEAGENT_VENV:-.venv}
# Python's byte-code cache stays on even where the environment turns it off: the suite starts Python thousands
# of times (each CLI test, each agent, each chroot's program), and a `discover` that compiles nodeagent's modules
# from source took about a third more CPU than one that read them compiled (0.44 s against 0.33 s); with no
# cache at all, 726 ms against 201 ms (tests/bench/bench_cli.py, 2026-11-29).
unset PYTHONDONTWRITEBYTECODE

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e '.[test]'

# Real peers: Debian containerd/runc, Go-built kube-apiserver + etcd + kubelet harness (cached by version).
if [ -f tests/testbin/setup.sh ]; then
  # shellcheck disable=SC1091
  source tests/testbin/setup.sh
fi

"$VENV/bin/python" -m compileall -q -j 0 nodeagent
echo "== ruff"; "$VENV/bin/ruff" check nodeagent tests
# mypy's incremental cache lives with the peers' cache, one per target version: a fresh clone of an unchanged
# tree then checks in seconds (mypy compares the sources' hashes when their times differ).
MYPY_CACHE=${NODEAGENT_CACHE:-$HOME/.cache/nodeagent}/mypy
echo "== mypy"; "$VENV/bin/mypy" --cache-dir "$MYPY_CACHE/3.11"
# The oldest and newest Python the package supports: their stdlib stubs catch an API the other lacks.
# (two commands, not an && list: under `set -e` a failure left of && would not stop the run)
echo "== mypy (Python 3.10)"; "$VENV/bin/mypy" --python-version 3.10 --cache-dir "$MYPY_CACHE/3.10"
echo "== mypy (Python 3.13)"; "$VENV/bin/mypy" --python-version 3.13 --cache-dir "$MYPY_CACHE/3.13"
echo "== import layers"; "$VENV/bin/lint-imports"
# A short base for pytest's temporary directories: tests bind Unix sockets below them (at most 107 bytes of
# path), which a long $TMPDIR would overflow.
BASETEMP=$(mktemp -d /tmp/na-pt.XXXXXX)
trap 'rm -rf "$BASETEMP"' EXIT
# Three workers on the 2-core reference machine (many tests wait on a kubelet, a watch or a timer, and a third
# worker fills those waits; NODEAGENT_TEST_WORKERS=0 runs in this process): a test file runs whole on one
# worker, so its module fixtures start once; the files that own host paths (the whole-node cluster, the
# booted systemd) form one group run on one worker (tests/conftest.py), and take a host-wide lock
# (tests/peers/hostlock.py) against anything else on the machine; the files on the API servers of every
# Kubernetes release form another, so one worker starts those servers and stops them when it is done.
WORKERS=${NODEAGENT_TEST_WORKERS:-3}
DIST=()
[ "$WORKERS" = 0 ] || DIST=(-n "$WORKERS" --dist loadfile)
# --durations: the slowest tests of the run, printed at its end, where room is made when the suite grows.
echo "== pytest"; "$VENV/bin/pytest" -p no:cacheprovider --durations=30 --basetemp "$BASETEMP" "${DIST[@]}" "$@"
