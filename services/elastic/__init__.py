"""The elastic service: decides when running elastic jobs grow or shrink (``policy.py``) and
proposes it as ``RescaleProposed``; it imports only ``gpuherd`` and talks through events."""
