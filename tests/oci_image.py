"""OCI image archives: a one-layer one written in Python (no registry, no build tool), for ``ctr images import``;
and the manifest and config of the one image an archive of the setup holds."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any


def _blob(tar: tarfile.TarFile, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
    return f"sha256:{digest}"


def write_image(archive: Path, ref: str, files: dict[str, tuple[bytes, int]], cmd: list[str]) -> str:
    """Write an OCI image layout archive holding ``files`` (path in the image -> (bytes, mode)) as one
    layer, tagged ``ref`` (``io.containerd.image.name``); returns the manifest digest."""
    layer_buf = io.BytesIO()
    with tarfile.open(fileobj=layer_buf, mode="w", format=tarfile.PAX_FORMAT) as layer:
        dirs: set[str] = set()
        for path in sorted(files):
            parts = path.strip("/").split("/")
            for i in range(1, len(parts)):
                d = "/".join(parts[:i])
                if d not in dirs:
                    dirs.add(d)
                    di = tarfile.TarInfo(d)
                    di.type = tarfile.DIRTYPE
                    di.mode = 0o755
                    layer.addfile(di)
            data, mode = files[path]
            fi = tarfile.TarInfo("/".join(parts))
            fi.size = len(data)
            fi.mode = mode
            layer.addfile(fi, io.BytesIO(data))
    layer_bytes = layer_buf.getvalue()
    layer_digest = "sha256:" + hashlib.sha256(layer_bytes).hexdigest()
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Cmd": cmd, "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    }
    with tarfile.open(archive, "w") as tar:
        layer_ref = _blob(tar, layer_bytes)
        config_bytes = json.dumps(config, sort_keys=True).encode()
        config_ref = _blob(tar, config_bytes)
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_ref,
                       "size": len(config_bytes)},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_ref,
                        "size": len(layer_bytes)}],
        }
        manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
        manifest_ref = _blob(tar, manifest_bytes)
        index = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [{
                "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifest_ref,
                "size": len(manifest_bytes), "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": ref},
            }],
        }
        for name, data in (("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'),
                           ("index.json", json.dumps(index, sort_keys=True).encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return manifest_ref


def archive_image(path: str | Path) -> tuple[Any, Any]:
    """(manifest, config) of the one image an OCI archive (``buildah push oci-archive:``) holds."""
    with tarfile.open(path) as tar:
        def blob(digest: str) -> Any:
            member = tar.extractfile(f"blobs/{digest.replace(':', '/', 1)}")
            assert member is not None, (path, digest)
            return json.load(member)

        member = tar.extractfile("index.json")
        assert member is not None, path
        (entry,) = json.load(member)["manifests"]
        manifest = blob(entry["digest"])
        return manifest, blob(manifest["config"]["digest"])
