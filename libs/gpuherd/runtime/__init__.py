"""The decider runtime, one for live and simulation.

- ``decider``: the contract (pure ``evolve``/``decide``, routing, state format), ids and provenance;
- ``core``: the ordering core: what is decided on which state (coalescing, batching, catch-up);
- ``runner``: the live shell around the core (leadership, snapshot, append through NATS outages);
- ``timers``: a service's clock ticks; ``serve``: a decider as a process;
- ``audit``: re-run a decider at every decision it recorded; ``deadletters``: what no one could read.
"""
