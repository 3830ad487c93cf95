"""A short fixed-seed sample of the explorer (issue 28, docs/explore.md): real processes
under random operations and faults, everything on (``explore.known`` names no open defect;
any added there would be skipped), in least privilege (``--least-privilege``: accounts, one user per
role, every process connected with exactly its role's permissions, at no extra cost); the whole
history must show no violation, no refused permission included. ``make explore`` runs longer
samples, ``make explore SEED=.. MINUTES=..`` one seed for long."""

from __future__ import annotations

import sys

from locations import ROOT

sys.path.insert(0, str(ROOT))

from explore.known import KNOWN_DEFECTS  # noqa: E402
from explore.run import Explorer, Options  # noqa: E402

SEED = 7
SECONDS = 30.0


def test_a_fixed_seed_sample_breaks_no_invariant(tmp_path):
    opts = Options(
        seed=SEED,
        seconds=SECONDS,
        workdir=tmp_path,
        skip_known=frozenset(KNOWN_DEFECTS),
        least_privilege=True,
    )
    explorer = Explorer(opts)
    result = explorer.run()
    assert not result.violations, (
        "\n".join(str(v) for v in result.violations)
        + "\n\nhistory:\n"
        + result.history.render(limit=120)
        + f"\n\nreplay: .venv/bin/python -m explore --seed {SEED} --minutes {SECONDS / 60:g}"
        + " --least-privilege"
    )
    # the sample did exercise the system: publishes, members and faults
    ops = result.counts
    assert ops.get("publish", 0) >= 1 and ops.get("worker-join", 0) >= 1, ops
    assert ops.get("final-drain", 0) >= 1, ops
    # and its processes did connect as their roles' users (none as the admin: a violation);
    # the connections are sampled about each second, the workers' always show
    assert "worker" in explorer.users_seen, explorer.users_seen
