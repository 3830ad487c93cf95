"""Operations over everything else, one module per operation an operator knows by name:
waiting for a group to drain (:mod:`.drain`, its marks :mod:`.marks`, its failures
:mod:`.drain_errors`), whether a group exists and who is alive in it (:mod:`.membership`),
resetting (:mod:`.reset`), rebalancing (:mod:`.rebalance`), deleting (:mod:`.delete`) and
listing (:mod:`.listing`) groups, the dead-letter stream (:mod:`.dlq`) and the
administration of dead letters (:mod:`.dead_letters`).

The top wing: it may import any other; none imports it.
"""
