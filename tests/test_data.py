"""Tests of ``memguard.data``: scanning a dataset's lengths without loading it, and the worst-case batch."""

from __future__ import annotations

import itertools
import weakref

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from memguard.data import (
    ITERABLE_SCAN_LIMIT,
    max_batch_shape,
    planning_batch,
    scan_lengths,
    worst_case_batch,
    worst_case_loader_batch,
)
from memguard.errors import ConfigError

LENGTHS = [5, 17, 3, 40, 8, 40, 12, 1]  # the longest, 40, first at index 3


class CountingDataset(Dataset):
    """Token-id samples of LENGTHS; counts reads and how many earlier samples are still alive at each read."""

    def __init__(self, lengths=LENGTHS) -> None:
        self.lengths = list(lengths)
        self.reads: list[int] = []
        self._alive: weakref.WeakSet = weakref.WeakSet()
        self.most_alive = 0

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        self.most_alive = max(self.most_alive, len(self._alive))
        self.reads.append(i)
        ids = torch.arange(self.lengths[i]) % 7 + 1
        self._alive.add(ids)
        return {"input_ids": ids, "labels": ids.clone()}


class Table:
    """A ``datasets.Dataset``-like table: ``column_names``, ``table[column]``, ``table[row]``,
    ``select_columns`` and ``iter(batch_size=)``; counts row reads and chunk reads."""

    def __init__(self, columns: dict) -> None:
        self.columns = columns
        self.row_reads = 0
        self.chunks: list[int] = []

    @property
    def column_names(self) -> list[str]:
        return list(self.columns)

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, k):
        if isinstance(k, str):
            return self.columns[k]
        self.row_reads += 1
        return {c: v[k] for c, v in self.columns.items()}

    def select_columns(self, names):
        sub = Table({n: self.columns[n] for n in names})
        sub.chunks = self.chunks
        return sub

    def iter(self, batch_size: int):
        for start in range(0, len(self), batch_size):
            self.chunks.append(min(batch_size, len(self) - start))
            yield {c: v[start:start + batch_size] for c, v in self.columns.items()}


def test_map_style_reads_each_sample_once_and_never_holds_two():
    ds = CountingDataset()
    scan = scan_lengths(ds)
    assert (scan.max_length, scan.index, scan.count, scan.complete) == (40, 3, len(LENGTHS), True)
    assert ds.reads == list(range(len(LENGTHS)))  # one pass, each index once
    assert ds.most_alive == 0  # every sample was dropped before the next was read: no full load
    assert "all 8 samples" in scan.describe()


def test_lengths_column_reads_no_sample():
    ids = [[1] * n for n in LENGTHS]
    table = Table({"input_ids": ids, "length": LENGTHS})
    scan = scan_lengths(table)
    assert scan.max_length == 40 and scan.complete
    assert table.row_reads == 0 and table.chunks == []  # the lengths column alone was read
    assert "'length'" in scan.source


def test_token_column_is_read_in_chunks_not_rows():
    ids = [[1] * (n % 97) for n in range(2500)]  # longest: 96 tokens
    table = Table({"input_ids": ids, "text": ["x"] * 2500})
    scan = scan_lengths(table)
    assert scan.max_length == 96 and scan.count == 2500
    assert table.row_reads == 0
    assert table.chunks == [1000, 1000, 500]  # _CHUNK rows at a time: at most 1000 rows in memory


def test_explicit_lengths_and_limit():
    scan = scan_lengths(None, lengths=LENGTHS, limit=3)
    assert (scan.max_length, scan.count, scan.complete) == (17, 3, False)


def test_iterable_scan_is_bounded():
    class Endless(IterableDataset):
        def __iter__(self):
            for i in itertools.count():
                yield torch.zeros(i % 50)

    scan = scan_lengths(Endless(), limit=200)
    assert (scan.max_length, scan.count, scan.complete) == (49, 200, False)
    scan = scan_lengths(iter(torch.zeros(n) for n in itertools.count()))  # no limit: the default bound
    assert scan.count == ITERABLE_SCAN_LIMIT and not scan.complete


def pad_collate(multiple: int):
    def collate(samples):
        n = max(len(s["input_ids"]) for s in samples)
        n = -(-n // multiple) * multiple  # a collator's pad_to_multiple_of
        ids = torch.zeros(len(samples), n, dtype=torch.long)
        mask = torch.zeros(len(samples), n, dtype=torch.long)
        for i, s in enumerate(samples):
            ids[i, : len(s["input_ids"])] = s["input_ids"]
            mask[i, : len(s["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask}

    return collate


def test_loader_worst_batch_follows_the_collate_padding():
    loader = DataLoader(CountingDataset(), batch_size=4, collate_fn=pad_collate(16))
    # longest sample 40 padded by the loader's collate to a multiple of 16: 48
    assert max_batch_shape(loader) == {"seq_len": 48}
    worst = worst_case_loader_batch(loader)
    assert worst["input_ids"].shape == (4, 48) and int(worst["attention_mask"].sum()) == 4 * 40


def test_iterable_loader_scans_padded_batches():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(CountingDataset()[i] for i in range(len(LENGTHS)))

    loader = DataLoader(Stream(), batch_size=2, collate_fn=pad_collate(8))
    scan = scan_lengths(loader)
    assert scan.max_length == 40 and scan.count == 4  # 4 batches, the longest padded to 40


def test_max_batch_shape_of_a_dataset_rounds_to_multiple():
    assert max_batch_shape(CountingDataset(), pad_to_multiple_of=64) == {"seq_len": 64}


def hf_batch(b=2, s=16):
    return {
        "input_ids": torch.arange(b * s).reshape(b, s) % 11,
        "attention_mask": torch.ones(b, s, dtype=torch.long),
        "mask4d": torch.ones(b, 1, s, s, dtype=torch.bool),
        "pixel_values": torch.randn(b, 3, 8, 8),
        "scale": torch.tensor(2.0),
    }


def test_worst_case_batch_seq_len_follows_every_sequence_dim():
    worst = worst_case_batch(hf_batch(), {"seq_len": 64})
    assert worst["input_ids"].shape == (2, 64) and worst["input_ids"].device.type == "meta"
    assert worst["attention_mask"].shape == (2, 64)
    assert worst["mask4d"].shape == (2, 1, 64, 64)  # both sequence dims of a 4-D mask
    assert worst["pixel_values"].shape == (2, 3, 8, 8)  # no dim of size 16: untouched
    assert worst["scale"].shape == ()  # non-batch leaves pass through


def test_worst_case_batch_per_entry_and_materialized_values():
    b = hf_batch()
    worst = worst_case_batch(b, {"seq_len": 40, "pixel_values": (3, 32, 32)}, materialize=True)
    assert worst["pixel_values"].shape == (2, 3, 32, 32) and worst["pixel_values"].device.type == "cpu"
    # values repeat the example's cyclically: token ids stay in the vocabulary, masks stay 0/1
    assert torch.equal(worst["input_ids"][:, 16:32], b["input_ids"])
    assert set(worst["attention_mask"].unique().tolist()) == {1}


def test_worst_case_batch_tuple_entries():
    x, y = torch.randn(4, 10, 3), torch.randn(4)
    wx, wy = worst_case_batch((x, y), {0: (20, 3)})
    assert wx.shape == (4, 20, 3) and wy.shape == (4,)


def test_bad_max_shape_lists_every_problem():
    with pytest.raises(ConfigError) as info:
        worst_case_batch(hf_batch(), {"seq_len": 0, "pixels": (3,), "pixel_values": (3, 8)})
    text = str(info.value)
    assert "positive int" in text and "'pixels'" in text and "non-batch dims" in text


def test_planning_batch_says_which_shape():
    worst, reason = planning_batch(hf_batch(), {"seq_len": 64})
    assert worst["input_ids"].shape == (2, 64)
    assert "seq_len=64" in reason and "input_ids (64,)" in reason and "input_ids (16,)" in reason
    assert planning_batch(hf_batch(), None)[1] is None


def test_unreadable_samples_say_what_to_pass():
    with pytest.raises(ConfigError, match="key="):
        scan_lengths([{"ids": torch.zeros(3)}])
    assert scan_lengths([{"ids": torch.zeros(3)}], key="ids").max_length == 3
    assert scan_lengths([{"ids": torch.zeros(3)}], length_fn=lambda s: 99).max_length == 99


def test_planning_batch_is_stable_for_the_same_batch():
    # a planner reused across plan calls compares batches by identity: the same example batch and
    # max_shape must give the very same worst-case batch
    b = hf_batch()
    assert planning_batch(b, {"seq_len": 32})[0] is planning_batch(b, {"seq_len": 32})[0]
    assert planning_batch(b, {"seq_len": 32})[0] is not planning_batch(b, {"seq_len": 64})[0]
