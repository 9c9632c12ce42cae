"""Discrete-event simulation of a gpuherd cluster on a virtual clock (see ``engine.py``)."""

from gpuherd.sim.engine import SimAgents, Simulation, SimulationError

__all__ = ["SimAgents", "Simulation", "SimulationError"]
