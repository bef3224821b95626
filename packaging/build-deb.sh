#!/usr/bin/env bash
# Build nodeagent_<version>_<arch>.deb with Debian's dpkg-deb. The package binds to the Python it is installed
# next to instead of carrying one built for a single Python:
#   /usr/lib/nodeagent/wheels/  nodeagent's wheel and the wheels of every dependency for CPython 3.10, 3.11,
#                               3.12 and 3.13 on that architecture (manylinux, glibc >= 2.28), PyPA's
#                               installer, and for each CPython the list of the wheels pip chose for it
#   /usr/lib/nodeagent/build-venv  run by postinst: /opt/nodeagent from those wheels with the system's
#                               /usr/bin/python3 (no network); again by a dpkg trigger when python3 changes
#                               and before each start of the units when the venv is of another Python
#   /usr/bin/nodeagent        -> /opt/nodeagent/bin/nodeagent
#   /lib/systemd/system/      nodeagent.service, nodeagent-bootstrap.service
#   /etc/nodeagent/config.toml  the commented example, a conffile (local edits survive upgrades)
# Usage: packaging/build-deb.sh [--arch amd64|arm64] [--fetch-only] [OUTPUT_DIR]   (default: this machine's, dist/)
# --fetch-only: only fill the wheel cache (below) for that architecture and build no package (the test suite's
# setup does it, so no test waits for a download).
# Wheels are cached in ${NODEAGENT_WHEEL_CACHE:-${NODEAGENT_CACHE:-~/.cache/nodeagent}/wheels}/<arch>, so a rebuild needs no
# download (a warm build copies the set of wheels kept for the same dependencies); pip fetches the missing ones for the target platform (--platform/--python-version), so an arm64
# package builds on amd64. The build runs with the project's .venv when it has setuptools and wheel, else in
# a throw-away build venv made from python3 (pip from python3-venv, setuptools and wheel from the wheel cache
# or PyPI), so a fresh clone builds without running the tests first.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=$(cd "$HERE/.." && pwd)
ARCH=
FETCH_ONLY=
while [ $# -gt 0 ]; do
  case "$1" in
    --fetch-only) FETCH_ONLY=1; shift ;;
    --arch) ARCH=${2:-}; shift 2 || { echo "build-deb: --arch needs amd64 or arm64" >&2; exit 2; } ;;
    --arch=*) ARCH=${1#--arch=}; shift ;;
    -*) echo "build-deb: unknown option $1 (usage: build-deb.sh [--arch amd64|arm64] [--fetch-only] [OUTPUT_DIR])" >&2; exit 2 ;;
    *) break ;;
  esac
done
OUT=
[ -n "$FETCH_ONLY" ] || OUT=$(mkdir -p "${1:-$SRC/dist}" && cd "${1:-$SRC/dist}" && pwd)
BASE_PY=${NODEAGENT_BASE_PYTHON:-/usr/bin/python3}
BUILD_PY=${NODEAGENT_BUILD_PYTHON:-}
WHEEL_CACHE=${NODEAGENT_WHEEL_CACHE:-${NODEAGENT_CACHE:-$HOME/.cache/nodeagent}/wheels}
PYTHONS="3.10 3.11 3.12 3.13"
LIB=/usr/lib/nodeagent

command -v dpkg-deb >/dev/null || { echo "build-deb: dpkg-deb missing: apt-get install dpkg" >&2; exit 2; }
"$BASE_PY" -c 'import sys, venv; assert sys.version_info >= (3, 10)' 2>/dev/null || {
  echo "build-deb: $BASE_PY must be Python 3.10 or later with venv (apt-get install python3-venv)" >&2; exit 2; }
[ -n "$ARCH" ] || ARCH=$(dpkg --print-architecture)
case "$ARCH" in
  amd64) MACHINE=x86_64 ;;
  arm64) MACHINE=aarch64 ;;
  *) echo "build-deb: --arch $ARCH: only amd64 and arm64 have manylinux wheels of every dependency" >&2; exit 2 ;;
esac
# The wheels' platforms: manylinux up to glibc 2.28 (Debian 12: 2.36, Ubuntu 22.04: 2.35), hence libc6 (>= 2.28).
PLATFORMS=(--platform "manylinux2014_$MACHINE" --platform "manylinux_2_17_$MACHINE")
for minor in 18 19 20 21 22 23 24 25 26 27 28; do PLATFORMS+=(--platform "manylinux_2_${minor}_$MACHINE"); done
[ "$ARCH" = arm64 ] || PLATFORMS+=(--platform manylinux1_x86_64 --platform manylinux2010_x86_64)

VERSION=$("$BASE_PY" -c 'import re,sys; print(re.search(r"__version__ = \"(.+)\"", open(sys.argv[1]).read()).group(1))' \
  "$SRC/nodeagent/__init__.py")
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
STAGE=$WORK/stage
CACHE=$WHEEL_CACHE/$ARCH
mkdir -p "$STAGE$LIB/wheels" "$CACHE" "$WHEEL_CACHE"

# 0. A Python with pip, setuptools and wheel to build with.
# The project's .venv only when it can build a wheel: the README's quick start makes one with neither the
# `wheel` package nor (on newer Pythons) setuptools, and the build leaves the user's .venv untouched.
if [ -z "$BUILD_PY" ] && [ -x "$SRC/.venv/bin/python" ] \
    && "$SRC/.venv/bin/python" -c 'import setuptools, wheel' 2>/dev/null; then
  BUILD_PY=$SRC/.venv/bin/python
fi
if [ -z "$BUILD_PY" ]; then
  "$BASE_PY" -m venv "$WORK/build" >"$WORK/venv.log" 2>&1 || {
    cat "$WORK/venv.log" >&2; echo "build-deb: cannot make a build venv (apt-get install python3-venv)" >&2; exit 2; }
  BUILD_PY=$WORK/build/bin/python
  if ! "$BUILD_PY" -m pip install -q --disable-pip-version-check --no-index --find-links "$WHEEL_CACHE" \
      'setuptools>=68' wheel 2>/dev/null; then
    echo "build-deb: filling the wheel cache $WHEEL_CACHE with setuptools and wheel" >&2
    "$BUILD_PY" -m pip wheel -q --disable-pip-version-check -w "$WHEEL_CACHE" 'setuptools>=68' wheel
    "$BUILD_PY" -m pip install -q --disable-pip-version-check --no-index --find-links "$WHEEL_CACHE" \
      'setuptools>=68' wheel
  fi
fi
[ -x "$BUILD_PY" ] || { echo "build-deb: build python $BUILD_PY not found" >&2; exit 2; }

# 1. The project's own wheel (no build isolation: setuptools comes from the build environment), built from a
# copy of what it is made of: pip builds in the source tree (setuptools' build/ and nodeagent.egg-info there),
# so two builds of one checkout at the same time removed each other's files midway.
mkdir -p "$WORK/src"
cp "$SRC/pyproject.toml" "$SRC/README.md" "$WORK/src/"
(cd "$SRC" && tar --exclude=__pycache__ -cf - nodeagent) | tar -C "$WORK/src" -xf -
"$BUILD_PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/own" "$WORK/src" >"$WORK/wheel.log" 2>&1 || {
  cat "$WORK/wheel.log" >&2; exit 1; }
OWN=$(ls "$WORK"/own/nodeagent-*.whl)

# 2. The wheels of every dependency, for each CPython the package supports, from the cache (offline) or,
# for what it lacks, from the index; PyPA's `installer` wheel to install them with at install time. pip
# resolves here, once per CPython, and its choice is kept as a list (wheels/cp3XX.txt: one file name a line,
# nodeagent's own wheel left out): the install needs no resolver, and no pip, whose start alone (it compiles
# its 700 modules from its wheel each time) took most of the six minutes an install took under qemu.
fetch() {  # fetch PYVER [--no-index]: the wheels pip picks for CPython PYVER into $WORK/cpXY
  local v=$1 abi=cp${1/./}
  shift
  rm -rf "${WORK:?}/$abi" && mkdir "$WORK/$abi"
  "$BUILD_PY" -m pip download -q --disable-pip-version-check --only-binary=:all: "${PLATFORMS[@]}" \
    --implementation cp --python-version "$v" --abi "$abi" --abi abi3 --abi none \
    --find-links "$CACHE" "$@" -d "$WORK/$abi" "$OWN" installer
}
# The set of wheels is kept by a key of what decides it (the dependencies in nodeagent's metadata, the
# Pythons, the platforms), so a warm build copies one directory instead of asking pip four times.
KEY=$( ("$BUILD_PY" -c 'import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
print("\n".join(ln for ln in meta.splitlines() if ln.startswith("Requires-Dist:") and "extra ==" not in ln))' \
  "$OWN" && echo "$PYTHONS ${PLATFORMS[*]} installer lists") | sha256sum | cut -c1-12)
SET=$WHEEL_CACHE/sets/$ARCH-$KEY
if [ -n "$FETCH_ONLY" ] && [ -d "$SET" ]; then
  touch "$SET"
  exit 0
elif [ -d "$SET" ]; then
  touch "$SET"  # sets no build used for a week go (below)
  cp "$SET"/*.whl "$SET"/*.txt "$STAGE$LIB/wheels/"  # copies: a hard link's ctime changes when another build links it
else
  for v in $PYTHONS; do
    abi=cp${v/./}
    if ! fetch "$v" --no-index >"$WORK/fetch.log" 2>&1; then
      echo "build-deb: fetching the $ARCH wheels for CPython $v into the wheel cache $CACHE" >&2
      fetch "$v" >"$WORK/fetch.log" 2>&1 || { tail -n 20 "$WORK/fetch.log" >&2; exit 1; }
    fi
    rm -f "$WORK/$abi"/nodeagent-*.whl
    (cd "$WORK/$abi" && ls ./*.whl | sed 's|^\./||' | grep -v '^installer-' | LC_ALL=C sort) \
      > "$STAGE$LIB/wheels/$abi.txt"
    cp -n "$WORK/$abi"/*.whl "$STAGE$LIB/wheels/"
  done
  cp -n "$STAGE$LIB"/wheels/*.whl "$CACHE/"
  mkdir -p "$WHEEL_CACHE/sets"
  rm -rf "$SET.tmp.$$" && mkdir "$SET.tmp.$$" && cp "$STAGE$LIB"/wheels/*.whl "$STAGE$LIB"/wheels/*.txt "$SET.tmp.$$/" \
    && { mv -T "$SET.tmp.$$" "$SET" 2>/dev/null || rm -rf "$SET.tmp.$$"; }
fi
[ -z "$FETCH_ONLY" ] || exit 0
install -m 0644 "$OWN" "$STAGE$LIB/wheels/"
find "$WHEEL_CACHE/sets" -mindepth 1 -maxdepth 1 -type d -mtime +7 ! -name "${SET##*/}" -exec rm -rf {} + \
  2>/dev/null || true
for v in $PYTHONS; do  # every supported CPython has its list, and in it a wheel of each binary dependency
  for pkg in grpcio pyyaml; do
    grep -q "^${pkg}-.*-cp${v/./}-.*_$MACHINE\.whl\$" "$STAGE$LIB/wheels/cp${v/./}.txt" 2>/dev/null || {
      echo "build-deb: no $pkg wheel for CPython $v on $ARCH in its list" >&2; exit 1; }
  done
done
compgen -G "$STAGE$LIB/wheels/installer-*.whl" >/dev/null || { echo "build-deb: no installer wheel" >&2; exit 1; }

# 3. Everything else in the tree.
install -d "$STAGE/usr/bin" "$STAGE/lib/systemd/system" "$STAGE/etc/nodeagent" "$STAGE/usr/share/doc/nodeagent" \
  "$STAGE/DEBIAN"
install -m 0755 "$HERE/debian/build-venv" "$STAGE$LIB/build-venv"
ln -s /opt/nodeagent/bin/nodeagent "$STAGE/usr/bin/nodeagent"
install -m 0644 "$SRC"/systemd/nodeagent.service "$SRC"/systemd/nodeagent-bootstrap.service "$STAGE/lib/systemd/system/"
install -m 0644 "$SRC/configs/config.toml" "$STAGE/etc/nodeagent/config.toml"
install -m 0644 "$SRC/README.md" "$STAGE/usr/share/doc/nodeagent/README.md"
install -d -m 0755 "$STAGE/usr/share/doc/nodeagent/docs"
install -m 0644 "$SRC"/docs/*.md "$STAGE/usr/share/doc/nodeagent/docs/"
printf 'nodeagent\nLicense: Apache-2.0\n' > "$STAGE/usr/share/doc/nodeagent/copyright"
for s in postinst prerm postrm; do install -m 0755 "$HERE/debian/$s" "$STAGE/DEBIAN/$s"; done
install -m 0644 "$HERE/debian/triggers" "$STAGE/DEBIAN/triggers"
echo /etc/nodeagent/config.toml > "$STAGE/DEBIAN/conffiles"
# Installed-Size: the package's own files (the venv postinst makes is not one of them: about 130 MB more)
SIZE=$(du -sk --exclude=DEBIAN "$STAGE" | cut -f1)
sed -e "s/@VERSION@/$VERSION/" -e "s/@ARCH@/$ARCH/" -e "s/@SIZE@/$SIZE/" "$HERE/debian/control.in" \
  > "$STAGE/DEBIAN/control"

DEB="$OUT/nodeagent_${VERSION}_${ARCH}.deb"
dpkg-deb --root-owner-group -Zgzip -z1 --build "$STAGE" "$DEB" >/dev/null
echo "$DEB"
