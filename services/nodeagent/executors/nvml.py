"""The ``nvml`` executor: real GPUs, read through NVML (pynvml), real processes.

Inventory lists every GPU with its UUID, model and memory, and its NVLink
peers: GPUs it reaches over NVLink, as NVML's peer-to-peer status says (this
covers NVSwitch systems, where a link's remote end is the switch, not a GPU),
else as the remote PCI address of each active link says. A GPU with neither
talks over PCIe only and is an island of its own.

Each process of a task sees exactly the task's GPUs: ``CUDA_VISIBLE_DEVICES``
lists their UUIDs (stable across reboots and ``nvidia-smi`` reordering), and
``LOCAL_RANK`` picks one of them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from gpuherd import jobenv
from gpuherd.errors import GpuherdError
from gpuherd.events import GpuInfo
from gpuherd.obs import get_logger
from services.nodeagent.executors.base import GpuSample
from services.nodeagent.executors.process import ProcessExecutor

log = get_logger("gpuherd.nodeagent.nvml")


class NvmlUnavailable(GpuherdError):
    """NVML could not be loaded or found no GPU."""


def _nvml() -> Any:
    try:
        import pynvml
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise NvmlUnavailable("pynvml (nvidia-ml-py) is not installed") from exc
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise NvmlUnavailable(f"NVML is not available on this machine ({exc}); use --executor cpu") from exc
    return pynvml


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class NvmlExecutor(ProcessExecutor):
    kind = "nvml"

    def __init__(self, data_dir: Path, **kwargs: Any) -> None:
        super().__init__(data_dir, **kwargs)
        self.nvml = _nvml()
        count = self.nvml.nvmlDeviceGetCount()
        if count == 0:
            raise NvmlUnavailable("NVML sees no GPU on this machine; use --executor cpu")
        self.handles = [self.nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self.uuids = [_text(self.nvml.nvmlDeviceGetUUID(h)) for h in self.handles]
        self._events = self._xid_events()

    # -- inventory ---------------------------------------------------------------------------

    def inventory(self, node: str) -> list[GpuInfo]:
        out = []
        for index, handle in enumerate(self.handles):
            memory = self.nvml.nvmlDeviceGetMemoryInfo(handle)
            out.append(
                GpuInfo(
                    index=index,
                    uuid=self.uuids[index],
                    model=_text(self.nvml.nvmlDeviceGetName(handle)),
                    memory_mb=int(memory.total // (1024 * 1024)),
                    nvlink_peers=tuple(sorted(self._nvlink_peers(index))),
                )
            )
        return out

    def _nvlink_peers(self, index: int) -> set[int]:
        nv = self.nvml
        peers: set[int] = set()
        handle = self.handles[index]
        for other, other_handle in enumerate(self.handles):
            if other == index:
                continue
            with contextlib.suppress(nv.NVMLError):
                status = nv.nvmlDeviceGetP2PStatus(handle, other_handle, nv.NVML_P2P_CAPS_INDEX_NVLINK)
                if status == nv.NVML_P2P_STATUS_OK:
                    peers.add(other)
        if peers:
            return peers
        bus_ids = {}
        for other, other_handle in enumerate(self.handles):
            with contextlib.suppress(nv.NVMLError):
                bus_ids[_text(nv.nvmlDeviceGetPciInfo(other_handle).busId).lower()] = other
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            try:
                if nv.nvmlDeviceGetNvLinkState(handle, link) != nv.NVML_FEATURE_ENABLED:
                    continue
                remote = _text(nv.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId).lower()
            except nv.NVMLError:
                break  # no more links (or no NVLink at all)
            if bus_ids.get(remote, index) != index:
                peers.add(bus_ids[remote])
        return peers

    # -- telemetry ---------------------------------------------------------------------------

    def _xid_events(self) -> Any:
        nv = self.nvml
        try:
            events = nv.nvmlEventSetCreate()
            for handle in self.handles:
                nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, events)
            return events
        except nv.NVMLError as exc:
            log.info("XID events are not readable here", error=str(exc))
            return None

    @property
    def watches_xids(self) -> bool:
        """Whether NVML delivers XID (critical error) events here: a GPU's XID marks it unhealthy."""
        return self._events is not None

    def _pending_xids(self) -> dict[int, int]:
        nv = self.nvml
        xids: dict[int, int] = {}
        while self._events is not None:
            try:
                data = nv.nvmlEventSetWait(self._events, 0)
            except nv.NVMLError:
                break  # timeout: nothing pending
            with contextlib.suppress(ValueError):
                index = self.uuids.index(_text(nv.nvmlDeviceGetUUID(data.device)))
                xids[index] = int(data.eventData)
        return xids

    def sample(self) -> list[GpuSample]:
        nv = self.nvml
        xids = self._pending_xids()
        out = []
        for index, handle in enumerate(self.handles):

            def read(fn: Any, *args: Any, handle: Any = handle) -> Any:
                try:
                    return fn(handle, *args)
                except nv.NVMLError:
                    return None

            util = read(nv.nvmlDeviceGetUtilizationRates)
            memory = read(nv.nvmlDeviceGetMemoryInfo)
            power = read(nv.nvmlDeviceGetPowerUsage)
            ecc = read(nv.nvmlDeviceGetTotalEccErrors, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
            problem = ""
            if util is None and memory is None:
                problem = "fell off the bus: NVML cannot read it"
            elif index in xids:
                problem = f"XID {xids[index]}"
            elif ecc:
                problem = f"{ecc} uncorrected ECC errors"
            out.append(
                GpuSample(
                    index=index,
                    utilization_pct=None if util is None else float(util.gpu),
                    memory_used_mb=None if memory is None else memory.used / (1024 * 1024),
                    power_w=None if power is None else power / 1000.0,
                    temperature_c=_float(read(nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU)),
                    ecc_uncorrected=ecc,
                    xid=xids.get(index),
                    healthy=not problem,
                    problem=problem,
                )
            )
        return out

    # -- processes ---------------------------------------------------------------------------

    def device_env(self, gpus: tuple[int, ...], local_rank: int, neighbors: tuple[int, ...] = ()) -> dict[str, str]:
        return {jobenv.CUDA_VISIBLE_DEVICES: ",".join(self.uuids[i] for i in gpus + neighbors)}

    def compute_pids(self, index: int) -> set[int]:
        """The processes holding a CUDA context on GPU ``index``, as NVML lists them (how a stop is
        checked to have freed the GPU). Empty where NVML cannot list them."""
        nv = self.nvml
        try:
            return {p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(self.handles[index])}
        except nv.NVMLError as exc:
            log.info("NVML cannot list the GPU's processes", gpu=index, error=str(exc))
            return set()

    def warm_pin(self, pinned: set[int]) -> int | None:
        """A warm worker creates its CUDA context on the lowest idle GPU that has none yet: the one
        the scheduler gives a grow first."""
        idle = [g for g in self.idle_gpus() if g not in pinned]
        return idle[0] if idle else None


def _float(value: Any) -> float | None:
    return None if value is None else float(value)
