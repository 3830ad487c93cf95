"""The partitioned stream: how a key picks a partition (murmur3), the stream's layouts and
their subjects, provisioning and describing it, stray subjects, repartitioning, the KV
primitives the group's state is stored with, and the fast reader every consumer builds on.

Depends on :mod:`..connection` and :mod:`..errors` only.
"""
