"""The join's undo, which a sharded evaluation uses when a peer fails a micro-batch this rank already joined."""

from __future__ import annotations

import torch

from memguard.guard._evaluate import _Joiner


def _out(n: int, start: int) -> dict:
    rows = torch.arange(start, start + n, dtype=torch.float32)
    # a per-sample tensor (joined in place), a 0-dim mean (summed with weights), a tensor whose dim 0 is not a
    # multiple of the samples (kept per piece), a constant
    return {"pred": rows * 2, "loss": rows.mean(), "odd": torch.ones(1) * start, "tag": "x"}


def test_restore_undoes_an_add_so_that_the_retry_gives_the_unsplit_result() -> None:
    whole = _out(8, 0)
    joiner = _Joiner(8)
    snap = joiner.snapshot()
    joiner.add(_out(4, 0), 0, 4, 4)
    joiner.restore(snap)  # the first micro-batch failed on a peer: as if nothing was joined
    assert joiner.structure is None and not joiner.sums and not joiner.pieces
    joiner.add(_out(4, 0), 0, 4, 4)
    snap = joiner.snapshot()
    joiner.add(_out(4, 4), 4, 8, 4)
    joiner.restore(snap)  # the second failed on a peer; the retry runs it as two halves
    joiner.add(_out(2, 4), 4, 6, 2)
    joiner.add(_out(2, 6), 6, 8, 2)
    got = joiner.result()
    torch.testing.assert_close(got["pred"], whole["pred"])
    # the mean of 0..7 from the micro-batches' means weighted by their samples (4, 2, 2), once each
    torch.testing.assert_close(got["loss"], whole["loss"])
    # one piece per micro-batch that was kept: 0, 4, 6 (the undone 4 dropped)
    torch.testing.assert_close(got["odd"], torch.tensor([0.0, 4.0, 6.0]))
    assert got["tag"] == "x"
