"""A consumer group's state in its KV bucket: the store, leases and fencing tokens, commits
(pipelined compare-and-set), the sticky assignor and the assignment, the global reader's
position, status and lag.

Builds on :mod:`..stream`.
"""
