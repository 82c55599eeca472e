"""What the pilots share: their report files."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable


def write_pilot_report(out: Path, name: str, report: dict, render: Callable[[dict], str], *,
                       json_too: bool = True) -> None:
    """Write a pilot's report ``report`` to ``out``: ``<name>.json`` (unless not ``json_too``: a report read back from
    it, only re-rendered) and its markdown ``render(report)`` to ``<name>.md``, which is also printed. The pilots'
    common report shape."""
    if json_too:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    (out / f"{name}.md").write_text(render(report))
    print(render(report))


def write_json_report(out: Path, report: dict, render: Callable[[dict], str], *, echo: object = None) -> None:
    """Write ``report`` to the JSON file ``out`` (``default=float``, a final newline) and ``render(report)`` beside it
    (``out`` with ``.md``); print ``echo`` if given, else the markdown. The language and MiniLM pilots' shape."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=float) + "\n")
    md = render(report)
    out.with_suffix(".md").write_text(md)
    print(md if echo is None else echo)
