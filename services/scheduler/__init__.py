"""The scheduler: sole owner of GPU allocations.

- ``intake``: validates submissions from herd.intake.<source> -> JobSubmitted / JobRejected
- ``placement``: where a gang fits (consolidating: fewest nodes, best fit)
- ``policy``: which waiting job goes next (pluggable; FIFO first)
- ``ranks``: the waiting jobs in the policy's order, kept between a decider's passes
- ``decide``: the pure decider tying them together
- ``service``: the shell (lease, log, intake loop, node liveness)
"""
