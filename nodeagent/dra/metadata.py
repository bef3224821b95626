"""DRA device metadata (KEP-5304): what a container can read about the devices of its claim.

For every request of a prepared claim the driver writes a ``DeviceMetadata`` file on the host and a CDI spec
that bind-mounts it read-only into the container, at the place the released ``k8s.io/dynamic-resource-
allocation`` library (``api/metadata``) puts it:

- a claim named in the pod: ``/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim>/<request>/
  <driver>-metadata.json``;
- a claim made from a template: ``…/resourceclaimtemplates/<pod claim name>/<request>/<driver>-metadata.json``
  (the pod claim name is the claim's ``resource.kubernetes.io/pod-claim-name`` annotation).

``<request>`` is the base request (a prioritized list's ``<request>/<subrequest>`` is cut at the slash; the
file records the full name). The host file is ``<plugin data dir>/dra-device-metadata/<namespace>_<claim>/
<request>/metadata.json`` (the plugin data dir is ``<kubelet>/plugins/<driver>``); the CDI spec is
``<cdi dir>/<driver>_metadata_<claim uid>_<request>.json`` (kind ``<driver>/metadata``, one device
``<claim uid>_<request>``), and its fully-qualified name goes into the CDI IDs of the request's first device.

The file is a stream of the same object once per API version, newest first (``v1beta1`` then ``v1alpha1``),
one per line-separated JSON document, so a reader of either release finds its version. ``metadata.generation``
starts at 1 and goes up by one each time the content changes (a device's attributes changed under a prepared
claim); a rewrite with unchanged content keeps the file as it is.

Each device carries the attributes it is published with in the ResourceSlice (UUID, product name,
architecture, compute capability, driver and CUDA versions, PCI bus id, PCIe root, NUMA node, and for a MIG
device its profile and placement), its UUID once a dynamic MIG device has its instance, its memory in bytes
(``memory``) and, for one allocation of a shared GPU, the share (``shareID``, its ``memory`` and
``computeShare`` in percent).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodeagent import fileio
from nodeagent.dra.devices import MEMORY_CAPACITY, DraDevice
from nodeagent.dra.quantity import quantity_int

API_GROUP = "metadata.resource.k8s.io"
VERSIONS = ("v1beta1", "v1alpha1")  # newest first, as the library writes a stream of several
KIND = "DeviceMetadata"
CONTAINER_DIR = "/var/run/kubernetes.io/dra-device-attributes"
CLAIMS_SUBDIR = "resourceclaims"
TEMPLATES_SUBDIR = "resourceclaimtemplates"
POD_CLAIM_ANNOTATION = "resource.kubernetes.io/pod-claim-name"
DATA_SUBDIR = "dra-device-metadata"
FILE_NAME = "metadata.json"
CDI_VERSION = "0.5.0"  # the lowest that has everything used (a mount)
MOUNT_OPTIONS = ("ro", "bind")

_DNS_LABEL = re.compile(r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?")
_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*")


class MetadataError(ValueError):
    """A name that cannot become a metadata path (the claim is refused with it)."""


def base_request(request: str) -> str:
    """``gpu/large`` → ``gpu``; a request name without subrequest is its own base."""
    return request.split("/", 1)[0]


def _label(value: str, what: str) -> str:
    if len(value) > 63 or not _DNS_LABEL.fullmatch(value):
        raise MetadataError(f"{what} {value[:70]!r} is not a DNS label, so it cannot name a device metadata file")
    return value


def pod_claim_name(claim: Mapping[str, Any]) -> str | None:
    """The pod claim name a claim made from a template carries (None for a claim named in the pod)."""
    annotations = (claim.get("metadata") or {}).get("annotations") or {}
    value = annotations.get(POD_CLAIM_ANNOTATION) if isinstance(annotations, Mapping) else None
    if value is None or value == "":
        return None
    return _label(str(value), f"annotation {POD_CLAIM_ANNOTATION}")


def container_path(driver: str, claim: str, request: str, pod_claim: str | None) -> str:
    """Where the container finds the metadata of ``request`` (a base request name)."""
    if pod_claim:
        return f"{CONTAINER_DIR}/{TEMPLATES_SUBDIR}/{pod_claim}/{request}/{driver}-metadata.json"
    return f"{CONTAINER_DIR}/{CLAIMS_SUBDIR}/{claim}/{request}/{driver}-metadata.json"


def cdi_device_name(claim_uid: str, request: str) -> str:
    return f"{claim_uid}_{request}"


def cdi_device_id(driver: str, claim_uid: str, request: str) -> str:
    return f"{driver}/metadata={cdi_device_name(claim_uid, request)}"


def device_attributes(dev: DraDevice) -> dict[str, Any]:
    """What the metadata says of one prepared device (API attribute form)."""
    attrs: dict[str, Any] = dict(dev.attributes)
    if dev.uuid:
        attrs["uuid"] = {"string": dev.uuid}
    memory = dev.capacity.get(MEMORY_CAPACITY, {}).get("value")
    if memory is not None:
        attrs["memory"] = {"int": quantity_int(str(memory))}
    if dev.share is not None:
        attrs["shareID"] = {"string": dev.share.share_id}
        attrs["memory"] = {"int": dev.share.memory_bytes}
        attrs["computeShare"] = {"int": dev.share.compute_percent}
    return dict(sorted(attrs.items()))


@dataclass(frozen=True)
class RequestDevices:
    """The devices prepared for one request: its full name (with a subrequest) and (pool, device) pairs."""

    name: str
    devices: tuple[tuple[str, DraDevice], ...]


def document(driver: str, version: str, namespace: str, claim: str, uid: str, generation: int,
             pod_claim: str | None, request: RequestDevices) -> dict[str, Any]:
    """One ``DeviceMetadata`` object (pure)."""
    doc: dict[str, Any] = {
        "kind": KIND,
        "apiVersion": f"{API_GROUP}/{version}",
        "metadata": {"name": claim, "namespace": namespace, "uid": uid, "generation": generation},
    }
    if pod_claim:
        doc["podClaimName"] = pod_claim
    doc["requests"] = [{
        "name": request.name,
        "devices": [{"driver": driver, "pool": pool, "name": dev.name, "attributes": device_attributes(dev)}
                    for pool, dev in request.devices],
    }]
    return doc


def stream(driver: str, namespace: str, claim: str, uid: str, generation: int, pod_claim: str | None,
           request: RequestDevices) -> str:
    """The file's text: the object once per version, newest first, each on its own indented document."""
    return "".join(json.dumps(document(driver, v, namespace, claim, uid, generation, pod_claim, request),
                              indent=2) + "\n" for v in VERSIONS)


def first_generation(text: str) -> tuple[int, str] | None:
    """The generation of the stream's first object and the stream with every generation set to 0 (what
    content is compared by); None when the text is no such stream."""
    try:
        docs = [json.loads(part) for part in _split(text)]
        generation = int(docs[0]["metadata"]["generation"])
        for d in docs:
            d["metadata"]["generation"] = 0
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    return generation, json.dumps(docs, sort_keys=True)


def _split(text: str) -> list[str]:
    decoder = json.JSONDecoder()
    out: list[str] = []
    i = 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return out
        _, end = decoder.raw_decode(text, i)
        out.append(text[i:end])
        i = end


def group_requests(devices: Sequence[tuple[Sequence[str], str, DraDevice]]) -> dict[str, RequestDevices]:
    """Base request → the request's devices, from (request names, pool, device) of each prepared device, in
    order; the first full request name seen for a base is the one recorded."""
    out: dict[str, RequestDevices] = {}
    for requests, pool, dev in devices:
        for r in requests:
            base = _label(base_request(r), "request name")
            old = out.get(base)
            if old is None:
                out[base] = RequestDevices(r, ((pool, dev),))
            elif (pool, dev) not in old.devices:
                out[base] = RequestDevices(old.name, (*old.devices, (pool, dev)))
    return out


class ClaimMetadata:
    """The metadata files and their CDI specs of one driver: host files under ``data_dir``
    (``<kubelet>/plugins/<driver>/dra-device-metadata`` under the root), specs in ``cdi_dir``. ``published``
    turns a path under the root into the host path the container runtime mounts from."""

    def __init__(self, driver: str, data_dir: Path, cdi_dir: Path, *, root: fileio.Root | None = None,
                 published: Callable[[Path], str] = str) -> None:
        self.driver = driver
        self.data_dir = data_dir
        self.cdi_dir = cdi_dir
        self.root = root
        self.published = published

    def _check(self, namespace: str, claim: str, uid: str) -> None:
        if not _UID.fullmatch(uid) or len(uid) > 128:
            raise MetadataError(f"claim UID {uid[:70]!r} cannot name a device metadata CDI spec")
        if "/" in namespace or "/" in claim or claim in ("", ".", "..") or namespace in ("", ".", ".."):
            raise MetadataError(f"claim {namespace[:70]}/{claim[:70]} cannot name a device metadata directory")

    def claim_dir(self, namespace: str, claim: str) -> Path:
        return self.data_dir / f"{namespace}_{claim}"

    def file(self, namespace: str, claim: str, request: str) -> Path:
        return self.claim_dir(namespace, claim) / request / FILE_NAME

    def spec_file(self, uid: str, request: str) -> Path:
        return self.cdi_dir / f"{self.driver}_metadata_{uid}_{request}.json"

    def cdi_ids(self, uid: str, requests: Sequence[str]) -> dict[str, str]:
        """Base request → its metadata CDI ID, for each request (full names) of a claim."""
        out: dict[str, str] = {}
        for r in requests:
            base = _label(base_request(r), "request name")
            out.setdefault(base, cdi_device_id(self.driver, uid, base))
        return out

    def spec(self, namespace: str, claim: str, uid: str, request: str, pod_claim: str | None) -> dict[str, Any]:
        """The CDI spec that mounts one request's file (pure apart from ``published``)."""
        return {
            "cdiVersion": CDI_VERSION,
            "kind": f"{self.driver}/metadata",
            "devices": [{
                "name": cdi_device_name(uid, request),
                "containerEdits": {"mounts": [{
                    "hostPath": self.published(self.file(namespace, claim, request)),
                    "containerPath": container_path(self.driver, claim, request, pod_claim),
                    "options": list(MOUNT_OPTIONS),
                }]},
            }],
        }

    def _read(self, path: Path) -> str | None:
        try:
            return fileio.read_text(path, root=self.root)
        except (OSError, fileio.UnreadableFileError):
            return None

    def write(self, namespace: str, claim: str, uid: str, pod_claim: str | None,
              requests: Mapping[str, RequestDevices]) -> list[str]:
        """Write (or bring up to date) the file and the CDI spec of every request; the base requests whose
        file or spec was written (new, missing, or changed: a changed content raises the generation)."""
        self._check(namespace, claim, uid)
        changed: list[str] = []
        for base, req in requests.items():
            path = self.file(namespace, claim, base)
            old = self._read(path)
            previous = first_generation(old) if old is not None else None
            text = stream(self.driver, namespace, claim, uid, 1, pod_claim, req)
            if previous is not None:
                generation, content = previous
                fresh = first_generation(text)
                assert fresh is not None
                if content != fresh[1]:
                    text = stream(self.driver, namespace, claim, uid, generation + 1, pod_claim, req)
                else:
                    text = old or text
            if text != old:
                fileio.atomic_write(path, text, mode=0o644, backup=False, durable=False, root=self.root,
                                    parents=True)
                changed.append(base)
            spec = json.dumps(self.spec(namespace, claim, uid, base, pod_claim), indent=2) + "\n"
            spec_path = self.spec_file(uid, base)
            if self._read(spec_path) != spec:
                fileio.atomic_write(spec_path, spec, mode=0o644, backup=False, durable=False, root=self.root,
                                    parents=True)
                if base not in changed:
                    changed.append(base)
        return changed

    def generation(self, namespace: str, claim: str, request: str) -> int | None:
        text = self._read(self.file(namespace, claim, request))
        found = first_generation(text) if text is not None else None
        return found[0] if found is not None else None

    def remove(self, namespace: str, claim: str, uid: str) -> bool:
        """Remove the claim's files and CDI specs (nothing there: nothing done); whether anything went."""
        removed = False
        for base in self._spec_requests(uid):
            removed |= fileio.remove(self.spec_file(uid, base), durable=False, root=self.root)
        if "/" not in namespace and "/" not in claim and claim not in ("", ".", ".."):
            removed |= fileio.remove_tree(self.claim_dir(namespace, claim), root=self.root)
        return removed

    def _spec_requests(self, uid: str) -> list[str]:
        prefix = f"{self.driver}_metadata_{uid}_"
        return sorted(name[len(prefix):-len(".json")] for name in self._spec_names() if name.startswith(prefix))

    def _spec_names(self) -> list[str]:
        directory = self.cdi_dir if self.root is None else self.root.within(self.cdi_dir)
        if not directory.is_dir():
            return []
        return [p.name for p in directory.glob(f"{self.driver}_metadata_*.json")]

    def claim_uids(self) -> set[str]:
        """The claims that have a metadata CDI spec here (UIDs contain no underscore)."""
        prefix = f"{self.driver}_metadata_"
        return {name[len(prefix):].split("_", 1)[0] for name in self._spec_names()}

    def claim_dirs(self) -> set[str]:
        """``<namespace>_<claim>`` of every claim directory under the data directory."""
        directory = self.data_dir if self.root is None else self.root.within(self.data_dir)
        if not directory.is_dir():
            return set()
        return {p.name for p in directory.iterdir() if p.is_dir() and not p.is_symlink()}

    def remove_orphans(self, uids: set[str], dirs: set[str]) -> list[str]:
        """Remove the specs of claims not in ``uids`` and the directories not in ``dirs``; what went."""
        done: list[str] = []
        for uid in sorted(self.claim_uids() - uids):
            for base in self._spec_requests(uid):
                fileio.remove(self.spec_file(uid, base), durable=False, root=self.root)
            done.append(f"removed the orphaned device metadata CDI specs of claim {uid}")
        for name in sorted(self.claim_dirs() - dirs):
            fileio.remove_tree(self.data_dir / name, root=self.root)
            done.append(f"removed the orphaned device metadata of {name}")
        return done
