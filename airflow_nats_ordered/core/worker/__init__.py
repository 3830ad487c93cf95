"""A group member: the worker (:mod:`.worker`) and the parts it has - its heartbeat, the
leader's role, following the assignment (claims and revocations), delivering a partition's
records to the handler (continuity checks, commits, dead letters for poison), watching the
group's presence, a member across a repartition - and an in-process pool of members.

Builds on :mod:`..group` and :mod:`..stream`.
"""
