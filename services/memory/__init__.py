"""The memory service: arrives with its own issue. It will import only `gpuherd` and talk through events."""
