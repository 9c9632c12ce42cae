"""The live web dashboard: a read model of the log (``view``), served over HTTP (``server``) by a
reader process (``service``). Pages and assets are in ``static/``."""
