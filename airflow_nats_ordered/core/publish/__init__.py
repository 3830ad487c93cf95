"""Publishing in per-key order, stored once: the publisher, its per-partition lanes and their
shared sender, derived msg-ids, the pre-encoded wire format, the runs ledger and runs that
span a repartition.

Builds on :mod:`..stream`.
"""
