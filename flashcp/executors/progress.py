"""Progress of long loops: a tqdm bar on stderr while a terminal watches, nothing otherwise.

Every long loop of the harness (``executor=sim``'s chunks, ``executor=emulate``'s replays, the
ILP solves of ``flashcp-table2``) counts its items here, per sequence. The bar shows only when a
label is given (the commands pass none under ``progress=false``) and stderr is a terminal, so
logs and CI output stay clean; tqdm is then not even imported (the GPU machine's image runs the
executors without it).
"""

from __future__ import annotations

import contextlib
import sys

__all__ = ["progress_bar"]


class _NoBar(contextlib.nullcontext):
    """The stand-in of a bar nobody sees: ``update`` does nothing."""

    def __enter__(self) -> _NoBar:
        return self

    def update(self, n: int = 1) -> None:
        pass


def progress_bar(total: int, label: str | None, unit: str = "seq"):
    """A context manager with ``update(n)``: a tqdm bar of ``total`` ``unit`` on stderr when
    ``label`` is given and stderr is a terminal (left behind: no; cleared when done), else a
    no-op.

    Args:
        total: items the loop will count (e.g. sequences x modes); label: the bar's title, None
            for no bar; unit: the items' name.
    """
    if label is None or not sys.stderr.isatty():
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit=unit, leave=False, file=sys.stderr)
