"""The "Faults injected" table of docs/reliability.md, from the fault suite's own results.

``PARALLELCTX_FAULT_RESULTS=docs/reliability_faults.json make test-faults`` records, for every
fault tests/test_faults.py injects, the time to the error and the message a user sees;
``python tests/fault_table.py`` prints the table from that file, and
``tests/test_reliability_doc.py`` fails when the page no longer shows it.
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "reliability_faults.json"


def table(path: Path = RESULTS) -> str:
    """Return the markdown table of the recorded fault results."""
    rows = json.loads(path.read_text())
    lines = [
        "| fault (dist.timeout 6 s unless said) | time to the error | what the user sees |",
        "| --- | --- | --- |",
    ]
    for row in rows:
        message = " ".join(row["message"].split()).replace("|", "\\|")
        if len(message) > 400:
            message = message[:400] + " ..."
        lines.append(f"| {row['fault']} | {row['seconds']:.1f} s | `{message}` |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table(), end="")
