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
# Also for the oldest and newest Python the package supports: their stdlib stubs catch an API the other lacks.
# The three checks run side by side (mypy uses one core; with an empty cache each takes some 45 s of CPU), each
# printed whole under its heading; the run stops after them if any failed.
MYPY_OUT=$(mktemp -d /tmp/na-mypy.XXXXXX)
declare -A mypy_pid
for v in 3.11 3.10 3.13; do
  "$VENV/bin/mypy" --python-version "$v" --cache-dir "$MYPY_CACHE/$v" >"$MYPY_OUT/$v" 2>&1 &
  mypy_pid[$v]=$!
done
mypy_failed=""
for v in 3.11 3.10 3.13; do
  rc=0
  wait "${mypy_pid[$v]}" || rc=$?
  echo "== mypy (Python $v)"
  cat "$MYPY_OUT/$v"
  [ "$rc" -eq 0 ] || mypy_failed="$mypy_failed $v"
done
rm -rf "$MYPY_OUT"
[ -z "$mypy_failed" ] || { echo "mypy failed for Python$mypy_failed" >&2; exit 1; }
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
