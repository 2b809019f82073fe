"""DRA devices to NVML GPUs: which GPU a ResourceClaim's device is.

The kubelet's PodResources listing names a device a pod got through Dynamic Resource Allocation
(a ResourceClaim, ``resource.k8s.io/v1``) by its driver, pool and device name
(``ClaimResource``), never by GPU UUID. :class:`DraResolver` turns that triple into the GPU or
MIG UUID the agent governs, in this order:

1. the device's ``uuid`` attribute in the node's ResourceSlices: NVIDIA's GPU DRA driver
   (github.com/NVIDIA/k8s-dra-driver-gpu, ``cmd/gpu-kubelet-plugin/deviceinfo.go``,
   ``GetDevice``) publishes every GPU and MIG device with the string attribute ``uuid``, the
   NVML UUID; a fully qualified ``<driver>/uuid`` is read the same way;
2. else, for a driver the user named (``RLENERGY_AGENT_DRA_INDEX_DRIVERS``, chart value
   ``agent.draIndexDrivers``; empty by default), the device name's trailing number taken as
   the GPU's NVML index: NVIDIA's driver names whole GPUs ``gpu-<index>``, Kubernetes' DRA test
   driver ``device-<NN>`` (:data:`INDEX_NAME`). Only names of one word and one number match, so
   a MIG device (``gpu-0-mig-9-4-3``) never does.

A device neither way maps is not a GPU of this agent (a NIC, another vendor's device): it
attributes nothing. Pure apart from the slice lister the caller passes in; the agent's is
``rlenergy_agent.kube.NodeResourceSlices``. Callers: ``rlenergy_agent.podmap``.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

UUID_ATTRIBUTE = "uuid"
"""The ResourceSlice device attribute holding the NVML UUID (NVIDIA k8s-dra-driver-gpu,
``cmd/gpu-kubelet-plugin/deviceinfo.go``)."""
INDEX_NAME = re.compile(r"^[A-Za-z][A-Za-z_]*-0*(\d+)$")
"""A device name ``<word>-<number>`` whose number is the GPU's NVML index (``gpu-3``,
``device-03``)."""
RELIST_S = 10.0
"""A device the last slice listing did not know has the node's slices listed again at most
this often, s (a driver publishes its slice after the kubelet plugin registers)."""
MAX_AGE_S = 300.0
"""The slice listing is made again at least this often, s (a driver that restarted may have
published other devices under the same names)."""


@dataclasses.dataclass(frozen=True)
class DraDevice:
    """One device of a prepared ResourceClaim, as PodResources' ``ClaimResource`` names it."""

    driver: str
    pool: str
    device: str

    def __str__(self) -> str:
        return f"{self.driver}/{self.pool}/{self.device}"


def parse_drivers(value: str | Sequence[str]) -> tuple[str, ...]:
    """Driver names from ``"a,b"`` (the environment) or a sequence; blanks dropped."""
    items = value.split(",") if isinstance(value, str) else value
    return tuple(dict.fromkeys(s.strip() for s in items if s.strip()))


def index_of(device_name: str) -> int | None:
    """The NVML index a device name ends in (:data:`INDEX_NAME`), or None."""
    m = INDEX_NAME.match(device_name)
    return int(m.group(1)) if m else None


def _string_attribute(attrs: Mapping[str, Any], driver: str) -> str | None:
    for key in (UUID_ATTRIBUTE, f"{driver}/{UUID_ATTRIBUTE}"):
        value = attrs.get(key)
        if isinstance(value, Mapping) and isinstance(value.get("string"), str):
            return str(value["string"])
    return None


def uuids_in_slices(slices: Iterable[Mapping[str, Any]]) -> dict[DraDevice, str]:
    """``{device: uuid}`` for every device of ``slices`` with a string ``uuid`` attribute.

    Args:
        slices: ResourceSlice objects as the API server's JSON (``resource.k8s.io/v1``:
            ``spec.driver``, ``spec.pool.name``, ``spec.devices[].name`` and
            ``.attributes{name: {"string": ...}}``).
    """
    out: dict[DraDevice, str] = {}
    for s in slices:
        spec = s.get("spec") or {}
        driver = str(spec.get("driver") or "")
        pool = str((spec.get("pool") or {}).get("name") or "")
        for dev in spec.get("devices") or ():
            if not isinstance(dev, Mapping):
                continue
            uuid = _string_attribute(dev.get("attributes") or {}, driver)
            if uuid:
                out[DraDevice(driver, pool, str(dev.get("name") or ""))] = uuid
    return out


class DraResolver:
    """Maps DRA devices to GPU or MIG UUIDs (module docstring: the two ways, in order).

    The node's ResourceSlices are listed only when a listed pod holds a DRA device: the first
    time, when a device is not in the last listing (at most every ``relist_s``), and when the
    listing is older than ``max_age_s``. A failed listing (no ``resource.k8s.io/v1`` on the API
    server, no RBAC) is logged once per kind of failure and leaves the index rule; a successful
    one is logged the first time and when the count of devices with a ``uuid`` changes.

    Args:
        list_slices: returns this node's ResourceSlices (API JSON), or None for no API
            (local runs: the index rule only).
        index_uuids: NVML index -> GPU UUID of this node's GPUs.
        index_drivers: drivers whose device names end in the GPU's NVML index.
        relist_s: shortest interval between listings for an unknown device, s.
        max_age_s: longest a listing is used, s.
        clock: monotonic time, s.
    """

    def __init__(
        self,
        list_slices: Callable[[], Sequence[Mapping[str, Any]]] | None,
        index_uuids: Mapping[int, str],
        index_drivers: Sequence[str] = (),
        *,
        relist_s: float = RELIST_S,
        max_age_s: float = MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._list_slices = list_slices
        self.index_uuids = dict(index_uuids)
        self.index_drivers = frozenset(parse_drivers(index_drivers))
        self._relist_s = relist_s
        self._max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._uuids: dict[DraDevice, str] = {}
        self._listed_at: float | None = None
        self._last_error = ""
        self.listings = 0
        """Successful ResourceSlice listings."""
        self.errors = 0
        """Failed ResourceSlice listings."""

    def _relist(self) -> None:
        assert self._list_slices is not None
        self._listed_at = self._clock()
        try:
            found = uuids_in_slices(self._list_slices())
        except Exception as exc:  # noqa: BLE001 - any API failure: index rule only, retried
            self.errors += 1
            kind = type(exc).__name__
            if kind != self._last_error:
                log.warning("listing this node's ResourceSlices failed (%s): %s", kind, exc)
            self._last_error = kind
            return
        if self.listings == 0 or len(found) != len(self._uuids) or self._last_error:
            log.info(
                "listed this node's ResourceSlices: %d device(s) with a uuid attribute",
                len(found),
            )
        self._uuids, self._last_error = found, ""
        self.listings += 1

    def _need_listing(self, devices: Iterable[DraDevice]) -> bool:
        if self._list_slices is None:
            return False
        if self._listed_at is None:
            return True
        age = self._clock() - self._listed_at
        if age >= self._max_age_s:
            return True
        unknown = any(d not in self._uuids for d in devices)
        return unknown and age >= self._relist_s

    def resolve(self, devices: Sequence[DraDevice]) -> dict[DraDevice, str]:
        """``{device: GPU or MIG UUID}`` for the devices of ``devices`` that map."""
        if not devices:
            return {}
        with self._lock:
            if self._need_listing(devices):
                self._relist()
            out: dict[DraDevice, str] = {}
            for d in devices:
                uuid = self._uuids.get(d)
                if uuid is None and d.driver in self.index_drivers:
                    index = index_of(d.device)
                    uuid = self.index_uuids.get(index) if index is not None else None
                if uuid:
                    out[d] = uuid
            return out
