"""Executors run a job's part on this node. ``sim`` runs no process (a job
ends after its duration); ``cpu`` and ``nvml`` come with real processes."""

from services.nodeagent.executors.base import Executor, TaskExit, TaskKey
from services.nodeagent.executors.sim import SimExecutor

__all__ = ["Executor", "SimExecutor", "TaskExit", "TaskKey"]
