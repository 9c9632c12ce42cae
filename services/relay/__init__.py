"""The report relay: node agents' reports stored many at a time (``gpuherd.log.relay``)."""
