# shellcheck shell=bash
# Sets up the real test peers. SOURCED by tests/run.sh (under `set -euo pipefail`), so everything here
# lives in functions that `return` non-zero with a message instead of exiting.
#
# What it does (nodeagent_peers_setup, at the end: the steps in NODEAGENT_PEERS_STEPS, in order):
#   * installs Debian `containerd`, `runc` and the system tools the tests run when missing (apt-get; root);
#   * builds the Go peers into a cache outside the repo, keyed by version and a hash of the module files
#     and sources, so a warm run builds nothing:
#       ${NODEAGENT_CACHE:-$HOME/.cache/nodeagent}/bin/<name>-<version>-<hash>
#     Every peer the suite uses is built here, before pytest starts; no test waits for a build.
#   * exports the paths the pytest fixtures (tests/peers/) read, each set by one function:
#       nodeagent_peers_containerd -> NODEAGENT_CONTAINERD, NODEAGENT_RUNC
#       nodeagent_peers_containerd2 -> NODEAGENT_CONTAINERD2, NODEAGENT_CRI_STATUS
#       nodeagent_peers_harness -> NODEAGENT_KUBELET_HARNESS, NODEAGENT_GPU_STUB
#       nodeagent_peers_apiserver -> NODEAGENT_KUBE_APISERVER, NODEAGENT_ETCD
#       nodeagent_peers_kube_control_plane -> NODEAGENT_KUBE_SCHEDULER, NODEAGENT_KUBE_CONTROLLER_MANAGER
#       nodeagent_peers_dra_harness -> NODEAGENT_DRA_HARNESS
#       nodeagent_peers_k8s137 -> NODEAGENT_KUBE_APISERVER_1_37, NODEAGENT_KUBE_SCHEDULER_1_37,
#                                 NODEAGENT_KUBE_CONTROLLER_MANAGER_1_37, NODEAGENT_DRA_HARNESS_1_37
#                                 (and k8s136, k8s135 the same for 1.36 and 1.35)
#       nodeagent_peers_cdi_check -> NODEAGENT_CDI_CHECK, NODEAGENT_CRI_CDI, ...
#       nodeagent_peers_helm -> NODEAGENT_HELM, NODEAGENT_PROMTOOL
#       nodeagent_peers_computedomain_crd -> NODEAGENT_COMPUTEDOMAIN_CRD (NVIDIA's CRD file, not a binary)
#       nodeagent_peers_nvml_abi -> NODEAGENT_NVML_LIBRARY, NODEAGENT_NVML_VIEW, NODEAGENT_NVIDIA_CTK
#       nodeagent_peers_debian_root -> NODEAGENT_DEBIAN_ROOT (a Debian 12 directory tree systemd boots)
#       nodeagent_peers_debian13_root -> NODEAGENT_DEBIAN13_ROOT (the same on Debian 13, with a test venv)
#       nodeagent_peers_arm64_root -> NODEAGENT_DEBIAN_ARM64_ROOT (Debian 12 arm64 from the arm64 agent image, run
#                                 by qemu-user-static)
#       nodeagent_peers_base_image, nodeagent_peers_pause_image, nodeagent_peers_agent_image ->
#         NODEAGENT_BASE_IMAGE, NODEAGENT_PAUSE_IMAGE, NODEAGENT_AGENT_IMAGE (OCI archives for the cluster)
#       nodeagent_peers_arm64_base_image -> NODEAGENT_BASE_IMAGE_ARM64
#       nodeagent_peers_agent_image_multiarch -> NODEAGENT_AGENT_IMAGE_ARM64 (the agent image for arm64),
#                                 NODEAGENT_AGENT_IMAGE_MULTIARCH (an OCI index of both agent images)
#     and NODEAGENT_PEERS_READY=1 once all are set. pytest run without this setup (a developer's
#     `pytest tests/unit/...`) still builds a missing peer on first use through tests/peers/_resolve.py.
#   * resolves files it needs from Go modules (nvml.h) by downloading the module, never by assuming a
#     module cache a previous run left behind.
# KUBEBUILDER_ASSETS, when set to a directory holding kube-apiserver and etcd, is used instead of building
# those two.
#
# Adding another Go peer (e.g. a sample device plugin): put its main package in a module under
# tests/testbin/, then in a function called from nodeagent_peers_setup:
#     build_go_binary my-plugin "$NODEAGENT_TESTBIN/my-module" ./cmd/my-plugin || return 1
#     export NODEAGENT_MY_PLUGIN=$NODEAGENT_GO_BINARY
# NODEAGENT_PEERS_LIB_ONLY=1 when sourcing defines the functions without running the setup.
# Standalone use: `bash tests/testbin/setup.sh` runs the whole setup and prints the exported variables.

NODEAGENT_TESTBIN=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
NODEAGENT_CACHE=${NODEAGENT_CACHE:-$HOME/.cache/nodeagent}
export NODEAGENT_CACHE

_peers_log() { echo "peers: $*" >&2; }

# _go_mod_version MODDIR MODULE [MODFILE]: the version MODDIR/go.mod (or MODFILE) requires for MODULE
# (or "dev").
_go_mod_version() {
  local v
  v=$(awk -v m="$2" '($1 == m || $2 == m) && $NF ~ /^v[0-9]/ {print $NF; exit}' "$1/${3:-go.mod}" 2>/dev/null ||
    true)
  echo "${v:-dev}"
}

# _go_sources_hash MODDIR PKG [MODFILE]: short hash over the Go toolchain version, go.mod, go.sum (or
# MODFILE and its .sum) and the files of the main package, so editing one command does not rebuild the others.
_go_sources_hash() {
  local moddir=$1 pkg=$2 modfile=${3:-go.mod}
  (
    cd "$moddir" || exit 1
    go env GOVERSION
    cat "$modfile" "${modfile%.mod}.sum" 2>/dev/null
    if [ -d "$pkg" ]; then
      find "$pkg" -type f -name '*.go' -print0 | LC_ALL=C sort -z | xargs -0 -r cat
    else
      echo "$pkg"
    fi
  ) | sha256sum | cut -c1-12
}

# build_go_binary NAME MODDIR PKG [VERSION [LDFLAGS [MODFILE [TAGS]]]]
# Builds package PKG (relative to MODDIR, e.g. ./cmd/etcd) of the Go module in MODDIR into the cache
# unless it is already there. Sets NODEAGENT_GO_BINARY to the binary's path. VERSION (default "dev") goes
# into the file name, e.g. "$(_go_mod_version MODDIR k8s.io/kubernetes)"; LDFLAGS (e.g. -X stamps) are
# added to "-s -w" and to the cache key. MODFILE (e.g. go-1.37.mod, with its go-1.37.sum beside it)
# builds the same sources against another module file (go build -modfile); TAGS are go build tags. Both
# go into the cache key. Concurrent callers wait on a lock instead of building twice; the binary appears
# atomically.
build_go_binary() {
  local name=$1 moddir=$2 pkg=$3 version=${4:-} ldflags=${5:-} modfile=${6:-} tags=${7:-}
  if ! command -v go >/dev/null 2>&1; then
    _peers_log "cannot build $name: the Go toolchain is not installed (need go >= 1.24 on PATH)"
    return 1
  fi
  local hash
  hash=$( (_go_sources_hash "$moddir" "$pkg" "$modfile" && echo "$ldflags" &&
    if [ -n "$modfile$tags" ]; then echo "modfile=$modfile tags=$tags"; fi) | sha256sum | cut -c1-12) || {
    _peers_log "cannot hash $moddir"
    return 1
  }
  _build_into_cache "$name" "${version:-dev}" "$hash" "" _go_build_plain "$moddir" "$pkg" "$ldflags" "$modfile" "$tags"
}

# The compiler's flags of every peer build: no DWARF. The linker's -s -w drops it from the binaries anyway, and
# the compiler then spends about a fifth less CPU (k8s.io/client-go/informers and two packages of
# k8s.io/kubernetes, cold: 328 against 261 CPU-seconds, 2026-11-29). The binaries are the same but for the
# DWARF that was stripped, so the flag is not part of the cache key.
NODEAGENT_GO_GCFLAGS="all=-dwarf=false"

# _go_build_plain OUT MODDIR PKG LDFLAGS MODFILE TAGS: a static (CGO_ENABLED=0) build of PKG into OUT.
_go_build_plain() {
  local out=$1 moddir=$2 pkg=$3 ldflags=$4 modfile=$5 tags=$6
  cd "$moddir" &&
    CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false -p=${NODEAGENT_GO_PARALLEL:-2}" \
      nice -n 10 go build ${modfile:+-modfile="$modfile"} ${tags:+-tags="$tags"} -trimpath \
      -gcflags="$NODEAGENT_GO_GCFLAGS" -ldflags="-s -w $ldflags" -o "$out" "$pkg"
}

# _go_build_cgo OUT MODDIR PKG: a cgo (gcc) build of PKG into OUT, with a private temp dir.
_go_build_cgo() {
  local out=$1 moddir=$2 pkg=$3 tmp rc=0
  tmp=$(mktemp -d "${NODEAGENT_CACHE}/cgo-tmp.XXXXXX") || return 1
  (
    cd "$moddir" &&
      TMPDIR=$tmp GOTMPDIR=$tmp CGO_ENABLED=1 CGO_CFLAGS="-O2 -w" \
        GOFLAGS="-mod=mod -buildvcs=false -p=${NODEAGENT_GO_PARALLEL:-2}" \
        nice -n 10 go build -trimpath -gcflags="$NODEAGENT_GO_GCFLAGS" -ldflags="-s -w" -o "$out" "$pkg"
  ) || rc=$?
  rm -rf "$tmp"
  return "$rc"
}

# _build_into_cache NAME VERSION HASH LABEL BUILDER ARGS...: unless the cache holds NAME-VERSION-HASH, runs
# "BUILDER OUT ARGS..." in a subshell (its output in the cache's logs/) and moves OUT into place, so the
# binary appears atomically; concurrent callers wait on a lock instead of building twice. Other builds of
# the peer (older sources or versions) go once nobody has touched them for a week. Sets NODEAGENT_GO_BINARY.
_build_into_cache() {
  local name=$1 version=$2 hash=$3 label=$4 builder=$5
  shift 5
  local bindir=$NODEAGENT_CACHE/bin logdir=$NODEAGENT_CACHE/logs dest
  dest=$bindir/$name-$version-$hash
  if [ -n "${NODEAGENT_PEERS_PLAN:-}" ]; then
    if [ -x "$dest" ]; then _peers_log "plan: $name $version cached"; else _peers_log "plan: $name $version to build"; fi
    NODEAGENT_GO_BINARY=$dest
    return 0
  fi
  mkdir -p "$bindir" "$logdir" || return 1
  if [ ! -x "$dest" ]; then
    local lock=$bindir/.$name-$version.lock log=$logdir/build-$name-$version-$hash.log
    exec {_peers_lock_fd}>"$lock" || return 1
    if ! flock -n "$_peers_lock_fd"; then
      _peers_log "waiting for another build of $name (log: $log)"
      flock "$_peers_lock_fd" || return 1
    fi
    if [ ! -x "$dest" ]; then
      _peers_log "building $name $version${label:+ $label} (not in the cache; log: $log)"
      local start=$SECONDS rc=0
      ("$builder" "$dest.tmp.$$" "$@") >"$log" 2>&1 || rc=$?
      if [ "$rc" -ne 0 ]; then
        rm -f "$dest.tmp.$$"
        exec {_peers_lock_fd}>&-
        _peers_log "building $name failed (exit $rc); last lines of $log:"
        tail -n 20 "$log" >&2
        return 1
      fi
      mv -f "$dest.tmp.$$" "$dest"
      _peers_log "built $name in $((SECONDS - start))s -> $dest"
    fi
    exec {_peers_lock_fd}>&-
    find "$bindir" -maxdepth 1 -type f -name "$name-*" ! -name "${dest##*/}" -mtime +7 -delete 2>/dev/null || true
  fi
  NODEAGENT_GO_BINARY=$dest
}

# _peers_install_debian PKG...: apt-get install the packages that are not installed yet.
_peers_install_debian() {
  local missing=() p st
  for p in "$@"; do
    st=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
    [ "$st" = "install ok installed" ] || missing+=("$p")
  done
  [ "${#missing[@]}" -eq 0 ] && return 0
  if [ -n "${NODEAGENT_PEERS_PLAN:-}" ]; then
    _peers_log "plan: Debian packages to install: ${missing[*]}"
    return 0
  fi
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    _peers_log "missing Debian packages: ${missing[*]} (install them: apt-get install ${missing[*]})"
    return 1
  fi
  _peers_log "installing ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null || {
    _peers_log "apt-get update failed"
    return 1
  }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null || {
    _peers_log "apt-get install ${missing[*]} failed"
    return 1
  }
}

# Debian's containerd and runc, and the system tools the tests run (openssl for the apiserver's
# certificates, strace, systemd-analyze, unshare, dpkg-deb, kubectl's README lines are run with the
# machine's kubectl when present).
nodeagent_peers_containerd() {
  _peers_install_debian containerd runc openssl strace systemd util-linux dpkg || return 1
  if [ -n "${NODEAGENT_PEERS_PLAN:-}" ] && ! command -v containerd >/dev/null 2>&1; then
    return 0
  fi
  NODEAGENT_CONTAINERD=$(command -v containerd) || { _peers_log "containerd not on PATH"; return 1; }
  NODEAGENT_RUNC=$(command -v runc) || { _peers_log "runc not on PATH"; return 1; }
  export NODEAGENT_CONTAINERD NODEAGENT_RUNC
}

# _go_module_dir MODDIR MODULE: the directory of MODULE (at the version MODDIR/go.mod requires) in the Go
# module cache, downloaded from the module proxy when the cache does not hold it (`go list -m` would print
# an empty directory instead). One line naming the module and the proxy when the download fails.
_go_module_dir() {
  local moddir=$1 module=$2 out dir err
  out=$(cd "$moddir" && GOFLAGS=-mod=mod go mod download -json "$module" 2>&1) || true
  dir=$(printf '%s\n' "$out" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p' | head -n 1)
  if [ -z "$dir" ] || [ ! -d "$dir" ]; then
    err=$(printf '%s\n' "$out" | sed -n 's/^[[:space:]]*"Error": "\(.*\)",\{0,1\}$/\1/p' | head -n 1)
    _peers_log "cannot download Go module $module (for $moddir) from $(go env GOPROXY): ${err:-$(printf '%s' "$out" | tail -n 1)}"
    return 1
  fi
  printf '%s\n' "$dir"
}

nodeagent_peers_apiserver() {
  if [ -n "${KUBEBUILDER_ASSETS:-}" ]; then
    if [ -x "$KUBEBUILDER_ASSETS/kube-apiserver" ] && [ -x "$KUBEBUILDER_ASSETS/etcd" ]; then
      export NODEAGENT_KUBE_APISERVER=$KUBEBUILDER_ASSETS/kube-apiserver
      export NODEAGENT_ETCD=$KUBEBUILDER_ASSETS/etcd
      return 0
    fi
    _peers_log "KUBEBUILDER_ASSETS=$KUBEBUILDER_ASSETS lacks kube-apiserver or etcd; building them"
  fi
  local etcd_mod=$NODEAGENT_TESTBIN/etcd peers_mod=$NODEAGENT_TESTBIN/peers
  build_go_binary etcd "$etcd_mod" ./cmd/etcd "$(_go_mod_version "$etcd_mod" go.etcd.io/etcd/server/v3)" ||
    return 1
  export NODEAGENT_ETCD=$NODEAGENT_GO_BINARY
  local kube_version
  kube_version=$(_go_mod_version "$peers_mod" k8s.io/kubernetes)
  build_go_binary kube-apiserver "$peers_mod" ./cmd/kube-apiserver "$kube_version" \
    "$(_kube_version_ldflags "$kube_version")" || return 1
  export NODEAGENT_KUBE_APISERVER=$NODEAGENT_GO_BINARY
}

# _kube_version_ldflags v1.X.Y: the -X stamps a release build of Kubernetes carries (/version answers).
_kube_version_ldflags() {
  local v=$1 major minor rest
  major=${v#v}
  major=${major%%.*}
  rest=${v#v*.}
  minor=${rest%%.*}
  local pkg=k8s.io/component-base/version
  echo "-X $pkg.gitVersion=$v -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
}

nodeagent_peers_harness() {
  local peers_mod=$NODEAGENT_TESTBIN/peers stub_mod=$NODEAGENT_TESTBIN/sample-device-plugin
  build_go_binary kubelet-harness "$peers_mod" ./cmd/kubelet-harness \
    "$(_go_mod_version "$peers_mod" k8s.io/kubernetes)" || return 1
  export NODEAGENT_KUBELET_HARNESS=$NODEAGENT_GO_BINARY
  # the kubelet's own device-plugin stub (the sample device plugin's server) as another vendor's GPU plugin
  build_go_binary gpu-stub "$stub_mod" ./cmd/gpu-stub "$(_go_mod_version "$stub_mod" k8s.io/kubernetes)" || return 1
  export NODEAGENT_GPU_STUB=$NODEAGENT_GO_BINARY
}

# containerd 2 (config versions 3 and 4), built from the module pinned in tests/testbin/containerd2/go.mod.
nodeagent_peers_containerd2() {
  local mod=$NODEAGENT_TESTBIN/containerd2 version
  version=$(_go_mod_version "$mod" github.com/containerd/containerd/v2)
  build_go_binary containerd2 "$mod" ./cmd/containerd "$version" \
    "-X github.com/containerd/containerd/v2/version.Version=$version" || return 1
  export NODEAGENT_CONTAINERD2=$NODEAGENT_GO_BINARY
  build_go_binary cri-status "$mod" ./cmd/cri-status "$version" || return 1
  export NODEAGENT_CRI_STATUS=$NODEAGENT_GO_BINARY
}

# The Kubernetes sample device plugin, for tests/bench/bench_deviceplugin.py only (not part of the setup
# run by tests/run.sh): NODEAGENT_PEERS_LIB_ONLY=1 source this file, then call this function.
nodeagent_peers_sample_device_plugin() {
  local mod=$NODEAGENT_TESTBIN/sample-device-plugin
  build_go_binary sample-device-plugin "$mod" k8s.io/kubernetes/test/images/sample-device-plugin \
    "$(_go_mod_version "$mod" k8s.io/kubernetes)" || return 1
  export NODEAGENT_SAMPLE_DEVICE_PLUGIN=$NODEAGENT_GO_BINARY
}

# kube-scheduler and kube-controller-manager from the peers module (same release as kube-apiserver), for
# the DRA scheduling tests (tests/peers/controlplane.py).
nodeagent_peers_kube_control_plane() {
  local peers_mod=$NODEAGENT_TESTBIN/peers kube_version
  kube_version=$(_go_mod_version "$peers_mod" k8s.io/kubernetes)
  build_go_binary kube-scheduler "$peers_mod" ./cmd/kube-scheduler "$kube_version" \
    "$(_kube_version_ldflags "$kube_version")" || return 1
  export NODEAGENT_KUBE_SCHEDULER=$NODEAGENT_GO_BINARY
  build_go_binary kube-controller-manager "$peers_mod" ./cmd/kube-controller-manager "$kube_version" \
    "$(_kube_version_ldflags "$kube_version")" || return 1
  export NODEAGENT_KUBE_CONTROLLER_MANAGER=$NODEAGENT_GO_BINARY
}

# The other Kubernetes releases of the DRA tests, built from the same Go sources as the v1.34 peers
# (tests/testbin/peers, tests/testbin/dra-harness) against another k8s.io/kubernetes through a module file
# beside each go.mod (go-1.<minor>.mod / go-1.<minor>.sum, go build -modfile) and one shared Go build cache.
# _peers_k8s_release MINOR TAGS COMMANDS...: builds COMMANDS (kube-apiserver, kube-scheduler,
# kube-controller-manager, dra-harness) of release 1.MINOR; TAGS are the dra-harness build tags (the kubelet
# API of that release: k8s135, k8s136, k8s137 pick the compat_k8s1NN.go of the dra-harness).
# Exports NODEAGENT_<COMMAND>_1_<MINOR>, e.g. NODEAGENT_KUBE_APISERVER_1_37.
# These releases are compiled without inlining as well (-l): a quarter less compiler CPU (kube-scheduler v1.36.3,
# cold: 528 against 390 CPU-seconds, 2026-11-29), for binaries somewhat slower that serve only the DRA tests of
# every release; the v1.34 peers, which most of the suite runs on, keep the compiler's inlining. Like the DWARF
# flag, -l is not part of the cache key: a binary built either way is a build of the same sources.
_peers_k8s_release() {
  local minor=$1 tags=$2 peers_mod=$NODEAGENT_TESTBIN/peers harness_mod=$NODEAGENT_TESTBIN/dra-harness
  local NODEAGENT_GO_GCFLAGS="$NODEAGENT_GO_GCFLAGS -l"  # seen by the builds below (bash's dynamic scope)
  shift 2
  local mf=go-1.$minor.mod v ld cmd var
  v=$(_go_mod_version "$peers_mod" k8s.io/kubernetes "$mf")
  ld=$(_kube_version_ldflags "$v")
  for cmd in "$@"; do
    if [ "$cmd" = dra-harness ]; then
      build_go_binary dra-harness "$harness_mod" ./cmd/dra-harness \
        "$(_go_mod_version "$harness_mod" k8s.io/kubernetes "$mf")" "" "$mf" "$tags" || return 1
    else
      build_go_binary "$cmd" "$peers_mod" "./cmd/$cmd" "$v" "$ld" "$mf" || return 1
    fi
    var=$(echo "$cmd" | tr 'a-z-' 'A-Z_')
    export "NODEAGENT_${var}_1_${minor}=$NODEAGENT_GO_BINARY"
  done
}

# v1.35.4, v1.36.3, v1.37.2: the same set for each (the DRA suites run on every release; the controller
# manager creates the ResourceClaims of pod templates).
nodeagent_peers_k8s137() {
  _peers_k8s_release 37 k8s137 kube-apiserver kube-scheduler kube-controller-manager dra-harness
}

nodeagent_peers_k8s136() {
  _peers_k8s_release 36 k8s136 kube-apiserver kube-scheduler kube-controller-manager dra-harness
}

nodeagent_peers_k8s135() {
  _peers_k8s_release 35 k8s135 kube-apiserver kube-scheduler kube-controller-manager dra-harness
}

# The kubelet's DRA manager and plugin watcher (tests/testbin/dra-harness, same Kubernetes release as
# the peers module).
nodeagent_peers_dra_harness() {
  local mod=$NODEAGENT_TESTBIN/dra-harness
  build_go_binary dra-harness "$mod" ./cmd/dra-harness "$(_go_mod_version "$mod" k8s.io/kubernetes)" || return 1
  export NODEAGENT_DRA_HARNESS=$NODEAGENT_GO_BINARY
}

# cdi-check: drives the CDI reference library (tags.cncf.io/container-device-interface/pkg/cdi, version
# pinned in tests/testbin/cdi-check/go.mod) for the CDI tests; the same module has cri-cdi (creates a
# container through CRI with CDI devices and prints the OCI spec) and pause (the test image's process).
nodeagent_peers_cdi_check() {
  local mod=$NODEAGENT_TESTBIN/cdi-check version
  version=$(_go_mod_version "$mod" tags.cncf.io/container-device-interface)
  build_go_binary cdi-check "$mod" . "$version" || return 1
  export NODEAGENT_CDI_CHECK=$NODEAGENT_GO_BINARY
  build_go_binary cri-cdi "$mod" ./cmd/cri-cdi "$version" || return 1
  export NODEAGENT_CRI_CDI=$NODEAGENT_GO_BINARY
  build_go_binary cdi-pause "$mod" ./cmd/pause "$version" || return 1
  export NODEAGENT_CDI_PAUSE=$NODEAGENT_GO_BINARY
  # containerd 2's runc shim (Debian's 1.6 shim cannot serve containerd 2), from the containerd2 module.
  local cd2=$NODEAGENT_TESTBIN/containerd2
  build_go_binary containerd2-shim-runc-v2 "$cd2" github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 \
    "$(_go_mod_version "$cd2" github.com/containerd/containerd/v2)" || return 1
  export NODEAGENT_CONTAINERD2_SHIM=$NODEAGENT_GO_BINARY
}

# NFD's API CRDs (NodeFeature, NodeFeatureRule, NodeFeatureGroup) of sigs.k8s.io/node-feature-discovery from
# the Go module proxy, copied into the cache once per version: the object [publish] labels = "nodefeature"
# writes (tests/integration/test_nodefeature.py, tests/e2e/test_kube_confinement.py).
NODEAGENT_NFD_VERSION=v0.18.2
nodeagent_peers_nfd_crd() {
  local dest=$NODEAGENT_CACHE/crds/nfd-api-crds-$NODEAGENT_NFD_VERSION.yaml out dir
  if [ -n "${NODEAGENT_PEERS_PLAN:-}" ]; then
    if [ -s "$dest" ]; then _peers_log "plan: NFD CRDs $NODEAGENT_NFD_VERSION cached"; else
      _peers_log "plan: NFD CRDs $NODEAGENT_NFD_VERSION to fetch"; fi
    export NODEAGENT_NFD_CRD=$dest
    return 0
  fi
  if [ ! -s "$dest" ]; then
    mkdir -p "${dest%/*}" || return 1
    out=$(cd "${dest%/*}" && GOFLAGS=-mod=mod go mod download -json \
      "sigs.k8s.io/node-feature-discovery@$NODEAGENT_NFD_VERSION" 2>&1) || true
    dir=$(printf '%s\n' "$out" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p' | head -n 1)
    if [ -z "$dir" ] || [ ! -s "$dir/deployment/base/nfd-crds/nfd-api-crds.yaml" ]; then
      _peers_log "cannot download sigs.k8s.io/node-feature-discovery@$NODEAGENT_NFD_VERSION: $(printf '%s' "$out" | tail -n 1)"
      return 1
    fi
    cp "$dir/deployment/base/nfd-crds/nfd-api-crds.yaml" "$dest.tmp.$$" && mv -f "$dest.tmp.$$" "$dest" || return 1
  fi
  export NODEAGENT_NFD_CRD=$dest
}

# The real kubelet and kubectl of the same release as the apiserver (tests/testbin/node: cmd/kubelet and
# cmd/kubectl over the pinned k8s.io/kubernetes), for the single-node cluster of tests/cluster.
nodeagent_peers_kubelet() {
  local mod=$NODEAGENT_TESTBIN/node kube_version ld
  kube_version=$(_go_mod_version "$mod" k8s.io/kubernetes)
  ld=$(_kube_version_ldflags "$kube_version")
  build_go_binary kubelet "$mod" ./cmd/kubelet "$kube_version" "$ld" || return 1
  export NODEAGENT_KUBELET=$NODEAGENT_GO_BINARY
  build_go_binary kubectl "$mod" ./cmd/kubectl "$kube_version" "$ld" || return 1
  export NODEAGENT_KUBECTL=$NODEAGENT_GO_BINARY
}

# --- NVML ABI mode: the stand-in libnvidia-ml.so.1 and NVIDIA's Go tools on it (README: ABI mode) ---------
# Builds, cached like the Go peers:
#   ${NODEAGENT_CACHE}/lib/nvml-abi-<hash>/libnvidia-ml.so.1   (nodeagent/simulator/abi, gcc; nvml.h from go-nvml)
#   ${NODEAGENT_CACHE}/bin/nvml-view-<version>-<hash>          (tests/testbin/nvml-view: go-nvml + go-nvlib)
#   ${NODEAGENT_CACHE}/bin/nvidia-ctk-<version>-<hash>         (tests/testbin/nvidia-ctk: the toolkit's CLI)
# and exports NODEAGENT_NVML_LIBRARY, NODEAGENT_NVML_VIEW, NODEAGENT_NVIDIA_CTK. cgo builds use a private
# TMPDIR/GOTMPDIR (a stray nvml.h in a shared temp directory shadows go-nvml's).

# _abi_python: the interpreter of the project's venv (the one the stand-in embeds by default).
_abi_python() {
  local root
  root=$(cd "$NODEAGENT_TESTBIN/../.." && pwd)
  if [ -x "$root/${VENV:-.venv}/bin/python" ]; then
    echo "$root/${VENV:-.venv}/bin/python"
  else
    command -v python3
  fi
}

# build_cgo_binary NAME MODDIR PKG VERSION: like build_go_binary, with cgo (gcc) and a private temp dir.
build_cgo_binary() {
  local name=$1 moddir=$2 pkg=$3 version=${4:-dev} hash
  hash=$( (_go_sources_hash "$moddir" "$pkg" && echo cgo) | sha256sum | cut -c1-12) || return 1
  _build_into_cache "$name" "$version" "$hash" "with cgo" _go_build_cgo "$moddir" "$pkg"
}

nodeagent_peers_nvml_abi() {
  local view_mod=$NODEAGENT_TESTBIN/nvml-view ctk_mod=$NODEAGENT_TESTBIN/nvidia-ctk py nvml_dir nvml_h hash
  _peers_install_debian gcc libc6-dev || return 1
  py=$(_abi_python)
  nvml_dir=$(_go_module_dir "$view_mod" github.com/NVIDIA/go-nvml) || return 1
  nvml_h=$nvml_dir/pkg/nvml/nvml.h
  if [ ! -f "$nvml_h" ]; then
    _peers_log "github.com/NVIDIA/go-nvml in $nvml_dir has no pkg/nvml/nvml.h"
    return 1
  fi
  hash=$(cd "$NODEAGENT_TESTBIN/../.." && "$py" -m nodeagent.simulator.abi.build --nvml-h "$nvml_h" --hash) || return 1
  local libdir=$NODEAGENT_CACHE/lib/nvml-abi-$hash
  if [ -n "${NODEAGENT_PEERS_PLAN:-}" ]; then
    _peers_log "plan: stand-in libnvidia-ml.so.1 $([ -f "$libdir/libnvidia-ml.so.1" ] && echo cached || echo to build)"
  elif [ ! -f "$libdir/libnvidia-ml.so.1" ]; then
    _peers_log "building the stand-in libnvidia-ml.so.1 ($libdir)"
    (cd "$NODEAGENT_TESTBIN/../.." && "$py" -m nodeagent.simulator.abi.build --nvml-h "$nvml_h" --out "$libdir") >/dev/null ||
      return 1
  fi
  export NODEAGENT_NVML_LIBRARY=$libdir/libnvidia-ml.so.1
  build_cgo_binary nvml-view "$view_mod" . "$(_go_mod_version "$view_mod" github.com/NVIDIA/go-nvlib)" || return 1
  export NODEAGENT_NVML_VIEW=$NODEAGENT_GO_BINARY
  build_cgo_binary nvidia-ctk "$ctk_mod" github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-ctk \
    "$(_go_mod_version "$ctk_mod" github.com/NVIDIA/nvidia-container-toolkit)" || return 1
  export NODEAGENT_NVIDIA_CTK=$NODEAGENT_GO_BINARY
}

# helm (helm.sh/helm/v3/cmd/helm, release pinned in tests/testbin/helm/go.mod), the judge of the chart in
# packaging/helm/nodeagent (lint, template, install), and Debian's prometheus package for promtool, the judge of
# packaging/prometheus/ and packaging/grafana/ (check rules, check metrics, test rules).
nodeagent_peers_helm() {
  local mod=$NODEAGENT_TESTBIN/helm version kube minor ld
  version=$(_go_mod_version "$mod" helm.sh/helm/v3)
  # as helm's Makefile: the Kubernetes version `helm template` and `helm lint` assume is the client-go's
  # (v0.X.Y -> 1.X), not the 1.20 compiled in
  kube=$(awk '$1 == "k8s.io/client-go" {print $2; exit}' "$mod/go.mod")
  minor=${kube#v0.}
  minor=${minor%%.*}
  case $minor in
    '' | *[!0-9]*) _peers_log "cannot read the k8s.io/client-go version from $mod/go.mod"; return 1 ;;
  esac
  ld="-X helm.sh/helm/v3/internal/version.version=$version -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
  ld="$ld -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$minor"
  ld="$ld -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$minor"
  # helm's module has its Kubernetes and golang.org/x modules at the versions of the v1.36 peers, which are
  # compiled before it and without inlining: built the same way, it reuses their client-go, API types and
  # apimachinery (a few `helm template` runs are all the suite asks of it; inlining buys nothing there)
  local NODEAGENT_GO_GCFLAGS="$NODEAGENT_GO_GCFLAGS -l"
  build_go_binary helm "$mod" helm.sh/helm/v3/cmd/helm "$version" "$ld" || return 1
  export NODEAGENT_HELM=$NODEAGENT_GO_BINARY
  _peers_install_debian prometheus || return 1
  if [ -n "${NODEAGENT_PEERS_PLAN:-}" ] && [ ! -x /usr/bin/promtool ]; then
    return 0
  fi
  [ -x /usr/bin/promtool ] || { _peers_log "Debian's prometheus package ships no /usr/bin/promtool"; return 1; }
  export NODEAGENT_PROMTOOL=/usr/bin/promtool
}

# --- Debian roots: booted by systemd (tests/e2e/test_systemd_boot.py), chroots for the package ------------
# Directory trees made from Debian's packages with mmdebstrap, cached as ${NODEAGENT_CACHE}/debian-root-<hash>
# (hash of suite, architecture, packages, mirror and the functions that build them), each made in a temporary
# directory beside it and renamed into place; the tests never write into one (they boot or chroot an overlay).
#   nodeagent_peers_debian_root    -> NODEAGENT_DEBIAN_ROOT: Debian 12 (bookworm, Python 3.11) with systemd as
#                                     PID 1, dbus, Debian's containerd and runc, and what the .deb depends on
#                                     (python3, python3-venv, procps), so `apt-get install ./nodeagent_*.deb`
#                                     needs no network. Booted with systemd-nspawn (systemd-container); installing
#                                     that package may upgrade the host's systemd packages, which is why it
#                                     happens here and not in a test.
#   nodeagent_peers_debian13_root  -> NODEAGENT_DEBIAN13_ROOT: the same on Debian 13 (trixie, Python 3.13), plus
#                                     /opt/nodeagent-test, a venv of the test dependencies (pyproject's [test]
#                                     extra) in which the unit tests run under Python 3.13.
#   nodeagent_peers_arm64_root     -> NODEAGENT_DEBIAN_ARM64_ROOT: Debian 12 for arm64, cut from the arm64
#                                     agent image (python3, python3-venv, procps), its programs run by Debian's
#                                     qemu-user-static (the kernel's binfmt_misc hands aarch64 ELF files to
#                                     qemu-aarch64-static; registered here when it is not).
NODEAGENT_DEBIAN_SUITE=${NODEAGENT_DEBIAN_SUITE:-bookworm}
NODEAGENT_DEBIAN13_SUITE=${NODEAGENT_DEBIAN13_SUITE:-trixie}
NODEAGENT_DEBIAN_MIRROR=${NODEAGENT_DEBIAN_MIRROR:-http://deb.debian.org/debian}
NODEAGENT_DEBIAN_PACKAGES="systemd,systemd-sysv,dbus,libpam-systemd,containerd,runc,python3,python3-venv,libc6,procps"
NODEAGENT_DEBIAN_ARM64_PACKAGES="python3-venv,procps"

nodeagent_peers_debian_root() {
  _peers_install_debian mmdebstrap systemd-container || return 1
  _peers_debian_root NODEAGENT_DEBIAN_ROOT "$NODEAGENT_DEBIAN_SUITE" amd64 "$NODEAGENT_DEBIAN_PACKAGES"
}

nodeagent_peers_debian13_root() {
  _peers_install_debian mmdebstrap systemd-container || return 1
  local reqs
  reqs=$(_peers_test_requirements) || return 1
  # e2fsprogs: chattr, which unit tests run
  _peers_debian_root NODEAGENT_DEBIAN13_ROOT "$NODEAGENT_DEBIAN13_SUITE" amd64 "$NODEAGENT_DEBIAN_PACKAGES,e2fsprogs" \
    "$reqs"
}

# The arm64 root is cut from the arm64 agent image, whose final stage already installed python3 and
# ca-certificates under qemu (their emulated maintainer scripts, byte-compiling the standard library and hashing
# the certificates, are most of an emulated Debian install: 696 s of one core for a root of its own). What the
# image adds (the agent in /opt/nodeagent, its entrypoint, its config) is removed, and the package's other
# dependencies (python3-venv, procps) are installed by apt-get under qemu. Its cache key leaves out the agent's
# sources: a change to nodeagent/ rebuilds the image, never this root.
_arm64_root_build() {
  local dir=$1 c mnt rc=0
  c=$(_buildah_multiarch from -q --arch arm64 "oci-archive:$NODEAGENT_AGENT_IMAGE_ARM64") || return 1
  _buildah_multiarch run --isolation chroot "$c" -- sh -ec '
    rm -rf /opt/nodeagent /usr/local/bin/nodeagent /usr/local/bin/nodeagent-entrypoint /etc/nodeagent
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends '"${NODEAGENT_DEBIAN_ARM64_PACKAGES//,/ }"'
    apt-get clean
    rm -rf /var/lib/apt/lists/*' &&
    mnt=$(_buildah_multiarch mount "$c") && mkdir -p "$dir" && cp -a "$mnt/." "$dir/" || rc=1
  _buildah_multiarch rm "$c" >/dev/null 2>&1 || true
  _buildah_multiarch rmi "$NODEAGENT_AGENT_IMAGE_REF" >/dev/null 2>&1 || true  # the name the archive's image took
  return "$rc"
}

nodeagent_peers_arm64_root() {
  _peers_install_debian qemu-user-static buildah || return 1
  if [ -z "${NODEAGENT_PEERS_PLAN:-}" ]; then
    _peers_binfmt_aarch64 || return 1
  fi
  nodeagent_peers_arm64_base_image || return 1
  local repo hash
  repo=$(cd "$NODEAGENT_TESTBIN/../.." && pwd)
  hash=$( (echo "$NODEAGENT_BASE_IMAGE_ARM64_HASH $NODEAGENT_DEBIAN_ARM64_PACKAGES" &&
    sha256sum <"$repo/packaging/kubernetes/Containerfile" && declare -f _arm64_root_build) | sha256sum | cut -c1-12) ||
    return 1
  if [ ! -f "$NODEAGENT_CACHE/debian-root-$hash/etc/os-release" ]; then
    nodeagent_peers_agent_image_arm64 || return 1
  fi
  _root_into_cache NODEAGENT_DEBIAN_ARM64_ROOT "$hash" "Debian $NODEAGENT_DEBIAN_SUITE arm64" \
    _arm64_root_build
}

# _peers_test_requirements: the [test] extra and the dependencies of pyproject.toml, one per line.
_peers_test_requirements() {
  python3 - "$NODEAGENT_TESTBIN/../../pyproject.toml" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["test"]))
PY
}

# _peers_binfmt_aarch64: the kernel runs aarch64 programs with Debian's qemu-aarch64-static. Mounts binfmt_misc
# and registers qemu-user-static's own entry (flag F: the interpreter is opened now, so it works in a chroot)
# when systemd-binfmt has not (no systemd as init here). One line naming the kernel's answer when it refuses.
_peers_binfmt_aarch64() {
  local fs=/proc/sys/fs/binfmt_misc conf=/usr/lib/binfmt.d/qemu-aarch64.conf err
  [ -f "$fs/qemu-aarch64" ] && return 0
  if [ ! -f "$fs/register" ]; then
    err=$(mount -t binfmt_misc binfmt_misc "$fs" 2>&1) || {
      _peers_log "cannot mount binfmt_misc on $fs: $err (arm64 programs need qemu-aarch64-static named explicitly)"
      return 1
    }
  fi
  [ -f "$conf" ] || { _peers_log "qemu-user-static has no $conf"; return 1; }
  err=$( (cat "$conf" > "$fs/register") 2>&1) || {
    _peers_log "the kernel refused to register $conf in $fs/register: $err"
    return 1
  }
}

# _peers_debian_root VAR SUITE ARCH PACKAGES [TEST_REQUIREMENTS]: a cached mmdebstrap root, its path exported
# as VAR. TEST_REQUIREMENTS (lines of pip requirements) go into a venv /opt/nodeagent-test of the root's python3.
_peers_debian_root() {
  local var=$1 suite=$2 arch=$3 packages=$4 reqs=${5:-} hash
  hash=$( (echo "$suite $arch $NODEAGENT_DEBIAN_MIRROR $packages" && echo "$reqs" &&
    declare -f _debian_root_build) | sha256sum | cut -c1-12) || return 1
  _root_into_cache "$var" "$hash" "Debian $suite $arch" _debian_root_build "$suite" "$arch" "$packages" "$reqs"
}

# _root_into_cache VAR HASH LABEL BUILDER ARGS...: exports VAR=${NODEAGENT_CACHE}/debian-root-HASH, made by
# "BUILDER TMPDIR ARGS..." (its output in the cache's logs/) in a temporary directory beside it and renamed into
# place, unless it is there; concurrent callers wait on a lock.
_root_into_cache() {
  local var=$1 hash=$2 label=$3 builder=$4 dest
  shift 4
  dest=$NODEAGENT_CACHE/debian-root-$hash
  export "$var=$dest"
  if [ -n "${NODEAGENT_PEERS_PLAN:-}" ]; then
    _peers_log "plan: $label root $([ -f "$dest/etc/os-release" ] && echo cached || echo to build)"
    return 0
  fi
  [ -f "$dest/etc/os-release" ] && { touch "$dest"; return 0; }
  mkdir -p "$NODEAGENT_CACHE/logs" || return 1
  local lock=$NODEAGENT_CACHE/.debian-root-$hash.lock log=$NODEAGENT_CACHE/logs/build-debian-root-$hash.log fd
  exec {fd}>"$lock" || return 1
  if ! flock -n "$fd"; then
    _peers_log "waiting for another build of the $label root (log: $log)"
    flock "$fd" || return 1
  fi
  if [ ! -f "$dest/etc/os-release" ]; then
    _peers_log "building a $label root (not in the cache; log: $log)"
    local start=$SECONDS rc=0 tmp=$dest.tmp.$$
    rm -rf "$tmp"
    "$builder" "$tmp" "$@" >"$log" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
      # an interrupted mmdebstrap may leave its /proc, /sys and /dev mounts in the tree: never rm -rf through them
      awk -v t="$tmp/" 'index($2, t) == 1 {print $2}' /proc/mounts | sort -r | xargs -r -n1 umount -l
      rm -rf --one-file-system "$tmp"
      exec {fd}>&-
      _peers_log "building the $label root failed (exit $rc); last lines of $log:"
      tail -n 20 "$log" >&2
      return 1
    fi
    mv -T "$tmp" "$dest"
    _peers_log "built the $label root in $((SECONDS - start))s -> $dest"
    # older roots (other inputs) go once nobody has used them for a week
    find "$NODEAGENT_CACHE" -maxdepth 1 -type d -name 'debian-root-*' -mtime +7 ! -name "${dest##*/}" -exec rm -rf {} + 2>/dev/null || true
  fi
  exec {fd}>&-
}

_debian_root_build() {
  local dir=$1 suite=$2 arch=$3 packages=$4 reqs=$5 hooks=()
  if [ -n "$reqs" ]; then
    printf '%s\n' "$reqs" > "$dir.requirements"
    # pip in the root trusts what this machine's pip trusts (PIP_CERT: a proxy's authority, say)
    local ca=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
    [ -f "$ca" ] || ca=/dev/null
    hooks+=(--customize-hook="cp '$dir.requirements' \"\$1/tmp/requirements.txt\"; cp '$ca' \"\$1/tmp/ca.pem\""
      --customize-hook='chroot "$1" python3 -m venv /opt/nodeagent-test'
      --customize-hook='chroot "$1" env PIP_CERT=/tmp/ca.pem SSL_CERT_FILE=/tmp/ca.pem PIP_FIND_LINKS= /opt/nodeagent-test/bin/pip install -q --disable-pip-version-check -r /tmp/requirements.txt'
      --customize-hook='rm -f "$1/tmp/requirements.txt" "$1/tmp/ca.pem"')
  fi
  nice -n 10 mmdebstrap --variant=minbase --mode=root --format=directory --skip=cleanup/apt/lists \
    --architectures="$arch" --include="$packages" \
    --customize-hook='rm -f "$1/etc/machine-id" "$1/var/lib/dbus/machine-id"; : > "$1/etc/machine-id"' \
    --customize-hook='if [ -d "$1/etc/systemd/system" ]; then ln -sf /dev/null "$1/etc/systemd/system/getty.target"; fi' \
    --customize-hook='if [ -d "$1/etc/systemd/system" ]; then ln -sf /dev/null "$1/etc/systemd/system/console-getty.service"; fi' \
    "${hooks[@]}" "$suite" "$dir" "$NODEAGENT_DEBIAN_MIRROR"
  local rc=$?
  rm -f "$dir.requirements"
  return "$rc"
}

# --- The single-node cluster (tests/cluster): CNI plugins, images built with buildah -----------------------
# Debian's containernetworking-plugins (bridge, host-local, loopback, portmap) give the node its pod network;
# Debian's buildah builds the images from local inputs into ${NODEAGENT_CACHE}/images/<name>-<hash>.tar (OCI
# archives that the cluster fixture imports into containerd's k8s.io namespace; no registry is ever asked):
#   debian base   mmdebstrap of bookworm (minbase), named as the Containerfile's FROM names it
#   pause         the sandbox image: cdi-pause (tests/testbin/cdi-check/cmd/pause) alone in a layer
#   nodeagent     packaging/kubernetes/Containerfile on the repository, FROM the debian base above
# buildah keeps its own storage under ${NODEAGENT_CACHE}/buildah (never the host's /var/lib/containers).
# Debian's docker-registry (the Distribution registry 2.8) is the registry tests/cluster/test_whole_node.py starts
# on 127.0.0.1 to push the agent's image into as the README says, for the cluster's containerd to pull.
NODEAGENT_BASE_IMAGE_REF=docker.io/library/debian:bookworm-slim
NODEAGENT_PAUSE_IMAGE_REF=localhost/nodeagent-test/pause:1
NODEAGENT_AGENT_IMAGE_REF=docker.io/library/nodeagent:0.1.0

_buildah() {
  nice -n 10 buildah --root "$NODEAGENT_CACHE/buildah/storage" --runroot "$NODEAGENT_CACHE/buildah/run" "$@"
}

# _image_into_cache NAME HASH BUILDER ARGS...: unless ${NODEAGENT_CACHE}/images/NAME-HASH.tar exists, runs
# "BUILDER OUT ARGS..." (its output in the cache's logs/) and moves OUT into place; concurrent callers wait on a
# lock. Archives of older inputs go once nobody has touched them for a week. Sets NODEAGENT_IMAGE_ARCHIVE.
_image_into_cache() {
  local name=$1 hash=$2 builder=$3
  shift 3
  local dir=$NODEAGENT_CACHE/images dest
  dest=$dir/$name-$hash.tar
  NODEAGENT_IMAGE_ARCHIVE=$dest
  if [ -n "${NODEAGENT_PEERS_PLAN:-}" ]; then
    if [ -f "$dest" ]; then _peers_log "plan: image $name cached"; else _peers_log "plan: image $name to build"; fi
    return 0
  fi
  [ -f "$dest" ] && return 0
  mkdir -p "$dir" "$NODEAGENT_CACHE/logs" || return 1
  local fd log=$NODEAGENT_CACHE/logs/build-image-$name-$hash.log
  exec {fd}>"$dir/.$name.lock" || return 1
  if ! flock -n "$fd"; then
    _peers_log "waiting for another build of image $name (log: $log)"
    flock "$fd" || return 1
  fi
  if [ ! -f "$dest" ]; then
    _peers_log "building image $name (not in the cache; log: $log)"
    local start=$SECONDS rc=0
    ("$builder" "$dest.tmp.$$" "$@") >"$log" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
      rm -f "$dest.tmp.$$"
      exec {fd}>&-
      _peers_log "building image $name failed (exit $rc); last lines of $log:"
      tail -n 20 "$log" >&2
      return 1
    fi
    mv -f "$dest.tmp.$$" "$dest"
    _peers_log "built image $name in $((SECONDS - start))s ($(du -m "$dest" | cut -f1) MiB) -> $dest"
    find "$dir" -maxdepth 1 -type f -name "$name-*.tar" ! -name "${dest##*/}" -mtime +7 -delete 2>/dev/null || true
  fi
  exec {fd}>&-
}

nodeagent_peers_cluster_tools() {
  _peers_install_debian containernetworking-plugins buildah mmdebstrap iptables docker-registry || return 1
  export NODEAGENT_CNI_BIN_DIR=/usr/lib/cni
}

# _slim_base_opts: what makes mmdebstrap's minbase the image the Containerfile's FROM names, Debian's "slim"
# image: /usr merged by the hook (no usrmerge, which pulls in perl), and dpkg told to leave out manuals, docs
# (but their copyright files), locales and info pages, a rule kept in the image's dpkg config so that a later
# apt-get install (the Containerfile's python3) leaves them out too.
_slim_base_opts() {
  local path
  printf '%s\n' --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr
  for path in /usr/share/man/'*' /usr/share/locale/'*' /usr/share/doc/'*' /usr/share/info/'*' \
    /usr/share/groff/'*' /usr/share/lintian/'*' /usr/share/linda/'*'; do
    printf '%s\n' "--dpkgopt=path-exclude=$path"
  done
  printf '%s\n' --dpkgopt=path-include=/usr/share/locale/locale.alias "--dpkgopt=path-include=/usr/share/doc/*/copyright"
}

# _base_image_build OUT: mmdebstrap's tarball committed by buildah as NODEAGENT_BASE_IMAGE_REF, pushed to OUT.
_base_image_build() {
  local out=$1 tmp c mnt
  tmp=$(mktemp -d "$NODEAGENT_CACHE/base-image.XXXXXX") || return 1
  local -a slim
  mapfile -t slim < <(_slim_base_opts)
  mmdebstrap --variant=minbase --mode=root --format=tar "${slim[@]}" \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
    "$NODEAGENT_DEBIAN_SUITE" "$tmp/rootfs.tar" "$NODEAGENT_DEBIAN_MIRROR" || { rm -rf "$tmp"; return 1; }
  c=$(_buildah from scratch) && mnt=$(_buildah mount "$c") && tar -xf "$tmp/rootfs.tar" -C "$mnt" &&
    _buildah umount "$c" && _buildah config --cmd /bin/bash "$c" &&
    _buildah commit --rm "$c" "$NODEAGENT_BASE_IMAGE_REF" &&
    _buildah push "$NODEAGENT_BASE_IMAGE_REF" "oci-archive:$out:$NODEAGENT_BASE_IMAGE_REF" || { rm -rf "$tmp"; return 1; }
  rm -rf "$tmp"
}

nodeagent_peers_base_image() {
  local hash
  hash=$( (echo "$NODEAGENT_DEBIAN_SUITE $NODEAGENT_DEBIAN_MIRROR $NODEAGENT_BASE_IMAGE_REF" &&
    declare -f _base_image_build _slim_base_opts) | sha256sum | cut -c1-12) || return 1
  _image_into_cache debian-base "$hash" _base_image_build || return 1
  export NODEAGENT_BASE_IMAGE=$NODEAGENT_IMAGE_ARCHIVE NODEAGENT_BASE_IMAGE_REF
  NODEAGENT_BASE_IMAGE_HASH=$hash
}

# _pause_image_build OUT PAUSE: PAUSE as /pause in an image of its own.
_pause_image_build() {
  local out=$1 pause=$2 c
  c=$(_buildah from scratch) && _buildah copy --chmod 0755 "$c" "$pause" /pause &&
    _buildah config --entrypoint '["/pause"]' --user 65535:65535 "$c" &&
    _buildah commit --rm "$c" "$NODEAGENT_PAUSE_IMAGE_REF" &&
    _buildah push "$NODEAGENT_PAUSE_IMAGE_REF" "oci-archive:$out:$NODEAGENT_PAUSE_IMAGE_REF"
}

nodeagent_peers_pause_image() {
  local mod=$NODEAGENT_TESTBIN/cdi-check pause hash
  build_go_binary cdi-pause "$mod" ./cmd/pause "$(_go_mod_version "$mod" tags.cncf.io/container-device-interface)" ||
    return 1
  pause=$NODEAGENT_GO_BINARY
  hash=$( (echo "${pause##*/} $NODEAGENT_PAUSE_IMAGE_REF" && declare -f _pause_image_build) | sha256sum | cut -c1-12) ||
    return 1
  _image_into_cache pause "$hash" _pause_image_build "$pause" || return 1
  export NODEAGENT_PAUSE_IMAGE=$NODEAGENT_IMAGE_ARCHIVE NODEAGENT_PAUSE_IMAGE_REF
}

# _agent_image_inputs REPO: the files the agent image is built from (as .containerignore lets them into the
# build context), one path a line, sorted.
_agent_image_inputs() {
  (cd "$1" && find .containerignore pyproject.toml README.md configs nodeagent packaging/kubernetes -type f \
    ! -path '*/__pycache__/*' ! -name '*.pyc' ! -name '*.so' ! -name '*.so.*' -print | LC_ALL=C sort)
}

# _agent_image_build OUT REPO: `buildah bud` of packaging/kubernetes/Containerfile (chroot isolation; the
# host's network for apt), the base image loaded from its archive when buildah's storage lacks it. pip in the
# build asks no index: the Python dependencies come from a wheelhouse filled here by the host's pip
# (${NODEAGENT_CACHE}/wheels, shared with packaging/build-deb.sh), mounted read-only into the build.
_agent_image_build() {
  local out=$1 repo=$2 py wheels=$NODEAGENT_CACHE/wheels
  py=$(_abi_python)
  mkdir -p "$wheels" || return 1
  "$py" -c 'import tomllib, sys; print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' \
    "$repo/pyproject.toml" >"$out.requirements" || return 1
  "$py" -m pip wheel -q --disable-pip-version-check -w "$wheels" 'setuptools>=68' wheel -r "$out.requirements" ||
    { rm -f "$out.requirements"; return 1; }
  rm -f "$out.requirements"
  _buildah inspect --type image "$NODEAGENT_BASE_IMAGE_REF" >/dev/null 2>&1 ||
    _buildah pull "oci-archive:$NODEAGENT_BASE_IMAGE" || return 1
  (cd "$repo" && _buildah bud --isolation chroot --pull-never --layers -v "$wheels:/wheels:ro" \
    --build-arg PIP_NO_INDEX=1 --build-arg PIP_FIND_LINKS=/wheels -f packaging/kubernetes/Containerfile \
    -t "$NODEAGENT_AGENT_IMAGE_REF" .) || return 1
  _buildah push "$NODEAGENT_AGENT_IMAGE_REF" "oci-archive:$out:$NODEAGENT_AGENT_IMAGE_REF" || return 1
  # The newest image keeps its name and its layers stay as the next build's cache (the apt-get of both stages,
  # the dependencies' install: a change to nodeagent's sources then redoes only its own install); older builds'
  # layers go once the storage passes 2 GiB.
  if [ "$(du -sm "$NODEAGENT_CACHE/buildah/storage" | cut -f1)" -gt 2048 ]; then
    _buildah rmi --prune >/dev/null 2>&1 || true
  fi
}

nodeagent_peers_agent_image() {
  local repo hash
  repo=$(cd "$NODEAGENT_TESTBIN/../.." && pwd)
  hash=$( (echo "$NODEAGENT_BASE_IMAGE_HASH $NODEAGENT_AGENT_IMAGE_REF" && declare -f _agent_image_build &&
    _agent_image_inputs "$repo" | (cd "$repo" && xargs -d '\n' sha256sum)) | sha256sum | cut -c1-12) || return 1
  _image_into_cache nodeagent "$hash" _agent_image_build "$repo" || return 1
  export NODEAGENT_AGENT_IMAGE=$NODEAGENT_IMAGE_ARCHIVE NODEAGENT_AGENT_IMAGE_REF
}

# --- The multi-arch agent image: packaging/kubernetes/Containerfile built for linux/arm64 on this amd64 host ----
# Its build stage runs on the build platform (FROM --platform=$BUILDPLATFORM): pip installs the aarch64 wheels
# of every dependency natively; only the final stage's apt-get runs under qemu-aarch64-static. It is built in a
# buildah storage of its own (${NODEAGENT_CACHE}/buildah-multiarch) holding both Debian base images; that
# storage keeps the build's layers, so a change to nodeagent/ reruns only the build stage's pip and the COPYs.
#   debian base arm64   mmdebstrap --architectures=arm64 of the same suite as the amd64 base
#   nodeagent arm64     the Containerfile with --platform linux/arm64, pushed as an OCI archive
#   nodeagent multiarch an OCI index (oci-archive) of the amd64 and arm64 agent images
NODEAGENT_BASE_IMAGE_PYTHON=${NODEAGENT_BASE_IMAGE_PYTHON:-3.11}  # bookworm's python3
NODEAGENT_AGENT_MULTIARCH_REF=localhost/nodeagent-test/nodeagent-multiarch:0.1.0
NODEAGENT_MULTIARCH_BASE_REF=localhost/nodeagent-test/debian-base

_buildah_multiarch() {
  nice -n 10 buildah --root "$NODEAGENT_CACHE/buildah-multiarch/storage" \
    --runroot "$NODEAGENT_CACHE/buildah-multiarch/run" "$@"
}

# _arm64_base_image_build OUT: the arm64 twin of _base_image_build (mmdebstrap runs its maintainer scripts
# under qemu), committed with architecture arm64.
_arm64_base_image_build() {
  local out=$1 tmp c mnt
  tmp=$(mktemp -d "$NODEAGENT_CACHE/base-image-arm64.XXXXXX") || return 1
  local -a slim
  mapfile -t slim < <(_slim_base_opts)
  mmdebstrap --variant=minbase --mode=root --format=tar --architectures=arm64 "${slim[@]}" \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
    "$NODEAGENT_DEBIAN_SUITE" "$tmp/rootfs.tar" "$NODEAGENT_DEBIAN_MIRROR" || { rm -rf "$tmp"; return 1; }
  c=$(_buildah_multiarch from scratch) && mnt=$(_buildah_multiarch mount "$c") && tar -xf "$tmp/rootfs.tar" -C "$mnt" &&
    _buildah_multiarch umount "$c" && _buildah_multiarch config --cmd /bin/bash --os linux --arch arm64 "$c" &&
    _buildah_multiarch commit --rm "$c" "$NODEAGENT_BASE_IMAGE_REF-arm64" &&
    _buildah_multiarch push "$NODEAGENT_BASE_IMAGE_REF-arm64" "oci-archive:$out:$NODEAGENT_BASE_IMAGE_REF" ||
    { rm -rf "$tmp"; return 1; }
  _buildah_multiarch rmi "$NODEAGENT_BASE_IMAGE_REF-arm64" >/dev/null 2>&1 || true
  rm -rf "$tmp"
}

# qemu-bound (mmdebstrap's maintainer scripts run emulated): in the background list
nodeagent_peers_arm64_base_image() {
  _peers_install_debian mmdebstrap qemu-user-static buildah || return 1
  if [ -z "${NODEAGENT_PEERS_PLAN:-}" ]; then
    _peers_binfmt_aarch64 || return 1
  fi
  local hash
  hash=$( (echo "$NODEAGENT_DEBIAN_SUITE $NODEAGENT_DEBIAN_MIRROR $NODEAGENT_BASE_IMAGE_REF arm64" &&
    declare -f _arm64_base_image_build _slim_base_opts) | sha256sum | cut -c1-12) || return 1
  _image_into_cache debian-base-arm64 "$hash" _arm64_base_image_build || return 1
  export NODEAGENT_BASE_IMAGE_ARM64=$NODEAGENT_IMAGE_ARCHIVE
  NODEAGENT_BASE_IMAGE_ARM64_HASH=$hash
}

# _arm64_wheels DIR REQUIREMENTS: the aarch64 wheels (manylinux, the base image's CPython) of REQUIREMENTS in
# DIR (build-deb.sh's arm64 wheel cache), from DIR alone when it has them all, else from the index.
_arm64_wheels() {
  local dir=$1 reqs=$2 py v=$NODEAGENT_BASE_IMAGE_PYTHON args minor
  py=$(_abi_python)
  args=(--only-binary=:all: --platform manylinux2014_aarch64 --implementation cp --python-version "$v"
    --abi "cp${v/./}" --abi abi3 --abi none --find-links "$dir" -d "$dir" -r "$reqs")
  for minor in $(seq 17 36); do args+=(--platform "manylinux_2_${minor}_aarch64"); done
  mkdir -p "$dir" || return 1
  "$py" -m pip download -q --disable-pip-version-check --no-index "${args[@]}" 2>/dev/null ||
    "$py" -m pip download -q --disable-pip-version-check "${args[@]}"
}

# _multiarch_bases: in the multi-arch storage, the Containerfile's BASE_IMAGE and BUILD_IMAGE for an arm64
# build, loaded from the base archives when missing: NODEAGENT_MULTIARCH_BASE_REF:arm64-<hash> the arm64 base,
# and NODEAGENT_MULTIARCH_BASE_REF:build-amd64-<hash> the amd64 base with "arm64" in its configuration.
# buildah 1.28 looks a local image up by the build's --platform even for a FROM --platform=$BUILDPLATFORM
# stage (an amd64 image is "not known" to an arm64 build); under that label the build stage still runs the
# amd64 programs natively, and BUILDARCH (amd64) still sends its pip down the cross-architecture path. Nothing
# of the build stage but /opt/nodeagent reaches the image.
_multiarch_bases() {
  local arm64=$NODEAGENT_MULTIARCH_BASE_REF:arm64-$NODEAGENT_BASE_IMAGE_ARM64_HASH
  local build=$NODEAGENT_MULTIARCH_BASE_REF:build-amd64-$NODEAGENT_BASE_IMAGE_HASH id c
  if ! _buildah_multiarch inspect --type image "$arm64" >/dev/null 2>&1; then
    id=$(_buildah_multiarch pull -q --arch arm64 "oci-archive:$NODEAGENT_BASE_IMAGE_ARM64") &&
      _buildah_multiarch tag "$id" "$arm64" && _buildah_multiarch rmi "$NODEAGENT_BASE_IMAGE_REF" >/dev/null || return 1
  fi
  if ! _buildah_multiarch inspect --type image "$build" >/dev/null 2>&1; then
    id=$(_buildah_multiarch pull -q "oci-archive:$NODEAGENT_BASE_IMAGE") && c=$(_buildah_multiarch from "$id") &&
      _buildah_multiarch config --arch arm64 "$c" && _buildah_multiarch commit -q --rm "$c" "$build" &&
      _buildah_multiarch rmi "$id" >/dev/null || return 1
  fi
}

# _agent_image_arm64_build OUT REPO: `buildah bud --platform linux/arm64` of packaging/kubernetes/Containerfile
# in the multi-arch storage, with its layers kept (the final stage's apt-get, emulated, is redone only when the
# base changes). pip asks no index: the wheelhouse of _agent_image_build (setuptools for the build of
# nodeagent's own wheel) and the aarch64 wheels beside it, both mounted read-only.
_agent_image_arm64_build() {
  local out=$1 repo=$2 py wheels=$NODEAGENT_CACHE/wheels
  py=$(_abi_python)
  mkdir -p "$wheels" || return 1
  "$py" -c 'import tomllib, sys; print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' \
    "$repo/pyproject.toml" >"$out.requirements" || return 1
  { "$py" -m pip wheel -q --disable-pip-version-check -w "$wheels" 'setuptools>=68' wheel &&
    _arm64_wheels "$wheels/arm64" "$out.requirements"; } || { rm -f "$out.requirements"; return 1; }
  rm -f "$out.requirements"
  _multiarch_bases || return 1
  (cd "$repo" && _buildah_multiarch bud --isolation chroot --pull-never --layers --platform linux/arm64 \
    --build-arg "BUILD_IMAGE=$NODEAGENT_MULTIARCH_BASE_REF:build-amd64-$NODEAGENT_BASE_IMAGE_HASH" \
    --build-arg "BASE_IMAGE=$NODEAGENT_MULTIARCH_BASE_REF:arm64-$NODEAGENT_BASE_IMAGE_ARM64_HASH" \
    -v "$wheels:/wheels:ro" --build-arg PIP_NO_INDEX=1 --build-arg "PIP_FIND_LINKS=/wheels /wheels/arm64" \
    -f packaging/kubernetes/Containerfile -t "$NODEAGENT_AGENT_IMAGE_REF-arm64" .) || return 1
  _buildah_multiarch push "$NODEAGENT_AGENT_IMAGE_REF-arm64" "oci-archive:$out:$NODEAGENT_AGENT_IMAGE_REF" || return 1
  # The newest image keeps its name, so its layers (the emulated apt-get among them) stay as the next build's
  # cache; the layers of older builds go once the storage passes 2 GiB (a prune also drops the build stage's
  # layers, which costs the next build its native apt-get, some 25 s).
  if [ "$(du -sm "$NODEAGENT_CACHE/buildah-multiarch/storage" | cut -f1)" -gt 2048 ]; then
    _buildah_multiarch rmi --prune >/dev/null || true
  fi
}

nodeagent_peers_agent_image_arm64() {
  nodeagent_peers_base_image || return 1
  nodeagent_peers_arm64_base_image || return 1
  local repo hash
  repo=$(cd "$NODEAGENT_TESTBIN/../.." && pwd)
  hash=$( (echo "$NODEAGENT_BASE_IMAGE_HASH $NODEAGENT_BASE_IMAGE_ARM64_HASH $NODEAGENT_AGENT_IMAGE_REF" &&
    echo "$NODEAGENT_BASE_IMAGE_PYTHON" && declare -f _agent_image_arm64_build _multiarch_bases _arm64_wheels &&
    _agent_image_inputs "$repo" | (cd "$repo" && xargs -d '\n' sha256sum)) | sha256sum | cut -c1-12) || return 1
  _image_into_cache nodeagent-arm64 "$hash" _agent_image_arm64_build "$repo" || return 1
  export NODEAGENT_AGENT_IMAGE_ARM64=$NODEAGENT_IMAGE_ARCHIVE
}

# _agent_image_index_build OUT: an OCI index (manifest list) of the amd64 and arm64 agent images, as
# `buildah build --platform linux/amd64,linux/arm64 --manifest` makes it, pushed with both images to OUT.
_agent_image_index_build() {
  local out=$1 list=$NODEAGENT_AGENT_MULTIARCH_REF a b
  _buildah_multiarch manifest rm "$list" >/dev/null 2>&1 || true
  a=$(_buildah_multiarch pull -q "oci-archive:$NODEAGENT_AGENT_IMAGE") &&
    b=$(_buildah_multiarch pull -q "oci-archive:$NODEAGENT_AGENT_IMAGE_ARM64") &&
    _buildah_multiarch manifest create "$list" &&
    _buildah_multiarch manifest add "$list" "containers-storage:$a" &&
    _buildah_multiarch manifest add "$list" "containers-storage:$b" &&
    _buildah_multiarch manifest push --all --format oci "$list" "oci-archive:$out:$list" || return 1
  _buildah_multiarch manifest rm "$list" >/dev/null 2>&1 || true
  # both pulls named their image NODEAGENT_AGENT_IMAGE_REF: the arm64 one keeps only the name of its build
  _buildah_multiarch rmi "$NODEAGENT_AGENT_IMAGE_REF" >/dev/null 2>&1 || true
  [ "$a" = "$b" ] || _buildah_multiarch rmi "$a" >/dev/null 2>&1 || true
}

nodeagent_peers_agent_image_multiarch() {
  nodeagent_peers_agent_image || return 1
  nodeagent_peers_agent_image_arm64 || return 1
  local hash
  hash=$( (echo "${NODEAGENT_AGENT_IMAGE##*/} ${NODEAGENT_AGENT_IMAGE_ARM64##*/} $NODEAGENT_AGENT_MULTIARCH_REF" &&
    declare -f _agent_image_index_build) | sha256sum | cut -c1-12) || return 1
  _image_into_cache nodeagent-multiarch "$hash" _agent_image_index_build || return 1
  export NODEAGENT_AGENT_IMAGE_MULTIARCH=$NODEAGENT_IMAGE_ARCHIVE
}

# NVIDIA's ComputeDomain CRD (resource.nvidia.com/v1beta1) exactly as its DRA driver ships it: the file of the
# driver's Helm chart, taken from the Go module of the release below (kubernetes-sigs/dra-driver-nvidia-gpu;
# Apache-2.0) and kept in the cache under that version. nodeagent does not ship a copy: users install NVIDIA's
# (docs/computedomains.md); the tests install this one.
NODEAGENT_CD_DRIVER_MODULE=sigs.k8s.io/dra-driver-nvidia-gpu
NODEAGENT_CD_DRIVER_VERSION=v0.5.0
nodeagent_peers_computedomain_crd() {
  local dir=$NODEAGENT_CACHE/crds/dra-driver-nvidia-gpu-$NODEAGENT_CD_DRIVER_VERSION out mod
  local file=$dir/resource.nvidia.com_computedomains.yaml
  if [ -n "${NODEAGENT_PEERS_PLAN:-}" ]; then
    _peers_log "plan: ComputeDomain CRD $([ -f "$file" ] && echo cached || echo to download)"
  elif [ ! -f "$file" ]; then
    out=$(cd "$NODEAGENT_CACHE" && GOFLAGS=-mod=mod go mod download -json \
      "$NODEAGENT_CD_DRIVER_MODULE@$NODEAGENT_CD_DRIVER_VERSION" 2>&1) || true
    mod=$(printf '%s\n' "$out" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p' | head -n 1)
    local src=$mod/deployments/helm/dra-driver-nvidia-gpu/crds/resource.nvidia.com_computedomains.yaml
    if [ -z "$mod" ] || [ ! -f "$src" ]; then
      _peers_log "cannot get the ComputeDomain CRD from $NODEAGENT_CD_DRIVER_MODULE@$NODEAGENT_CD_DRIVER_VERSION: $(printf '%s' "$out" | tail -n 2)"
      return 1
    fi
    mkdir -p "$dir" && cp "$src" "$file.tmp" && cp "$mod/LICENSE" "$dir/LICENSE" && mv "$file.tmp" "$file" ||
      return 1
  fi
  export NODEAGENT_COMPUTEDOMAIN_CRD=$file
}


# The wheels packaging/build-deb.sh puts into the .deb (every dependency for CPython 3.10-3.13, amd64 and arm64),
# fetched into its wheel cache here, so the tests that build the package never wait for the index.
nodeagent_peers_deb_wheels() {
  local repo arch
  repo=$(cd "$NODEAGENT_TESTBIN/../.." && pwd)
  if [ -n "${NODEAGENT_PEERS_PLAN:-}" ]; then
    _peers_log "plan: the package's wheels in $NODEAGENT_CACHE/wheels (fetched when a set is missing)"
    return 0
  fi
  for arch in amd64 arm64; do
    bash "$repo/packaging/build-deb.sh" --arch "$arch" --fetch-only || return 1
  done
}

# _peers_prefetch_modules: the Go modules of the builds the foreground reaches later (the v1.34 peers, the other
# releases, the CDI, helm and kubelet modules), downloaded in the background lane at its start, in the order the
# foreground needs them, so that a cold setup's compiles do not wait on the module proxy (about 20 s a release).
# `go list -deps` fetches exactly the modules of those packages; the module cache is safe for two go commands at
# once. Only a head start: a failure here is left for the build itself to report.
_peers_prefetch_modules() {
  local t=$NODEAGENT_TESTBIN minor
  local -a jobs=("$t/peers|go.mod||./cmd/..." "$t/dra-harness|go.mod||./cmd/dra-harness")
  for minor in 37 36 35; do
    jobs+=("$t/peers|go-1.$minor.mod||./cmd/..." "$t/dra-harness|go-1.$minor.mod|k8s1$minor|./cmd/dra-harness")
  done
  jobs+=("$t/cdi-check|go.mod||./..." "$t/helm|go.mod||helm.sh/helm/v3/cmd/helm" "$t/node|go.mod||./cmd/...")
  local job dir mf tags pkgs
  for job in "${jobs[@]}"; do
    IFS='|' read -r dir mf tags pkgs <<<"$job"
    (cd "$dir" && GOFLAGS=-mod=readonly nice -n 10 go list -deps -modfile="$mf" ${tags:+-tags="$tags"} $pkgs >/dev/null) ||
      _peers_log "could not fetch the modules of $dir ($mf) ahead; its build will"
  done
  return 0
}

# nodeagent_peers_setup: every peer the test suite uses, built (or found in the cache) BEFORE pytest
# starts, so no test ever waits for a build; the one entry point tests/run.sh relies on. Each step prints
# a progress line and its time. NODEAGENT_PEERS_READY=1 tells tests/peers/_resolve.py that every
# NODEAGENT_* variable the suite reads is set, so a missing one is an error there, never a build.
# With NODEAGENT_PEERS_PLAN=1 nothing is built or installed: each step resolves its inputs (module files,
# headers downloaded from the module proxy) and says whether its peer is cached or would be built.
NODEAGENT_PEERS_STEPS=(
  "containerd+runc (Debian):nodeagent_peers_containerd"
  "containerd 2:nodeagent_peers_containerd2"
  "kubelet device-manager harness:nodeagent_peers_harness"
  "etcd + kube-apiserver v1.34:nodeagent_peers_apiserver"
  "NVIDIA's ComputeDomain CRD (Go module proxy):nodeagent_peers_computedomain_crd"
  "kube-scheduler + kube-controller-manager v1.34:nodeagent_peers_kube_control_plane"
  "kubelet DRA harness v1.34:nodeagent_peers_dra_harness"
  "Kubernetes v1.37 peers:nodeagent_peers_k8s137"
  "Kubernetes v1.36 peers:nodeagent_peers_k8s136"
  "Kubernetes v1.35 peers:nodeagent_peers_k8s135"
  "CDI reference library + CRI helpers:nodeagent_peers_cdi_check"
  "NFD CRDs (Go module proxy):nodeagent_peers_nfd_crd"
  "helm + promtool (Debian):nodeagent_peers_helm"
  "the package's wheels (pip download, CPython 3.10-3.13):nodeagent_peers_deb_wheels"
  "NVML stand-in + go-nvml view + nvidia-ctk:nodeagent_peers_nvml_abi"
  "Debian 12 root booted by systemd (mmdebstrap, systemd-nspawn):nodeagent_peers_debian_root"
  "Debian 13 root with the test dependencies (mmdebstrap):nodeagent_peers_debian13_root"
  "Debian 12 arm64 root (the arm64 agent image's, qemu-user-static):nodeagent_peers_arm64_root"
  "kubelet + kubectl v1.34:nodeagent_peers_kubelet"
  "CNI plugins + buildah (Debian):nodeagent_peers_cluster_tools"
  "Debian base image (mmdebstrap, buildah):nodeagent_peers_base_image"
  "pause image (buildah):nodeagent_peers_pause_image"
  "nodeagent image (packaging/kubernetes/Containerfile, buildah):nodeagent_peers_agent_image"
  "Debian base image for arm64 (mmdebstrap, qemu-user-static, buildah):nodeagent_peers_arm64_base_image"
  "nodeagent arm64 image + amd64/arm64 index (buildah --platform):nodeagent_peers_agent_image_multiarch"
)

# Steps run in the background beside the others (not in plan mode, nor with NODEAGENT_PEERS_SERIAL=1): these
# spend their time on the network (pip's downloads, Debian's packages), on the disk (unpacking, buildah's layers)
# or in maintainer scripts run under qemu for arm64, while the steps in the foreground compile Go and keep both
# cores busy; overlapping them shortens a cold setup. They run one after the other, in this order (an image
# after its base, the wheels before the images that install them), in one background job (its log:
# ${NODEAGENT_CACHE}/logs/background-steps.log); once it has ended, each is run again in the foreground, in the
# order of NODEAGENT_PEERS_STEPS, where it finds its result in the cache and only exports its path. The pause
# image's program comes from the CDI module: whichever of the two lanes reaches it first builds it, the other
# waits on its lock.
# _peers_prefetch_modules, first, is no step of its own: it only gives the foreground's builds their modules.
NODEAGENT_PEERS_BACKGROUND=(_peers_prefetch_modules nodeagent_peers_deb_wheels nodeagent_peers_base_image
  nodeagent_peers_agent_image nodeagent_peers_pause_image nodeagent_peers_arm64_base_image
  nodeagent_peers_agent_image_multiarch nodeagent_peers_arm64_root nodeagent_peers_debian13_root
  nodeagent_peers_debian_root)
# Background steps that export nothing (the wheel cache is all they make): not run again in the foreground.
NODEAGENT_PEERS_BACKGROUND_ONLY=(nodeagent_peers_deb_wheels)
# Every Debian package a step installs, installed once before anything runs in the background (apt-get holds
# dpkg's lock: two steps must never install at the same time).
NODEAGENT_PEERS_DEBIAN_PACKAGES=(containerd runc openssl strace systemd util-linux dpkg gcc libc6-dev prometheus
  mmdebstrap systemd-container qemu-user-static arch-test containernetworking-plugins buildah iptables
  docker-registry)

# _peers_listed NAME ITEM...: whether NAME is one of the ITEMs.
_peers_listed() {
  local name=$1 f
  shift
  for f in "$@"; do [ "$f" = "$name" ] && return 0; done
  return 1
}

# _peers_kill_tree PID: PID and every process below it (a background mmdebstrap, its dpkg, qemu).
_peers_kill_tree() {
  local child
  for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do _peers_kill_tree "$child"; done
  kill "$1" 2>/dev/null || true
}

nodeagent_peers_setup() {
  local start=$SECONDS step n=0 t bg_pid="" bg_log="" deferred=()
  if [ -z "${NODEAGENT_PEERS_PLAN:-}" ] && [ -z "${NODEAGENT_PEERS_SERIAL:-}" ]; then
    _peers_install_debian "${NODEAGENT_PEERS_DEBIAN_PACKAGES[@]}" || return 1
    mkdir -p "$NODEAGENT_CACHE/logs" || return 1
    bg_log=$NODEAGENT_CACHE/logs/background-steps.log
    (
      set +e
      for f in "${NODEAGENT_PEERS_BACKGROUND[@]}"; do
        t=$SECONDS
        "$f" || { _peers_log "[background] $f failed"; exit 1; }
        _peers_log "[background] $f: $((SECONDS - t))s"
      done
    ) >"$bg_log" 2>&1 &
    bg_pid=$!
    _peers_log "the wheels, images and Debian roots are made in the background (log: $bg_log)"
  fi
  for step in "${NODEAGENT_PEERS_STEPS[@]}"; do
    n=$((n + 1))
    if [ -n "$bg_pid" ] && _peers_listed "${step##*:}" "${NODEAGENT_PEERS_BACKGROUND[@]}"; then
      deferred+=("$n:$step")
      continue
    fi
    t=$SECONDS
    _peers_log "[$n/${#NODEAGENT_PEERS_STEPS[@]}] ${step%%:*}"
    "${step##*:}" || {
      _peers_log "step '${step%%:*}' failed"
      [ -z "$bg_pid" ] || _peers_kill_tree "$bg_pid"
      return 1
    }
    _peers_log "[$n/${#NODEAGENT_PEERS_STEPS[@]}] ${step%%:*}: $((SECONDS - t))s"
  done
  if [ -n "$bg_pid" ]; then
    t=$SECONDS
    if ! wait "$bg_pid"; then
      _peers_log "the background steps failed; last lines of $bg_log:"
      tail -n 30 "$bg_log" >&2
      return 1
    fi
    _peers_log "waited $((SECONDS - t))s for the background steps; what they printed:"
    sed 's/^/  /' "$bg_log" >&2
    for step in "${deferred[@]}"; do
      n=${step%%:*}
      step=${step#*:}
      if _peers_listed "${step##*:}" "${NODEAGENT_PEERS_BACKGROUND_ONLY[@]}"; then
        _peers_log "[$n/${#NODEAGENT_PEERS_STEPS[@]}] ${step%%:*}: done in the background"
        continue
      fi
      t=$SECONDS
      _peers_log "[$n/${#NODEAGENT_PEERS_STEPS[@]}] ${step%%:*}"
      "${step##*:}" || { _peers_log "step '${step%%:*}' failed"; return 1; }
      _peers_log "[$n/${#NODEAGENT_PEERS_STEPS[@]}] ${step%%:*}: $((SECONDS - t))s"
    done
  fi
  [ -n "${NODEAGENT_PEERS_PLAN:-}" ] || export NODEAGENT_PEERS_READY=1
  _peers_log "ready in $((SECONDS - start))s"
}

if [ -n "${NODEAGENT_PEERS_LIB_ONLY:-}" ]; then
  : # only define the functions (for scripts that build one peer)
elif [ "${BASH_SOURCE[0]}" = "$0" ]; then
  # Executed rather than sourced.
  set -euo pipefail
  nodeagent_peers_setup
  env | grep '^NODEAGENT_' | sort
else
  nodeagent_peers_setup || return 1
fi
