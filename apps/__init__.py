"""The composition layer: the only code that imports more than one service.

- ``registry``: every gpuherd process by name: its decider, entry point, and the events it follows and emits;
- ``cli``: the ``gpuherd`` command, one module per command group;
- ``cluster``: ``gpuherd up`` (a supervised local cluster) and the ``make run`` demo;
- ``sim``: the simulator: the live deciders and the same runtime core on a virtual clock.

Arrows point down: apps -> services -> libs (``gpuherd``).
"""
