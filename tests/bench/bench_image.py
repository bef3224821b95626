"""The agent's image: what packaging/kubernetes/Containerfile built for amd64 and arm64 weighs unpacked (its
layers' file systems, as containerd's snapshots hold them) and compressed (what a node pulls), layer by layer,
where the bytes are, and the OCI archives the setup keeps; with ``--start N``, the agent's start in the amd64
image with and without the bytecode of its venv.

Run (after `source tests/testbin/setup.sh`, for the archives): .venv/bin/python tests/bench/bench_image.py
[--start N]. Reads $NODEAGENT_AGENT_IMAGE, $NODEAGENT_AGENT_IMAGE_ARM64 and $NODEAGENT_AGENT_IMAGE_MULTIARCH.
"unpacked" is the sum of the layers' uncompressed tar streams (what `buildah images` and containerd count);
"files" the bytes of the regular files in them. ``--start`` unpacks the amd64 image, runs it as a chroot (root
needed) and times N runs of the agent's imports (the modules ``nodeagent run`` loads: the CLI, the daemon,
the Kubernetes client, the device plugin's server, the metrics) as the image is, then with the venv's
``__pycache__`` removed or added (``compileall``), whichever the image lacks; PYTHONDONTWRITEBYTECODE=1 as in
the image, so no run leaves bytecode for the next. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import zlib
from collections import Counter
from pathlib import Path
from typing import IO, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MIB = 1 << 20
ARCHIVES = {"amd64": "NODEAGENT_AGENT_IMAGE", "arm64": "NODEAGENT_AGENT_IMAGE_ARM64",
            "multiarch": "NODEAGENT_AGENT_IMAGE_MULTIARCH"}
IMPORTS = ("nodeagent.cli", "nodeagent.daemon", "nodeagent.kube.client", "nodeagent.deviceplugin.server",
           "nodeagent.metrics")


def _archive(var: str) -> Path:
    value = os.environ.get(var, "")
    if not Path(value).is_file():
        raise SystemExit(f"{var} is not set or not a file ({value!r}): source tests/testbin/setup.sh first")
    return Path(value)


class _Counting:
    """A file-like reader over a gzip (or plain) layer that counts the uncompressed bytes read."""

    def __init__(self, raw: IO[bytes], gzip: bool) -> None:
        self.raw = raw
        self.inflate = zlib.decompressobj(16 + zlib.MAX_WBITS) if gzip else None
        self.buffer = b""
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        while size < 0 or len(self.buffer) < size:
            chunk = self.raw.read(1 << 20)
            if not chunk:
                if self.inflate is not None:
                    self.buffer += self.inflate.flush()
                break
            self.buffer += self.inflate.decompress(chunk) if self.inflate is not None else chunk
        if size < 0:
            out, self.buffer = self.buffer, b""
        else:
            out, self.buffer = self.buffer[:size], self.buffer[size:]
        self.count += len(out)
        return out


def _where(name: str) -> str:
    """The place a file's bytes are counted under: a site-packages distribution, else two path components."""
    parts = name.lstrip("./").split("/")
    if "site-packages" in parts:
        i = parts.index("site-packages")
        top = parts[i + 1] if len(parts) > i + 1 else ""
        return "/opt/nodeagent/.../site-packages/" + top.split("-")[0]
    return "/" + "/".join(parts[:2])


def image_figures(path: Path) -> dict[str, Any]:
    """The one image of an OCI archive: sizes per layer, totals, and the largest places."""
    places: Counter[str] = Counter()
    layers = []
    with tarfile.open(path) as tar:
        def blob(digest: str) -> IO[bytes]:
            member = tar.extractfile(f"blobs/{digest.replace(':', '/', 1)}")
            assert member is not None, digest
            return member

        top = tar.extractfile("index.json")
        assert top is not None, path
        (entry,) = json.load(top)["manifests"]
        manifest = json.load(blob(entry["digest"]))
        config = json.load(blob(manifest["config"]["digest"]))
        history = [h.get("created_by", "") for h in config.get("history", []) if not h.get("empty_layer")]
        for i, layer in enumerate(manifest["layers"]):
            reader = _Counting(blob(layer["digest"]), layer["mediaType"].endswith("+gzip"))
            files = 0
            with tarfile.open(fileobj=reader, mode="r|") as stream:  # type: ignore[call-overload]
                for member in stream:
                    if member.isfile():
                        files += member.size
                        places[_where(member.name)] += member.size
            reader.read()  # the tar's end padding
            step = history[i] if i < len(history) else ""
            layers.append({"compressed_mib": round(layer["size"] / MIB, 1),
                           "unpacked_mib": round(reader.count / MIB, 1), "files_mib": round(files / MIB, 1),
                           "step": " ".join(step.split())[:90]})
    return {
        "architecture": config["architecture"],
        "unpacked_mib": round(sum(layer["unpacked_mib"] for layer in layers), 1),
        "files_mib": round(sum(layer["files_mib"] for layer in layers), 1),
        "compressed_mib": round(sum(layer["compressed_mib"] for layer in layers), 1),
        "layers": layers,
        "largest": [(place, round(size / MIB, 1)) for place, size in places.most_common(12)],
    }


def start_figures(path: Path, rounds: int) -> dict[str, Any]:
    """The agent's imports in the amd64 image, timed as built and with the venv's bytecode the other way."""
    from tests.e2e._chroot import OverlayChroot
    from tests.e2e.test_agent_image_multiarch import Layout

    tmp = Path(tempfile.mkdtemp(prefix="bench-image-"))
    try:
        layout = Layout(path)
        manifest, _ = layout.image()
        layout.unpack(manifest, tmp / "rootfs")
        venv = tmp / "rootfs/opt/nodeagent"
        pyc = sum(1 for _ in venv.rglob("*.pyc"))
        code = ("import time; t = time.perf_counter(); import " + ", ".join(IMPORTS)
                + "; print(time.perf_counter() - t)")
        env = {"PYTHONDONTWRITEBYTECODE": "1"}
        out: dict[str, Any] = {"venv_pyc_files_as_built": pyc}
        with OverlayChroot(tmp / "rootfs", tmp / "overlay") as root:
            def timed() -> list[float]:
                root.run(["/opt/nodeagent/bin/python3", "-c", code], env=env)  # warm the page cache
                return [float(root.run(["/opt/nodeagent/bin/python3", "-c", code], env=env).stdout)
                        for _ in range(rounds)]

            as_built = timed()
            if pyc:
                root.run(["find", "/opt/nodeagent", "-name", "__pycache__", "-prune", "-exec", "rm", "-rf", "{}", "+"])
                other, label = timed(), "without_venv_pyc"
            else:
                root.run(["/opt/nodeagent/bin/python3", "-m", "compileall", "-q", "-j0", "/opt/nodeagent/lib"])
                other, label = timed(), "with_venv_pyc"
        out["imports_s_as_built"] = round(statistics.median(as_built), 3)
        out[f"imports_s_{label}"] = round(statistics.median(other), 3)
        out["imports_s_runs"] = {"as_built": [round(x, 3) for x in as_built], label: [round(x, 3) for x in other]}
        return out
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(tmp)], check=False, timeout=300)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", type=int, default=0, metavar="N", help="time N runs of the agent's imports")
    args = ap.parse_args()
    figures: dict[str, Any] = {}
    for arch in ("amd64", "arm64"):
        path = _archive(ARCHIVES[arch])
        image = image_figures(path)
        assert image["architecture"] == arch, (path, image["architecture"])
        figures[arch] = image
        print(f"{arch}: unpacked {image['unpacked_mib']} MiB (files {image['files_mib']} MiB), "
              f"compressed {image['compressed_mib']} MiB, archive {path.stat().st_size / MIB:.1f} MiB")
        for layer in image["layers"]:
            print(f"  {layer['unpacked_mib']:7.1f} MiB unpacked {layer['compressed_mib']:7.1f} MiB compressed  "
                  f"{layer['step']}")
        for place, size in image["largest"]:
            print(f"  {size:7.1f} MiB  {place}")
    figures["archive_mib"] = {arch: round(_archive(var).stat().st_size / MIB, 1) for arch, var in ARCHIVES.items()}
    print(f"archives (MiB): {figures['archive_mib']}")
    if args.start:
        figures["start"] = start_figures(_archive(ARCHIVES["amd64"]), args.start)
        for k, v in figures["start"].items():
            print(f"{k:34} {v}")
    summary = {"bench": "image", "amd64_unpacked_mib": figures["amd64"]["unpacked_mib"],
               "arm64_unpacked_mib": figures["arm64"]["unpacked_mib"],
               "amd64_compressed_mib": figures["amd64"]["compressed_mib"],
               "arm64_compressed_mib": figures["arm64"]["compressed_mib"], **figures}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
