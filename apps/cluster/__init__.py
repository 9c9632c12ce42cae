"""``gpuherd up``: a supervised cluster on this machine (``local``), run in the foreground (``up``),
and the ``make run`` demo (``demo``)."""
