"""Operations over everything else: drain waits, group administration (reset, rebalance,
delete) and listing, dead-letter administration.

The top wing: it may import any other; none imports it.
"""
