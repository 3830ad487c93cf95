"""The invariants, checked over a whole history with plain values (no I/O).

:func:`check` takes :class:`Facts` (what was published, what the stream stores, what the
fenced sink applied, and what the commands reported) and returns every :class:`Violation`.
Each invariant has a name; ``skip`` leaves named ones out (known defects being fixed
elsewhere, see ``explore.known``). tests/explore/test_explore_checker.py shows each one failing on a
fabricated history.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

#: every invariant :func:`check` knows, with what it guarantees
INVARIANTS = {
    "stored-once": "every input record is stored at most once per producer id, over all layout "
    "epochs of the stream",
    "stream-key-order": "each producer's records of a key are stored in input order",
    "no-gap": "each producer's stored records of a key are a prefix of its input (no gap)",
    "complete-stored": "a publish that reported success stored every record of its input",
    "sink-key-order": "the fenced sink applied each producer's records of a key in input order",
    "applied-once": "the fenced sink applied each stored message, and each input record, once",
    "drained-applied": "a drain that reported success came after every record stored before it "
    "was applied (poison records: dead-lettered)",
    "dead-letter-kept": "a poison record is applied through a replay, still a dead letter, or "
    "was purged on purpose",
    "lag-exact": "the lag status and group list report, once quiescent, equals the stored but "
    "unapplied records",
    "counts": "every count a publish reported (acked, duplicates) equals what the server holds",
    "member-exit": "a worker or pool ends only when told: SIGTERM (then it exits 0) or SIGKILL "
    "(or exits 2 before it joined: its documented refusal to start)",
    "member-startup-exit": "a worker SIGTERM'd while starting exits 0 too (and so does a pool "
    "SIGTERM'd while a member starts)",
    "layout-complete": "after the final phase no repartition is left interrupted: no pending "
    "switch point, the stream's subjects are its metadata's layout",
    "liveness": "every command ends within its deadline, nothing spins, the final drain ends",
    "no-permission-violation": "with --least-privilege, no process was refused a permission "
    "(no 'permission denied' in any command's log) and the server logged no 'Permissions "
    "Violation'",
    "global-order": "with --global-order, each global-order reader handed over the stored "
    "records in increasing global sequence without passing over a stored one, starting right "
    "after the position it resumed from, which no reader had not handed over yet",
    "global-complete": "with --global-order, every stored record carries a global sequence of "
    "its own, every one was handed over, and each handed-over record is the stored one",
    "global-drained": "with --global-order, a drain of the readers' group that reported "
    "success came after every record stored before it started was handed over",
    "global-reader-exit": "with --global-order, a reader ends only when told (SIGTERM, then "
    "exit 0), by SIGKILL, or fenced by a newer reader of its group (exit 3), or exits 2 before "
    "it took its position",
}


@dataclass(frozen=True)
class InputRecord:
    """One record of an input: ``gid`` is unique over the whole run, ``n`` is its index
    among its producer's records of ``key``."""

    gid: int
    producer: str
    key: str
    n: int
    poison: bool = False


@dataclass(frozen=True)
class StoredRecord:
    """One message of the stream: the input record it carries (its ``gid``) and whether it
    is a dead-letter replay."""

    seq: int
    subject: str
    gid: int
    replay: bool = False


@dataclass(frozen=True)
class AppliedRecord:
    """One row of the fenced sink, in apply order (``event_id``)."""

    event_id: int
    gid: int
    seq: int


@dataclass(frozen=True)
class PublishReport:
    """What one publish command (``cli`` publish or ``run``, publish_run) reported.

    ``summary``: it printed one (not killed). ``acked``/``duplicates`` are its counts;
    ``complete``: it reported every record stored. ``repartitioned``: a repartition ran
    during this producer's publishes (a run's counts are per layout then)."""

    command: int
    kind: str
    producer: str
    records: int
    complete: bool
    summary: bool
    acked: int = 0
    duplicates: int = 0
    unexpected_duplicates: int = 0
    repartitioned: bool = False
    #: no other writer (publish, run, replay) ran while it did: its duplicates are exact
    alone: bool = False


@dataclass(frozen=True)
class DrainClaim:
    """A drain wait (command ``command``) that reported success: the stream's last sequence
    before it started (``high_water``) and the sink's last event id after it ended."""

    command: int
    high_water: int
    applied_upto: int


@dataclass(frozen=True)
class LagClaim:
    """A lag reported once quiescent (no worker running, nothing publishing): by ``source``
    (``status``, ``group list``), with the sink fully caught up to stream sequence
    ``drained_upto`` before the last records were published."""

    source: str
    reported: int
    drained_upto: int


@dataclass(frozen=True)
class MemberExit:
    """How a worker or pool (command ``command``) ended: ``leaving`` (SIGTERM'd by the
    explorer), ``killed`` (SIGKILLed by the nemesis), or on its own; ``tail`` of its log."""

    command: int
    op: str
    exit_code: int | None
    leaving: bool = False
    killed: bool = False
    tail: str = ""
    #: SIGTERM'd before it joined: a worker dead by SIGTERM with nothing logged, or a pool
    #: whose only members that did not leave gracefully were killed by SIGTERM
    starting: bool = False
    #: it logged that it joined the group (exit 2 before that is the documented refusal to
    #: start, e.g. while a cluster elects its leaders: a pool starts it again)
    joined: bool = True


@dataclass(frozen=True)
class GlobalStored:
    """A stored record of a ``--global-order`` run: its stream sequence, the record's global
    id (``gid``) and its ``Nats-Global-Seq`` (None: it has none)."""

    seq: int
    gid: int
    gseq: int | None


@dataclass(frozen=True)
class Handover:
    """One record a global-order reader handed to its handler (``row``: the order the
    handlers wrote them in, over every reader)."""

    row: int
    reader: str
    gseq: int
    seq: int
    gid: int


@dataclass(frozen=True)
class ReaderRun:
    """One ``global-read`` process: its member id, the global sequence it said it resumes
    after (None: it never said), how it ended."""

    command: int
    reader: str
    resumed_after: int | None
    exit_code: int | None
    leaving: bool = False
    killed: bool = False
    #: a reader of the same group started after it (so it may have been fenced)
    superseded: bool = False
    tail: str = ""


@dataclass
class Facts:
    inputs: list[InputRecord]
    stored: list[StoredRecord]
    applied: list[AppliedRecord]
    publishes: list[PublishReport] = field(default_factory=list)
    drains: list[DrainClaim] = field(default_factory=list)
    lags: list[LagClaim] = field(default_factory=list)
    #: gids of poison records purged from the dead letters on purpose, and still there
    purged: set[int] = field(default_factory=set)
    dead_letters: set[int] = field(default_factory=set)
    #: liveness problems seen while running (hung, spinning, final drain not ending)
    liveness: list[str] = field(default_factory=list)
    #: how each worker and pool that ended before the end of the run ended
    members: list[MemberExit] = field(default_factory=list)
    #: what is left of an interrupted repartition at the end (None: the layout is complete)
    layout_pending: str | None = None
    #: refusals seen (``--least-privilege``): a command's log line reporting a denied
    #: permission, or a server's ``Permissions Violation`` line, each naming where it was
    denials: list[str] = field(default_factory=list)
    #: ``--global-order``: the stream's records with their global sequences, the readers'
    #: hand-overs and the reader processes (empty otherwise: the global invariants hold)
    global_stored: list[GlobalStored] = field(default_factory=list)
    handed: list[Handover] = field(default_factory=list)
    readers: list[ReaderRun] = field(default_factory=list)
    #: drains of the readers' group that reported success (``applied_upto``: the last
    #: hand-over row written when it ended)
    global_drains: list[DrainClaim] = field(default_factory=list)


@dataclass(frozen=True)
class Violation:
    invariant: str
    message: str

    def __str__(self) -> str:
        return f"[{self.invariant}] {self.message}"


def check(facts: Facts, skip: frozenset[str] = frozenset(), limit: int = 8) -> list[Violation]:
    """Every violation of the invariants not in ``skip`` (at most ``limit`` per invariant)."""
    found: dict[str, list[str]] = defaultdict(list)
    by_gid = {r.gid: r for r in facts.inputs}
    for name, fn in _CHECKS.items():
        if name not in skip:
            found[name].extend(fn(facts, by_gid))
    out: list[Violation] = []
    for name, msgs in found.items():
        out.extend(Violation(name, m) for m in msgs[:limit])
        if len(msgs) > limit:
            out.append(Violation(name, f"... and {len(msgs) - limit} more"))
    return out


def _originals(facts: Facts) -> list[StoredRecord]:
    return [s for s in facts.stored if not s.replay]


def _epoch_of(subject: str) -> str:
    """``e0`` for ``<prefix>.p.<n>``, ``e<k>`` for ``<prefix>.p.e<k>-<n>``."""
    tail = subject.rsplit(".", 1)[-1]
    return tail.split("-", 1)[0] if tail.startswith("e") else "e0"


def _stored_once(facts: Facts, by_gid: dict[int, InputRecord]) -> list[str]:
    copies: dict[int, list[StoredRecord]] = defaultdict(list)
    replays: dict[int, list[int]] = defaultdict(list)
    for s in facts.stored:
        if s.replay:
            replays[s.gid].append(s.seq)
        else:
            copies[s.gid].append(s)
    twice: dict[str, list[tuple[int, list[StoredRecord]]]] = defaultdict(list)
    for gid, cs in sorted(copies.items()):
        if len(cs) > 1:
            r = by_gid.get(gid)
            twice[r.producer if r else "?"].append((gid, cs))
    out = []
    for producer, recs in sorted(twice.items()):
        gid, cs = recs[0]
        r = by_gid.get(gid)
        what = f"{r.key}#{r.n}" if r else f"gid {gid}"
        epochs = sorted({_epoch_of(c.subject) for _, cs2 in recs for c in cs2})
        total = sum(1 for r2 in facts.inputs if r2.producer == producer)
        out.append(
            f"{producer}: {len(recs)} of its {total} records are stored more than once "
            f"(layout epochs {'/'.join(epochs)}); e.g. {what} at seqs "
            f"{[c.seq for c in cs]} on {[c.subject for c in cs]}"
        )
    for gid, ss in sorted(replays.items()):
        if len(ss) > 1 and len(copies.get(gid, ())) <= 1:  # else: one replay per copy
            out.append(f"dead letter gid {gid} was replayed and stored {len(ss)} times: {ss}")
    unknown = sorted({s.gid for s in facts.stored if s.gid not in by_gid})
    if unknown:
        out.append(f"messages of no input: gids {unknown[:10]}")
    return out


def _per_key_stored(facts: Facts, by_gid: dict[int, InputRecord]) -> dict[tuple[str, str], list]:
    """Each producer's stored records of each key, (index, seq) in stream order; a record
    stored twice counts at its first copy (the copy is stored-once's to report)."""
    per: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
    seen: set[int] = set()
    for s in sorted(_originals(facts), key=lambda s: s.seq):
        r = by_gid.get(s.gid)
        if r is not None and not r.poison and s.gid not in seen:
            seen.add(s.gid)
            per[(r.producer, r.key)].append((r.n, s.seq))
    return per


def _stream_key_order(facts: Facts, by_gid: dict[int, InputRecord]) -> list[str]:
    out = []
    for (producer, key), ns in sorted(_per_key_stored(facts, by_gid).items()):
        for (a, sa), (b, sb) in zip(ns, ns[1:], strict=False):
            if b < a:
                out.append(f"{producer} key {key}: #{b} (seq {sb}) is stored after #{a} (seq {sa})")
                break
    return out


def _no_gap(facts: Facts, by_gid: dict[int, InputRecord]) -> list[str]:
    out = []
    for (producer, key), ns in sorted(_per_key_stored(facts, by_gid).items()):
        have = sorted({n for n, _ in ns})
        if have != list(range(len(have))):
            missing = sorted(set(range(have[-1] + 1)) - set(have))
            out.append(f"{producer} key {key}: stored #{have[-1]} but not #{missing[:5]} before it")
    return out


def _complete_stored(facts: Facts, by_gid: dict[int, InputRecord]) -> list[str]:
    stored = {s.gid for s in _originals(facts)}
    want: dict[str, list[int]] = defaultdict(list)
    for r in facts.inputs:
        want[r.producer].append(r.gid)
    out = []
    for p in facts.publishes:
        if p.complete:
            missing = [g for g in want[p.producer] if g not in stored]
            if missing:
                out.append(
                    f"#{p.command} {p.kind} {p.producer} reported success but "
                    f"{len(missing)} of its {len(want[p.producer])} records are not stored "
                    f"(gids {missing[:5]})"
                )
    return out


def _sink_key_order(facts: Facts, by_gid: dict[int, InputRecord]) -> list[str]:
    per: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
    seen: set[int] = set()  # a record applied again is applied-once's to report
    for a in sorted(facts.applied, key=lambda a: a.event_id):
        r = by_gid.get(a.gid)
        if r is not None and not r.poison and a.gid not in seen:
            seen.add(a.gid)
            per[(r.producer, r.key)].append((r.n, a.event_id))
    out = []
    for (producer, key), ns in sorted(per.items()):
        for (n1, e1), (n2, e2) in zip(ns, ns[1:], strict=False):
            if n2 <= n1:
                out.append(
                    f"{producer} key {key}: the sink applied #{n2} (event {e2}) after "
                    f"#{n1} (event {e1})"
                )
                break
    return out


def _applied_once(facts: Facts, by_gid: dict[int, InputRecord]) -> list[str]:
    out = []
    by_seq: dict[int, list[int]] = defaultdict(list)
    for a in facts.applied:
        by_seq[a.seq].append(a.event_id)
    for seq, events in sorted(by_seq.items()):
        if len(events) > 1:
            out.append(f"stream seq {seq} was applied {len(events)} times (events {events})")
    replay_seqs = {s.seq for s in facts.stored if s.replay}
    by_gid_applied: dict[int, set[int]] = defaultdict(set)
    for a in facts.applied:
        if a.seq not in replay_seqs:
            by_gid_applied[a.gid].add(a.seq)
    again: dict[str, list[tuple[int, list[int]]]] = defaultdict(list)
    for gid, seqs in sorted(by_gid_applied.items()):
        if len(seqs) > 1:
            r = by_gid.get(gid)
            again[r.producer if r else "?"].append((gid, sorted(seqs)))
    for producer, recs in sorted(again.items()):
        gid, first = recs[0]
        r = by_gid.get(gid)
        what = f"{r.key}#{r.n}" if r else f"gid {gid}"
        out.append(
            f"{producer}: {len(recs)} of its records were applied more than once (from "
            f"copies at different seqs); e.g. {what} from seqs {first}"
        )
    return out


def _drained_applied(facts: Facts, by_gid: dict[int, InputRecord]) -> list[str]:
    out = []
    for d in facts.drains:
        applied = {a.seq for a in facts.applied if a.event_id <= d.applied_upto}
        missing = []
        for s in facts.stored:
            r = by_gid.get(s.gid)
            if s.seq > d.high_water or s.seq in applied:
                continue
            if r is not None and r.poison and not s.replay:
                continue  # refused by the handler: dead-lettered, not applied
            missing.append(s.seq)
        if missing:
            out.append(
                f"drain #{d.command} reported drained up to seq {d.high_water} but "
                f"{len(missing)} stored record(s) were not applied (seqs {missing[:10]})"
            )
    return out


def _dead_letter_kept(facts: Facts, by_gid: dict[int, InputRecord]) -> list[str]:
    applied = {a.gid for a in facts.applied}
    stored = {s.gid for s in _originals(facts)}
    out = []
    for r in facts.inputs:
        if not r.poison or r.gid not in stored:
            continue
        if r.gid not in applied and r.gid not in facts.dead_letters and r.gid not in facts.purged:
            out.append(
                f"poison record {r.producer} {r.key} (gid {r.gid}) is stored but neither "
                "applied through a replay, nor a dead letter, nor purged"
            )
    return out


def _lag_exact(facts: Facts, by_gid: dict[int, InputRecord]) -> list[str]:
    out = []
    for lag in facts.lags:
        applied = {a.seq for a in facts.applied}
        real = sum(1 for s in facts.stored if s.seq > lag.drained_upto and s.seq not in applied)
        if lag.reported != real:
            out.append(
                f"{lag.source} reports lag {lag.reported}, but {real} stored record(s) are not "
                f"applied (all after seq {lag.drained_upto})"
            )
    return out


def _counts(facts: Facts, by_gid: dict[int, InputRecord]) -> list[str]:
    """``acked`` counts every acknowledged record, stored now or a duplicate of one stored
    before; ``duplicates`` may miss some while another writer shares the partitions (never
    invent one) and is exact for a publisher that wrote alone."""
    stored_by: dict[str, int] = defaultdict(int)
    for s in _originals(facts):
        r = by_gid.get(s.gid)
        if r is not None:
            stored_by[r.producer] += 1
    out = []
    reports: dict[str, list[PublishReport]] = defaultdict(list)
    for p in facts.publishes:
        reports[p.producer].append(p)
    for producer, ps in sorted(reports.items()):
        for p in ps:
            name = "publish" if p.kind == "cli" else "publish_run"
            if p.unexpected_duplicates:
                out.append(
                    f"#{p.command} {name} {producer} reported "
                    f"{p.unexpected_duplicates} unexpected duplicate(s)"
                )
            if p.complete and p.summary and not p.repartitioned and p.acked != p.records:
                out.append(
                    f"#{p.command} {name} {producer} reported success with acked {p.acked} "
                    f"for an input of {p.records} records"
                )
        cli = [p for p in ps if p.kind == "cli"]
        if cli and len(cli) == len(ps) and all(p.summary for p in cli):
            acked, dups = sum(p.acked for p in cli), sum(p.duplicates for p in cli)
            refused = acked - stored_by[producer]  # what the server held already
            if dups > refused or (all(p.alone for p in cli) and dups != refused):
                out.append(
                    f"publishes {[p.command for p in cli]} of {producer} reported {acked} "
                    f"acked and {dups} duplicates, but the stream holds {stored_by[producer]} "
                    f"of its records ({refused} were duplicates"
                    f"{'' if all(p.alone for p in cli) else ' at most'})"
                )
    return out


def _member_exit(facts: Facts, by_gid: dict[int, InputRecord]) -> list[str]:
    return _member_exits(facts, starting=False)


def _member_startup_exit(facts: Facts, by_gid: dict[int, InputRecord]) -> list[str]:
    return _member_exits(facts, starting=True)


def _member_exits(facts: Facts, *, starting: bool) -> list[str]:
    out = []
    for m in facts.members:
        if m.killed or (m.leaving and m.starting) != starting:
            continue
        if m.leaving and m.exit_code == 0:
            continue
        if m.exit_code == 2 and not m.joined:
            continue
        why = "after SIGTERM" if m.leaving else "on its own"
        out.append(f"#{m.command} {m.op} exited {m.exit_code} {why}: {m.tail!r}")
    return out


def _layout_complete(facts: Facts, by_gid: dict[int, InputRecord]) -> list[str]:
    return [] if facts.layout_pending is None else [facts.layout_pending]


def _liveness(facts: Facts, by_gid: dict[int, InputRecord]) -> list[str]:
    return list(facts.liveness)


def _no_permission_violation(facts: Facts, by_gid: dict[int, InputRecord]) -> list[str]:
    return list(facts.denials)


def _global_order(facts: Facts, by_gid: dict[int, InputRecord]) -> list[str]:
    """Per reader, each hand-over is the stored record right after the previous one in
    global order; its first is the one right after the position it resumed from, and that
    position was handed over before (a restart may go back to it, never past what was
    handed over)."""
    gseqs = sorted({s.gseq for s in facts.global_stored if s.gseq is not None})
    after = dict(zip(gseqs, gseqs[1:], strict=False))
    resumed = {r.reader: r.resumed_after for r in facts.readers}
    out = []
    seen_max = 0  # the largest global sequence handed over so far, over every reader
    last: dict[str, int] = {}
    for h in sorted(facts.handed, key=lambda h: h.row):
        prev = last.get(h.reader)
        if prev is None:
            start = resumed.get(h.reader)
            if start is not None:
                if start > seen_max:
                    out.append(
                        f"reader {h.reader} resumed after global sequence {start}, but only "
                        f"{seen_max} had been handed over (row {h.row})"
                    )
                want = next((g for g in gseqs if g > start), None)
                if h.gseq != want:
                    out.append(
                        f"reader {h.reader} resumed after {start} and first handed over "
                        f"global sequence {h.gseq} (row {h.row}); the next stored is {want}"
                    )
        elif h.gseq != after.get(prev):
            what = "again or backwards" if h.gseq <= prev else "passing over stored records"
            out.append(
                f"reader {h.reader} handed over global sequence {h.gseq} (row {h.row}) right "
                f"after {prev}, {what}; the next stored is {after.get(prev)}"
            )
        last[h.reader] = h.gseq
        seen_max = max(seen_max, h.gseq)
    return out


def _global_complete(facts: Facts, by_gid: dict[int, InputRecord]) -> list[str]:
    out = []
    by_seq = {s.seq: s for s in facts.global_stored}
    owners: dict[int, list[int]] = defaultdict(list)
    for s in facts.global_stored:
        if s.gseq is None:
            out.append(f"stored record gid {s.gid} (seq {s.seq}) has no global sequence")
        else:
            owners[s.gseq].append(s.seq)
    for g, seqs in sorted(owners.items()):
        if len(seqs) > 1:
            out.append(f"global sequence {g} is carried by {len(seqs)} stored records: {seqs}")
    handed_seqs = set()
    for h in facts.handed:
        handed_seqs.add(h.seq)
        at = by_seq.get(h.seq)
        if at is None or (at.gseq, at.gid) != (h.gseq, h.gid):
            had = "nothing" if at is None else f"gid {at.gid}, global sequence {at.gseq}"
            out.append(
                f"reader {h.reader} handed over gid {h.gid}, global sequence {h.gseq} as seq "
                f"{h.seq} (row {h.row}); the stream holds {had} there"
            )
    missing = [
        s.seq for s in facts.global_stored if s.gseq is not None and s.seq not in handed_seqs
    ]
    if missing:
        out.append(
            f"{len(missing)} stored record(s) were never handed over by a global-order reader "
            f"(seqs {missing[:10]})"
        )
    return out


#: the words of a global-order reader fenced by a newer one (core/group/global_position.py)
FENCED = "taken over by another reader"


def _global_drained(facts: Facts, by_gid: dict[int, InputRecord]) -> list[str]:
    out = []
    for d in facts.global_drains:
        handed = {h.seq for h in facts.handed if h.row <= d.applied_upto}
        missing = [
            s.seq for s in facts.global_stored if s.seq <= d.high_water and s.seq not in handed
        ]
        if missing:
            out.append(
                f"global drain #{d.command} reported drained up to seq {d.high_water} but "
                f"{len(missing)} stored record(s) were not handed over (seqs {missing[:10]})"
            )
    return out


def _global_reader_exit(facts: Facts, by_gid: dict[int, InputRecord]) -> list[str]:
    out = []
    for r in facts.readers:
        if r.killed or (r.leaving and r.exit_code == 0):
            continue
        if r.exit_code == 3 and r.superseded and FENCED in r.tail:
            continue  # fenced by the newer reader of its group (also at its SIGTERM's write)
        if r.exit_code == 2 and r.resumed_after is None:
            continue  # its documented refusal to start (e.g. while a cluster elects leaders)
        why = "after SIGTERM" if r.leaving else "on its own"
        if r.leaving and r.resumed_after is None:
            why += " while starting (before it took its position)"
        out.append(f"#{r.command} global reader {r.reader} exited {r.exit_code} {why}: {r.tail!r}")
    return out


_CHECKS = {
    "stored-once": _stored_once,
    "stream-key-order": _stream_key_order,
    "no-gap": _no_gap,
    "complete-stored": _complete_stored,
    "sink-key-order": _sink_key_order,
    "applied-once": _applied_once,
    "drained-applied": _drained_applied,
    "dead-letter-kept": _dead_letter_kept,
    "lag-exact": _lag_exact,
    "counts": _counts,
    "member-exit": _member_exit,
    "member-startup-exit": _member_startup_exit,
    "layout-complete": _layout_complete,
    "liveness": _liveness,
    "no-permission-violation": _no_permission_violation,
    "global-order": _global_order,
    "global-complete": _global_complete,
    "global-drained": _global_drained,
    "global-reader-exit": _global_reader_exit,
}
assert set(_CHECKS) == set(INVARIANTS)
