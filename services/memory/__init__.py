"""The memory broker: lends spare memory of neighbor GPUs (and pinned host memory) to jobs whose
working set does not fit their GPU, and takes it back when a lender's own job needs it
(``policy.py``). It owns memory leases only; it imports only ``gpuherd`` and talks through events."""
