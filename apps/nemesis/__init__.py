"""The nemesis: a gpuherd cluster of separate hosts (network namespaces), real faults, an outside checker.

- ``cluster``: hosts on a bridge, a 3-node JetStream cluster (stores on ``lazyfs``), scheduler
  replicas, cpu node agents, the intake client; everything removed on exit;
- ``lazyfs``: a FUSE filesystem that loses unsynced writes on command (power loss);
- ``proxy``: a TCP proxy that delays, stalls and resets a host's links (latency);
- ``faults``: the fault kinds and a seeded schedule of them;
- ``checker``: judges from the outside (client acknowledgements, the jobs' own run records, the
  log after healing);
- ``run``: one run, start to verdict (``make nemesis``, ``bench/bench_nemesis.py``, ``tests/nemesis``).

It lives in ``apps`` because it composes every part of gpuherd (services, agents, the audit of
their deciders): the layer that may import several services.
"""
