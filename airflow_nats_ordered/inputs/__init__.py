"""What ``nats-ordered publish`` and the publish operator read, turned into records.

:mod:`.files` reads JSON lines, CSV and Parquet files (and in-memory rows); :mod:`.records`
is what one row becomes (its payload JSON, its key and msg-id text); :mod:`.order` is the
``order_by`` rule that sorts rows before they are published.
"""
