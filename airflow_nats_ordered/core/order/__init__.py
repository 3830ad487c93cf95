"""Global order across partitions: the merge strategies (time windows, exact event time),
producers and their watermarks, the sequencer, and the global-order reader.

Builds on :mod:`..publish` (its producers publish), :mod:`..worker` (late records are dead
letters), :mod:`..group` and :mod:`..stream`; nothing below imports it.
"""
