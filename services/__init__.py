"""gpuherd services. Each one imports the ``gpuherd`` library and never another service."""
