"""Result rows to disk: a JSON list and a CSV with the same stem, and plots (matplotlib on the Agg backend)."""
from __future__ import annotations

import csv
import json
import os
import sys
from typing import List


def write_rows(rows: List[dict], path: str) -> None:
    """Write ``rows`` to ``path`` (JSON, a list of dicts) and to the ``.csv`` next to it (the union of the keys)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(os.path.splitext(path)[0] + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path} (+ .csv)", file=sys.stderr)


def pyplot():
    """``matplotlib.pyplot`` drawing to files only (the Agg backend); ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bar_png(labels: List[str], values: List[float], ylabel: str, title: str, path: str) -> None:
    """One bar chart (``values`` per ``label``) saved to ``path``."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(labels)), 3.2))
    ax.bar(labels, values)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)
