"""The fencing rule: apply only if token >= highest_token and seq > last_seq."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from airflow_nats_ordered.core.sink.fencing import FenceState, Verdict, advance, judge, raise_fence

tokens = st.integers(min_value=0, max_value=8)
seqs = st.integers(min_value=1, max_value=30)
states = st.builds(FenceState, tokens, st.integers(min_value=0, max_value=30))

# One step of an interleaving: a writer (token) writes seq, or a new owner raises the fence.
write = st.tuples(st.just("write"), tokens, seqs)
fence = st.tuples(st.just("fence"), tokens, st.just(0))
histories = st.lists(st.one_of(write, write, fence), max_size=60)


def run(history: list[tuple[str, int, int]]) -> list[tuple[int, int, int]]:
    """Play ``history``; return (step, token, seq) of every accepted write."""
    state = FenceState()
    accepted = []
    for step, (kind, token, seq) in enumerate(history):
        if kind == "fence":
            state = raise_fence(state, token)
        elif judge(state, token, seq) is Verdict.APPLY:
            state = advance(state, token, seq)
            accepted.append((step, token, seq))
    return accepted


@given(histories)
def test_accepted_writes_have_non_decreasing_tokens_and_strictly_increasing_seqs(history) -> None:
    accepted = run(history)
    assert all(a[1] <= b[1] for a, b in zip(accepted, accepted[1:], strict=False))
    assert all(a[2] < b[2] for a, b in zip(accepted, accepted[1:], strict=False))


@given(histories)
def test_after_raise_fence_no_lower_token_is_ever_accepted(history) -> None:
    accepted = run(history)
    for step, (kind, fence_token, _) in enumerate(history):
        if kind == "fence":
            assert all(tok >= fence_token for at, tok, _ in accepted if at > step)


@given(histories)
def test_no_seq_is_applied_twice(history) -> None:
    seqs_applied = [seq for _, _, seq in run(history)]
    assert len(seqs_applied) == len(set(seqs_applied))


@given(states, tokens, seqs, st.sampled_from([True, False, None]))
def test_judge_is_exactly_the_rule(state: FenceState, token: int, seq: int, applied) -> None:
    verdict = judge(state, token, seq, applied=applied)
    if token < state.highest_token:
        assert verdict is Verdict.STALE_TOKEN
    elif seq <= state.last_seq:
        # a re-delivery (or one the sink no longer remembers) is acked; anything else is not
        assert verdict is (Verdict.OUT_OF_ORDER if applied is False else Verdict.DUPLICATE)
    else:
        assert verdict is Verdict.APPLY
        assert advance(state, token, seq) == FenceState(token, seq)


@given(states, tokens)
def test_raise_fence_never_lowers_and_keeps_last_seq(state: FenceState, token: int) -> None:
    raised = raise_fence(state, token)
    assert raised.highest_token == max(state.highest_token, token)
    assert raised.last_seq == state.last_seq
    if token <= state.highest_token:
        assert raised == state


@given(states, tokens, seqs)
def test_advance_refuses_anything_but_an_applicable_write(state, token: int, seq: int) -> None:
    verdict = judge(state, token, seq)
    if verdict is not Verdict.APPLY:
        with pytest.raises(ValueError, match=f"write is {verdict.name}"):
            advance(state, token, seq)


def test_a_new_owner_skips_what_the_old_owner_applied_and_fences_it_off() -> None:
    s = raise_fence(FenceState(), 1)
    for seq in (1, 2, 3):
        assert judge(s, 1, seq) is Verdict.APPLY
        s = advance(s, 1, seq)
    s = raise_fence(s, 2)  # the new owner takes over, re-reads from seq 2
    assert judge(s, 2, 2) is Verdict.DUPLICATE
    assert judge(s, 2, 3) is Verdict.DUPLICATE
    assert judge(s, 1, 4) is Verdict.STALE_TOKEN  # the old owner wakes up: refused
    assert judge(s, 1, 3) is Verdict.STALE_TOKEN  # stale wins over duplicate
    assert judge(s, 2, 4) is Verdict.APPLY
    assert advance(s, 2, 4) == FenceState(highest_token=2, last_seq=4)


def test_a_lower_seq_that_was_never_applied_is_out_of_order_not_a_duplicate() -> None:
    s = advance(FenceState(), 1, 5)
    assert judge(s, 1, 3, applied=False) is Verdict.OUT_OF_ORDER  # a gap or reorder upstream
    assert judge(s, 1, 3, applied=True) is Verdict.DUPLICATE  # a re-delivery
    assert judge(s, 1, 3) is Verdict.DUPLICATE  # not remembered: taken for a re-delivery
    assert judge(s, 0, 3, applied=False) is Verdict.STALE_TOKEN  # a zombie is told first
    assert judge(s, 1, 6, applied=False) is Verdict.APPLY  # newer: nothing to recognize


@pytest.mark.parametrize(
    "call, problem",
    [
        (lambda: judge(FenceState(), -1, 1), "token must be an int >= 0"),
        (lambda: judge(FenceState(), 1, 0), "seq must be an int >= 1"),
        (lambda: judge(FenceState(), True, 1), "token must be an int"),
        (lambda: judge(FenceState(), 1, 1.5), "seq must be an int"),
        (lambda: raise_fence(FenceState(), -2), "token must be an int >= 0"),
        (lambda: FenceState(-1, 0), "highest_token must be an int >= 0"),
        (lambda: FenceState(0, -1), "last_seq must be an int >= 0"),
    ],
)
def test_bad_tokens_and_seqs_are_refused_naming_the_argument(call, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        call()
