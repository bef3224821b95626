"""The agent image for Grace nodes (aarch64): packaging/kubernetes/Containerfile built with
``--platform linux/arm64`` on this amd64 machine, and the OCI index that names it beside the amd64 image.

tests/testbin/setup.sh builds the three archives before pytest (step nodeagent_peers_agent_image_multiarch);
this test only reads them. Each image's root filesystem is unpacked from its layers into a temporary
directory and run as a chroot; the arm64 one's programs (Debian's python3, the wheels' extension modules)
are run by Debian's qemu-aarch64-static through binfmt_misc, as on tests/e2e/test_distros_chroot.py's arm64 root.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e._chroot import OverlayChroot

ELF_MACHINE = {b"\x3e\x00": "x86_64", b"\xb7\x00": "aarch64"}  # e_machine, little-endian
MACHINES = {"amd64": "x86_64", "arm64": "aarch64"}
ARCHIVES = {"amd64": "NODEAGENT_AGENT_IMAGE", "arm64": "NODEAGENT_AGENT_IMAGE_ARM64"}
MACHINE = "gb200-nvl"  # a Grace machine of the simulator
# the extension modules every start of the agent loads: grpc's core, psutil, PyYAML's libyaml binding
EXTENSIONS = ("grpc/_cython/cygrpc.*.so", "psutil/_psutil_linux*.so", "yaml/_yaml.*.so")
INDEX = "application/vnd.oci.image.index.v1+json"


def _archive(var: str) -> Path:
    value = os.environ.get(var, "")
    if not value or not Path(value).is_file():
        pytest.fail(f"{var} is not set or not a file ({value!r}); run `bash tests/testbin/setup.sh` "
                    "(step nodeagent_peers_agent_image_multiarch)", pytrace=False)
    return Path(value)


class Layout:
    """An OCI image layout archive (what `buildah push oci-archive:` writes), read in place."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self, name: str) -> bytes:
        with tarfile.open(self.path) as tar:
            member = tar.extractfile(name)
            assert member is not None, (self.path, name)
            return member.read()

    def size(self, digest: str) -> int:
        with tarfile.open(self.path) as tar:
            return tar.getmember(_blob_name(digest)).size

    def json(self, digest: str) -> Any:
        return json.loads(self.read(_blob_name(digest)))

    def index(self) -> Any:
        return json.loads(self.read("index.json"))

    def image(self) -> tuple[Any, Any]:
        """(manifest, config) of the one image the archive holds."""
        entries = self.index()["manifests"]
        assert len(entries) == 1, entries
        assert entries[0]["mediaType"] != INDEX, entries
        manifest = self.json(entries[0]["digest"])
        return manifest, self.json(manifest["config"]["digest"])

    def unpack(self, manifest: Any, dest: Path) -> None:
        """The image's root filesystem: its layers in order (GNU tar), whiteouts applied. A whiteout only
        names a file of the layers below it, so removing it and its target after the layer is unpacked is
        the same as before; an opaque directory (whose lower contents could no longer be told apart) fails."""
        dest.mkdir()
        with tarfile.open(self.path) as tar:
            for layer in manifest["layers"]:
                data = tar.extractfile(_blob_name(layer["digest"]))
                assert data is not None
                gzip = layer["mediaType"].endswith("+gzip")
                assert gzip or layer["mediaType"].endswith(".tar"), layer["mediaType"]
                proc = subprocess.Popen(["tar", "-x", *(["-z"] if gzip else []), "-f", "-", "-C", str(dest)],
                                        stdin=subprocess.PIPE)
                assert proc.stdin is not None
                shutil.copyfileobj(data, proc.stdin, 1 << 20)
                proc.stdin.close()
                assert proc.wait(timeout=300) == 0, layer
                found = subprocess.run(["find", str(dest), "-name", ".wh.*", "-print0"], capture_output=True,
                                       check=True, timeout=120).stdout
                for name in filter(None, found.decode().split("\0")):
                    marker = Path(name)
                    assert marker.name != ".wh..wh..opq", marker
                    _remove(marker.parent / marker.name[4:])
                    marker.unlink()


def _blob_name(digest: str) -> str:
    algo, hexa = digest.split(":", 1)
    return f"blobs/{algo}/{hexa}"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _elf_machine(path: Path) -> str:
    head = path.read_bytes()[:20]
    assert head[:4] == b"\x7fELF", path
    return ELF_MACHINE.get(head[18:20], head[18:20].hex())


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """Each agent image's root filesystem, unpacked once for the module."""
    base = tmp_path_factory.mktemp("agent-images")
    roots = {}
    for arch, var in ARCHIVES.items():
        layout = Layout(_archive(var))
        manifest, config = layout.image()
        assert (config["os"], config["architecture"]) == ("linux", arch), (var, config.get("architecture"))
        layout.unpack(manifest, base / arch)
        roots[arch] = base / arch
    yield roots
    subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=False, timeout=300)


def test_arm64_archive_is_an_arm64_image_of_the_containerfile() -> None:
    manifest, config = Layout(_archive("NODEAGENT_AGENT_IMAGE_ARM64")).image()
    assert config["architecture"] == "arm64" and config["os"] == "linux", config
    # the Containerfile's entrypoint and command, as in the amd64 image
    _, amd64 = Layout(_archive("NODEAGENT_AGENT_IMAGE")).image()
    assert config["config"]["Entrypoint"] == amd64["config"]["Entrypoint"] == ["/usr/local/bin/nodeagent-entrypoint"]
    assert config["config"]["Cmd"] == amd64["config"]["Cmd"] == ["run"]
    assert len(manifest["layers"]) == len(config["rootfs"]["diff_ids"]) >= 2


def test_extension_modules_are_of_the_image_architecture(rootfs: dict[str, Path]) -> None:
    for arch, root in rootfs.items():
        site = next(root.glob("opt/nodeagent/lib/python3*/site-packages"))
        for pattern in EXTENSIONS:
            found = sorted(site.glob(pattern))
            assert len(found) == 1, (arch, pattern, found)
            assert _elf_machine(found[0]) == MACHINES[arch], (arch, found[0])
        # the venv's interpreter is the image's own python3
        assert _elf_machine(_inside(root, "/opt/nodeagent/bin/python3")) == MACHINES[arch], arch


def test_images_hold_no_package_downloads_and_no_installer(rootfs: dict[str, Path]) -> None:
    """What the Containerfile leaves out, in each image: the .deb archives and package lists of the final stage's
    apt-get (removed in the RUN that installed them: the base image need not have Docker's apt-get clean hook),
    and the installers of the venv (pip and setuptools, whose scripts, modules and metadata nothing in the image
    uses: the agent never installs anything at run time)."""
    for arch, root in rootfs.items():
        assert not sorted((root / "var/cache/apt/archives").glob("*.deb")), arch
        assert not sorted((root / "var/cache/apt").glob("*.bin")), arch
        assert not [p.name for p in (root / "var/lib/apt/lists").glob("*") if p.name not in ("lock", "partial")], arch
        site = next(root.glob("opt/nodeagent/lib/python3*/site-packages"))
        installers = sorted(p.name for p in site.iterdir()
                            if p.name.split("-")[0].lower() in ("pip", "setuptools", "wheel", "_distutils_hack",
                                                                "pkg_resources", "distutils"))
        assert installers == [], (arch, installers)
        assert not sorted((root / "opt/nodeagent/bin").glob("pip*")), arch
        # what the agent does need is there: its own distribution and its dependencies' (grpc, the Kubernetes client)
        names = {p.name.split("-")[0].lower() for p in site.glob("*.dist-info")}
        assert {"nodeagent", "grpcio", "kubernetes", "protobuf"} <= names, (arch, sorted(names))


def test_venv_carries_the_bytecode_of_its_modules(rootfs: dict[str, Path]) -> None:
    """The agent starts from bytecode the image holds (compiled in the build, hash-based and never checked against
    the sources, which never change in the image; PYTHONDONTWRITEBYTECODE keeps a container from writing any):
    every module of nodeagent and of its dependencies has its .pyc, but for the Kubernetes client's generated API
    and model classes, compiled when first imported; the client's unused asyncio twin is not in the image."""
    for arch, root in rootfs.items():
        site = next(root.glob("opt/nodeagent/lib/python3*/site-packages"))
        tag = "cpython-" + site.parent.name.removeprefix("python").replace(".", "")
        missing, checked = [], []
        for source in sorted(site.rglob("*.py")):
            rel = source.relative_to(site).as_posix()
            if rel.startswith(("kubernetes/client/api/", "kubernetes/client/models/")):
                continue
            pyc = source.parent / "__pycache__" / f"{source.stem}.{tag}.pyc"
            if not pyc.is_file():
                missing.append(rel)
            elif int.from_bytes(pyc.read_bytes()[4:8], "little") != 0b01:  # flags: hash-based, unchecked
                checked.append(rel)
        assert not missing and not checked, (arch, missing[:20], checked[:20])
        assert (site / "nodeagent" / "__pycache__" / f"cli.{tag}.pyc").is_file(), arch
        assert not (site / "kubernetes" / "aio").exists(), arch
        assert not list((site / "kubernetes/client/models").glob("__pycache__")), arch


def _inside(root: Path, path: str) -> Path:
    """``path`` in the image with its symbolic links followed inside ``root`` (absolute ones included)."""
    current = Path("/")
    parts = list(Path(path).parts[1:])
    for _ in range(64):
        if not parts:
            return root / str(current).lstrip("/")
        candidate = current / parts.pop(0)
        on_host = root / str(candidate).lstrip("/")
        if on_host.is_symlink():
            target = Path(os.readlink(on_host))
            parts = list(target.parts[1:] if target.is_absolute() else target.parts) + parts
            current = Path("/") if target.is_absolute() else current
        else:
            current = candidate
    raise AssertionError(f"too many links under {path} in {root}")


def _run(root: OverlayChroot, *args: str) -> str:
    return root.run(list(args), timeout=600).stdout


def test_arm64_nodeagent_answers_as_the_amd64_one(rootfs: dict[str, Path], tmp_path: Path) -> None:
    binfmt = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
    if not binfmt.exists() or "enabled" not in binfmt.read_text():
        pytest.fail("aarch64 programs have no binfmt_misc entry: run tests/testbin/setup.sh "
                    "(step nodeagent_peers_arm64_base_image registers qemu-user-static's)", pytrace=False)
    answers: dict[str, tuple[str, str, str]] = {}
    for arch, lower in rootfs.items():
        root = OverlayChroot(lower, tmp_path / arch)
        try:
            machine = _run(root, "/opt/nodeagent/bin/python3", "-c",
                           "import platform, grpc._cython.cygrpc, psutil, yaml._yaml; print(platform.machine())")
            assert machine.strip() == MACHINES[arch], (arch, machine)
            answers[arch] = (
                _run(root, "/opt/nodeagent/bin/nodeagent", "--version"),
                _run(root, "/opt/nodeagent/bin/nodeagent", "discover", "--simulate", MACHINE, "--json"),
                _run(root, "/opt/nodeagent/bin/nodeagent", "discover", "--simulate", MACHINE, "--topology"),
            )
        finally:
            root.close()
    assert answers["arm64"][0].strip().startswith("nodeagent, version "), answers["arm64"][0]
    inventory = json.loads(answers["arm64"][1])
    assert inventory["gpus"], inventory
    assert answers["arm64"] == answers["amd64"]


def test_index_names_both_platforms_with_their_images() -> None:
    layout = Layout(_archive("NODEAGENT_AGENT_IMAGE_MULTIARCH"))
    top = layout.index()["manifests"]
    assert len(top) == 1 and top[0]["mediaType"] == INDEX, top
    entries = layout.json(top[0]["digest"])["manifests"]
    platforms = {(e["platform"]["os"], e["platform"]["architecture"]): e for e in entries}
    assert set(platforms) == {("linux", "amd64"), ("linux", "arm64")}, entries
    for arch, var in ARCHIVES.items():
        manifest = layout.json(platforms["linux", arch]["digest"])
        config = layout.json(manifest["config"]["digest"])
        assert config["architecture"] == arch
        # the same file system layers as the image built for that platform
        _, single = Layout(_archive(var)).image()
        assert config["rootfs"]["diff_ids"] == single["rootfs"]["diff_ids"], arch
        for layer in manifest["layers"]:
            assert layout.size(layer["digest"]) == layer["size"], layer
