"""What the benchmarks share: each one's section of ``reports/benchmarks.md`` (between its own
markers, replaced in place or appended once) and a measurement in a fresh spawned process (so
that one model's allocations or threads do not colour the next one's numbers)."""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
from pathlib import Path
from typing import Any, Callable

#: glibc returns every allocation of at least this many bytes to the system when it is
#: freed (a fixed mmap threshold), so that peak RSS is the peak of live memory
LIVE_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def write_section(section: str, start: str, end: str, path: Path) -> None:
    """Replace the text from ``start`` to ``end`` in ``path`` by ``section`` (which begins with
    ``start`` and ends with ``end``); append it after a blank line when ``path`` has no such
    section yet.  Everything outside the markers stays as it is."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    section = section.rstrip("\n")
    if start in text:
        head, rest = text.split(start, 1)
        if end not in rest:
            raise ValueError(f"{path}: {start!r} without its {end!r}; mend the file by hand")
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text, encoding="utf-8")


def in_fresh_process(fn: Callable[..., Any], *args, live: bool = False, **kw) -> Any:
    """``fn(*args, **kw)`` in a spawned process (one worker); ``live``: with :data:`LIVE_ENV`
    set, so that heap fragmentation (freed memory glibc keeps) does not count in peak RSS.
    The environment of this process is restored afterwards."""
    saved = {k: os.environ.get(k) for k in LIVE_ENV}
    try:
        if live:
            os.environ.update(LIVE_ENV)
        with cf.ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
            return pool.submit(fn, *args, **kw).result()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
