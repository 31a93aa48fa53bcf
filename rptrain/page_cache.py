"""Big files written without holding their pages: every ``SYNC_BYTES`` the written part is flushed to disk
and dropped from the page cache. Dirty pages of a 15-100 GB write (a checkpoint, a Hugging Face export)
would otherwise pile up in memory until the kernel writes them back, and in a container they count
against its memory limit: at the end of a run that filled the host, that is a kill with nothing saved.
"""
from __future__ import annotations

import os
from typing import BinaryIO

SYNC_BYTES = 2**30  # written pages are flushed and dropped from the page cache this often


def drop_written(f: BinaryIO, written: int) -> None:
    """Flush ``f``'s first ``written`` bytes to disk and drop them from the page cache."""
    f.flush()
    fd = f.fileno()
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, written, os.POSIX_FADV_DONTNEED)
