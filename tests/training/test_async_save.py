"""`train.async_save` in a training run (two ranks: the wait for a completion is collective), from the
two-rank suite's `zero1_async` layout beside its `zero1` one: the same losses bit for bit, and
checkpoints as complete as a synchronous run's. The save-and-resume check itself runs for every layout
in `test_pretrain.py`."""

from __future__ import annotations


def test_async_save_trains_as_the_synchronous_run_and_completes_its_checkpoints(two_rank_results):
    for rank in (0, 1):
        plain = two_rank_results[rank]["layouts"]["zero1"]
        background = two_rank_results[rank]["layouts"]["zero1_async"]
        assert background["full"] == plain["full"]  # bit for bit
        assert background["resumed"] == plain["resumed"]
    verified = two_rank_results[0]["layouts"]["zero1_async"]["verified"]
    assert verified == {"iter_0000002": [], "iter_0000004": []}  # complete markers, every checksum right
    assert two_rank_results[0]["layouts"]["zero1"]["verified"] == verified
