"""The simulator: the live deciders and the live runtime core on a virtual clock.

- ``engine``: the clock, the log, the cores and the agents; ``agents``: the node agents' reconcile
  step and the sim executor's tasks; ``cluster``: the simulated cluster spec; ``run``: one run of a
  trace under a policy.
"""

from apps.sim.engine import Simulation, SimulationError, Timer

__all__ = ["Simulation", "SimulationError", "Timer"]
