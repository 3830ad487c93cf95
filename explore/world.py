"""What the explorer knows of the system under test now (the generator's and the nemesis'
view): the inputs made so far, the producers and their publishes, the layout."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .checker import InputRecord

KEYS = 12


@dataclass
class Producer:
    """One producer id and its input file (published by ``kind``: ``cli`` or ``run``)."""

    id: str
    kind: str
    path: Path
    records: list[InputRecord]
    #: repartitions started before its first publish started
    repartitions_at_first: int
    publishes: list[int] = field(default_factory=list)  # command ids
    complete: bool = False
    repartitioned: bool = False  # a repartition ran while it was being published


@dataclass
class World:
    workdir: Path
    partitions: int
    next_gid: int = 1
    producers: dict[str, Producer] = field(default_factory=dict)
    #: repartition commands started (whatever became of them)
    repartitions_started: int = 0
    #: gids of dead letters purged on purpose
    purged: set[int] = field(default_factory=set)

    def new_input(
        self, kind: str, size: int, poison_share: float, rng_choice: list[float], name: str
    ) -> Producer:
        """A new input file of ``size`` records (``rng_choice``: one uniform [0,1) draw per
        record, picking its key and whether it is poison)."""
        recs: list[InputRecord] = []
        per_key: dict[str, int] = {}
        for u in rng_choice[:size]:
            gid = self.next_gid
            self.next_gid += 1
            if u < poison_share:
                recs.append(InputRecord(gid, name, f"poison-{gid}", 0, poison=True))
                continue
            key = f"k{int((u - poison_share) / (1 - poison_share) * KEYS) % KEYS}"
            n = per_key.get(key, 0)
            per_key[key] = n + 1
            recs.append(InputRecord(gid, name, key, n))
        path = self.workdir / "inputs" / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            "".join(
                json.dumps(
                    {"k": r.key, "i": r.gid, "p": r.producer, "n": r.n}
                    | ({"poison": True} if r.poison else {}),
                    separators=(",", ":"),
                )
                + "\n"
                for r in recs
            )
        )
        prod = Producer(name, kind, path, recs, self.repartitions_started)
        self.producers[name] = prod
        return prod

    def inputs(self) -> list[InputRecord]:
        return [r for p in self.producers.values() for r in p.records]
