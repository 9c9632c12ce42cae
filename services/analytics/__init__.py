"""The analytics service: history in, insight and decisions out.

- ``traces``: public traces -> one normalized job table (and submissions, Helios CSV export);
- ``jobs``: any gpuherd log -> the same table; JCT, queueing and utilization summaries;
- ``predict``: online duration model (``JobDurationPredicted``) and its accuracy on traces;
- ``ces``: demand forecast and power controller (cluster energy saving);
- ``decide``: the decider (predictions, power decisions); ``service``: it, live;
- ``report``: the characterization report (HTML + PNG + CSV).

It imports only ``gpuherd`` and talks through events.
"""
