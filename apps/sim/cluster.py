"""The simulated cluster: nodes x GPUs per node for each VC, as set-up events.

A VC's capacity is its GPU quota (``VcConfigured``) on a shared pool of nodes
sized to the sum of the VCs; with ``can_borrow`` off (the default, as Helios
simulates its VCs as separate partitions) a VC never uses more than its own
GPUs, and intake refuses a job larger than its VC. The spec comes from a file (JSON or YAML)::

    {"gpus_per_node": 8, "can_borrow": false,
     "vcs": {"vision": {"nodes": 12}, "nlp": {"nodes": 4, "gpus_per_node": 4}}}

or from a trace's per-VC peak demand times a scale factor (``from_peaks``).
"""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import yaml

from gpuherd import events as ev
from gpuherd.errors import GpuherdError


class ClusterSpecError(GpuherdError):
    """A cluster spec that cannot be simulated."""


class VcSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    nodes: int
    gpus_per_node: int | None = None  # default: the cluster's


class ClusterSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    vcs: dict[str, VcSpec]
    gpus_per_node: int = 8
    can_borrow: bool = False
    island: int = 0  # GPUs per NVLink island (0: the whole node is one island)

    def __post_init__(self) -> None:
        if not self.vcs:
            raise ClusterSpecError("a cluster spec needs at least one VC")
        for name, vc in self.vcs.items():
            if vc.nodes < 0 or (vc.gpus_per_node or self.gpus_per_node) <= 0:
                raise ClusterSpecError(f"VC {name}: nodes must be >= 0 and GPUs per node > 0")

    @classmethod
    def from_file(cls, path: str | Path) -> ClusterSpec:
        path = Path(path)
        try:
            data = path.read_bytes()
            text = data.decode("utf-8")
            raw = yaml.safe_load(text)
            return msgspec.convert(raw, cls)
        except UnicodeDecodeError as exc:
            bad = data[exc.start : exc.start + 1].hex()
            raise ClusterSpecError(
                f"{path}: not a cluster spec (not UTF-8: byte 0x{bad} at offset {exc.start:,})"
            ) from None
        except RecursionError:  # (the YAML parser recurses once per level: "[[[[..." exhausts the stack)
            raise ClusterSpecError(f"{path}: not a cluster spec (nested too deeply)") from None
        except (OSError, yaml.YAMLError, msgspec.ValidationError) as exc:
            raise ClusterSpecError(f"{path}: not a cluster spec ({exc})") from None
        except ClusterSpecError as exc:  # (its own checks, which do not know the file)
            raise ClusterSpecError(f"{path}: {exc}") from None

    @classmethod
    def from_peaks(
        cls, peaks: dict[str, int], *, scale: float = 1.0, gpus_per_node: int = 8, can_borrow: bool = False
    ) -> ClusterSpec:
        """Each VC gets ``scale`` x its peak GPU demand, rounded up to whole nodes (at least one)."""
        if not 0 < scale < math.inf:  # (NaN and inf have no whole number of nodes)
            raise ClusterSpecError(f"scale must be positive and finite, got {scale}")
        vcs = {vc: VcSpec(nodes=max(1, math.ceil(peak * scale / gpus_per_node))) for vc, peak in sorted(peaks.items())}
        return cls(vcs=vcs, gpus_per_node=gpus_per_node, can_borrow=can_borrow)

    def vc_gpus(self, vc: str) -> int:
        spec = self.vcs[vc]
        return spec.nodes * (spec.gpus_per_node or self.gpus_per_node)

    @property
    def total_gpus(self) -> int:
        return sum(self.vc_gpus(vc) for vc in self.vcs)

    @property
    def total_nodes(self) -> int:
        return sum(vc.nodes for vc in self.vcs.values())

    def setup_events(self) -> list[ev.Event]:
        out: list[ev.Event] = []
        for vc, spec in self.vcs.items():
            per_node = spec.gpus_per_node or self.gpus_per_node
            for i in range(spec.nodes):
                name = f"{vc}-n{i:03d}"
                gpus = ev.declared_gpus(name, per_node, island=self.island, model="SIM-GPU", memory_mb=81920)
                out.append(ev.NodeRegistered(node=name, gpus=tuple(gpus), rack=f"rack-{vc}", executor="sim"))
            out.append(ev.VcConfigured(vc=vc, gpu_quota=self.vc_gpus(vc), can_borrow=self.can_borrow))
        return out
