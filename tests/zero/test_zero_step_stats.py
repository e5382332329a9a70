"""The boundary step's control vector (zengine/zero/step_stats.py) on one rank, without a process
group: the named header slots, and the agreement tests read from them."""

import torch

from zengine.zero.step_stats import HEADER, RankValues, Slot, gather_stats


def _values(**kw) -> RankValues:
    base = dict(
        sq_norm=torch.tensor(9.0, dtype=torch.float64),
        had_backward=True,
        micro_step=5,
        used=[True, False, True],
    )
    return RankValues(**{**base, **kw})


def test_each_agreed_value_travels_beside_its_square():
    head = _values(order=(3, 4), fetch_digest=(6, 7)).header(norm_on_host=True)
    assert len(head) == HEADER
    assert head[Slot.SQ_NORM] == 9.0 and head[Slot.HAD_BACKWARD] == 1.0
    for slot, value in [
        (Slot.MICRO_STEP, 5),
        (Slot.ORDER_A, 3),
        (Slot.ORDER_B, 4),
        (Slot.FETCH_A, 6),
        (Slot.FETCH_B, 7),
    ]:
        assert (head[slot], head[slot + 1]) == (value, value * value)
    assert _values().header(norm_on_host=False)[Slot.SQ_NORM] == 0.0  # copied on the device instead


def test_one_rank_reads_norm_flags_and_agreement():
    stats = gather_stats(_values(), torch.device("cpu"), world=1, rank=0)
    assert stats.norm == 3.0 and stats.ranks_with_backward == 1 and stats.ranks_unreduced == 0
    assert stats.used_counts == [1.0, 0.0, 1.0]
    assert stats.orders_agree and stats.fetches_agree


def test_a_mixed_gather_count_breaks_the_gather_agreement():
    mixed = torch.ones(1, dtype=torch.float64)
    stats = gather_stats(_values(mixed_gathers=mixed), torch.device("cpu"), world=1, rank=0)
    assert not stats.fetches_agree and stats.orders_agree
