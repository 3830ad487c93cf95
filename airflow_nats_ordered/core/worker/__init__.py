"""A group member: the worker, how it delivers a partition's records to the handler, commits
them and dead-letters poison, the leader's role, watching the group's presence, a member
across a repartition, and an in-process pool of members.

Builds on :mod:`..group` and :mod:`..stream`.
"""
