#!/usr/bin/env bash
# Build nodeagent_<version>_amd64.deb with Debian's dpkg-deb:
#   /opt/nodeagent            a self-contained virtual environment (Debian's python3.11 as its base)
#   /usr/bin/nodeagent        -> /opt/nodeagent/bin/nodeagent
#   /lib/systemd/system/      nodeagent.service, nodeagent-bootstrap.service
#   /etc/nodeagent/config.toml  the commented example, a conffile (local edits survive upgrades)
# Usage: packaging/build-deb.sh [OUTPUT_DIR]      (default: dist/)
# Wheels are cached in ${NODEAGENT_WHEEL_CACHE:-~/.cache/nodeagent/wheels}, so a rebuild needs no download.
# The build runs with the project's .venv when it has setuptools and wheel, else in a throw-away build
# venv made from Debian's python3 (pip from python3-venv, setuptools and wheel from the wheel cache or PyPI), so a fresh
# clone builds without running the tests first.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=$(cd "$HERE/.." && pwd)
OUT=$(mkdir -p "${1:-$SRC/dist}" && cd "${1:-$SRC/dist}" && pwd)
BASE_PY=${NODEAGENT_BASE_PYTHON:-/usr/bin/python3}
BUILD_PY=${NODEAGENT_BUILD_PYTHON:-}
WHEELS=${NODEAGENT_WHEEL_CACHE:-$HOME/.cache/nodeagent/wheels}
PREFIX=/opt/nodeagent

command -v dpkg-deb >/dev/null || { echo "build-deb: dpkg-deb missing: apt-get install dpkg" >&2; exit 2; }
"$BASE_PY" -c 'import sys, venv; assert sys.version_info[:2] == (3, 11)' 2>/dev/null || {
  echo "build-deb: $BASE_PY must be Debian's Python 3.11 with venv (apt-get install python3-venv)" >&2; exit 2; }

VERSION=$("$BASE_PY" -c 'import re,sys; print(re.search(r"__version__ = \"(.+)\"", open(sys.argv[1]).read()).group(1))' \
  "$SRC/nodeagent/__init__.py")
ARCH=$(dpkg --print-architecture)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
STAGE=$WORK/stage
mkdir -p "$STAGE" "$WHEELS"

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
  if ! "$BUILD_PY" -m pip install -q --disable-pip-version-check --no-index --find-links "$WHEELS" \
      'setuptools>=68' wheel 2>/dev/null; then
    echo "build-deb: filling the wheel cache $WHEELS with setuptools and wheel" >&2
    "$BUILD_PY" -m pip wheel -q --disable-pip-version-check -w "$WHEELS" 'setuptools>=68' wheel
    "$BUILD_PY" -m pip install -q --disable-pip-version-check --no-index --find-links "$WHEELS" 'setuptools>=68' wheel
  fi
fi
[ -x "$BUILD_PY" ] || { echo "build-deb: build python $BUILD_PY not found" >&2; exit 2; }

# 1. The project's own wheel (no build isolation: setuptools comes from the build environment).
"$BUILD_PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/own" "$SRC" >"$WORK/wheel.log" 2>&1 || {
  cat "$WORK/wheel.log" >&2; exit 1; }
OWN=$(ls "$WORK"/own/nodeagent-*.whl)

# 2. The venv at its final path inside the staging tree, filled from the wheel cache. Made from the real
# interpreter (/usr/bin/python3.11, which the package depends on), not the /usr/bin/python3 link: the venv's
# python links to the path it was made with, and python3 (the link) is not in the dependencies.
"$(readlink -f "$BASE_PY")" -m venv --without-pip "$STAGE$PREFIX"
for f in "$STAGE$PREFIX"/bin/python*; do
  case "$(readlink "$f")" in
    /*) [ "$(readlink "$f")" = /usr/bin/python3.11 ] || {
      echo "build-deb: $f links to $(readlink "$f"), not /usr/bin/python3.11 (Depends: python3.11)" >&2; exit 1; } ;;
  esac
done
pip_install() {
  "$BUILD_PY" -m pip --python "$STAGE$PREFIX/bin/python" install -q --disable-pip-version-check \
    --no-compile --no-index --find-links "$WHEELS" "$OWN" "$@"
}
if ! pip_install 2>/dev/null; then
  echo "build-deb: filling the wheel cache $WHEELS" >&2
  "$BUILD_PY" -m pip wheel -q --disable-pip-version-check -w "$WHEELS" "$OWN"
  pip_install
fi
rm -f "$WHEELS"/nodeagent-*.whl

# 3. Make the venv point at its installed location, not the staging tree.
for f in "$STAGE$PREFIX"/bin/*; do
  if [ -f "$f" ] && [ ! -L "$f" ] && head -c 2 "$f" | grep -q '#!'; then
    sed -i "1s|^#!$STAGE$PREFIX/|#!$PREFIX/|" "$f"
  fi
done
sed -i "s|$STAGE$PREFIX|$PREFIX|g" "$STAGE$PREFIX"/bin/activate* "$STAGE$PREFIX/pyvenv.cfg"
find "$STAGE$PREFIX" -name __pycache__ -type d -prune -exec rm -rf {} +
if grep -rIl --exclude-dir=__pycache__ "$STAGE/" "$STAGE$PREFIX/bin" "$STAGE$PREFIX/pyvenv.cfg" >/dev/null 2>&1; then
  echo "build-deb: staging path left in the venv" >&2; exit 1
fi

# 4. Everything else in the tree.
install -d "$STAGE/usr/bin" "$STAGE/lib/systemd/system" "$STAGE/etc/nodeagent" "$STAGE/usr/share/doc/nodeagent" \
  "$STAGE/DEBIAN"
ln -s "$PREFIX/bin/nodeagent" "$STAGE/usr/bin/nodeagent"
install -m 0644 "$SRC"/systemd/nodeagent.service "$SRC"/systemd/nodeagent-bootstrap.service "$STAGE/lib/systemd/system/"
install -m 0644 "$SRC/configs/config.toml" "$STAGE/etc/nodeagent/config.toml"
install -m 0644 "$SRC/README.md" "$STAGE/usr/share/doc/nodeagent/README.md"
install -d -m 0755 "$STAGE/usr/share/doc/nodeagent/docs"
install -m 0644 "$SRC"/docs/*.md "$STAGE/usr/share/doc/nodeagent/docs/"
printf 'nodeagent\nLicense: Apache-2.0\n' > "$STAGE/usr/share/doc/nodeagent/copyright"
for s in postinst prerm postrm; do install -m 0755 "$HERE/debian/$s" "$STAGE/DEBIAN/$s"; done
echo /etc/nodeagent/config.toml > "$STAGE/DEBIAN/conffiles"
SIZE=$(du -sk --exclude=DEBIAN "$STAGE" | cut -f1)
sed -e "s/@VERSION@/$VERSION/" -e "s/@ARCH@/$ARCH/" -e "s/@SIZE@/$SIZE/" "$HERE/debian/control.in" \
  > "$STAGE/DEBIAN/control"

DEB="$OUT/nodeagent_${VERSION}_${ARCH}.deb"
dpkg-deb --root-owner-group -Zgzip --build "$STAGE" "$DEB" >/dev/null
echo "$DEB"
