"""Known defects, each switchable by name (``--skip-known``).

Each entry is a defect that is being fixed on another branch: the explorer finds it on
main. Skipping one turns off what triggers it (an operation, a fault on an operation or an
invariant), so that a sample run is green while the fix lands; once it is merged, delete
its entry here (or run with ``--skip-known none``) and the explorer checks it again.
"""

from __future__ import annotations

#: name -> (the defect, what skipping it turns off)
KNOWN_DEFECTS: dict[str, tuple[str, str]] = {
    # none open: repartition-dup, run-spin, repartition-interrupted, lag-exact and
    # sigterm-at-startup were fixed (docs/explore.md). A new one looks like
    # "name": ("the defect", "what skipping it turns off"), and is handled where it is
    # triggered (generator, nemesis) or in SKIPPED_INVARIANTS.
}

#: invariants a known defect's name turns off
SKIPPED_INVARIANTS: dict[str, str] = {}


def parse_skip(text: str) -> frozenset[str]:
    """``all`` (every known defect), ``none``, or a comma list of names."""
    text = text.strip()
    if text in ("", "none"):
        return frozenset()
    if text == "all":
        return frozenset(KNOWN_DEFECTS)
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(names - set(KNOWN_DEFECTS))
    if unknown:
        raise ValueError(
            f"unknown defect name(s) {', '.join(unknown)}; known: {', '.join(KNOWN_DEFECTS)}"
        )
    return names
