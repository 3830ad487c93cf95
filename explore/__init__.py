"""The explorer: a seeded, randomized whole-system test over real processes (issue 28).

A generator composes operations (CLI publishes, publish_run, workers and pools joining and
leaving, repartitions, group resets and rebalances, dead-letter replays and purges, drain
waits), a nemesis injects faults at random instants (SIGKILL, SIGSTOP/SIGCONT, nats-server
restarts, leader kills on a cluster), and a checker verifies the whole history at the end.
Run it with ``make explore`` or ``python -m explore --seed N --minutes M``; see
docs/explore.md.
"""
