"""Fixed-length windows over a (memory-mapped) token stream, made batch by batch.

Window i covers tokens [start + i*L, start + i*L + L]: inputs are its first L tokens, targets the
last L, so consecutive windows overlap by one token and every token but the first is a target once.
Each token carries its document's number as a segment id; a target whose token starts another
document is IGNORE_INDEX, so no document predicts the next one's first token, and the model keeps
attention (and rotary positions) inside each document through the segment ids.

Only the rows a batch needs are read and widened to int64: a corpus of billions of tokens stays
on disk as uint16/uint32.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from .loader import Batch, ShardedLoader

IGNORE_INDEX = -100  # rptrain.models.IGNORE_INDEX


class TokenWindows:
    def __init__(self, tokens: np.ndarray, doc_starts: np.ndarray, start: int, end: int, seq_len: int) -> None:
        self.tokens, self.doc_starts, self.start, self.seq_len = tokens, doc_starts, start, seq_len
        self.num_windows = max(end - start - 1, 0) // seq_len

    def __len__(self) -> int:
        return self.num_windows

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(inputs, targets, segment_ids), each int64 (len(indices), seq_len)."""
        L = self.seq_len
        pos = self.start + indices.numpy()[:, None].astype(np.int64) * L + np.arange(L + 1)
        tok = torch.from_numpy(self.tokens[pos].astype(np.int64))
        doc = torch.from_numpy(np.searchsorted(self.doc_starts, pos, side="right").astype(np.int64))
        targets = tok[:, 1:].masked_fill(doc[:, 1:] != doc[:, :-1], IGNORE_INDEX)
        return tok[:, :-1], targets, doc[:, :-1] - doc[:, :1] + 1  # segment ids 1, 2, ... in each row


class WindowLoader(ShardedLoader):
    """BatchLoader's order, shards and resume over TokenWindows."""

    def __init__(self, windows: TokenWindows, batch_size: int, shuffle: bool = True, drop_last: bool = True,
                 seed: int = 0, rank: int = 0, world_size: int = 1) -> None:
        super().__init__(len(windows), batch_size, shuffle, drop_last, seed, rank, world_size)
        self.windows = windows

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Batch]:
        self._check_start(start_batch)
        order = self.indices(epoch)
        for b in range(start_batch, self.num_batches):
            batch = self.windows.batch(order[b * self.batch_size : (b + 1) * self.batch_size])
            self.current_epoch, self.next_batch = epoch, b + 1
            yield batch
