"""Writes the `ctxext tasks` sweep (`--config`) of the comparison page's needle-ppl rows at one length: the
parameters each needle-ppl search found, read from the page's comparison.json, so that RULER's needle can be
asked of exactly what the page scored (issue 24: "the needle-ppl searches recover passkey, RULER niah_single_1
too"). A row whose search at that length is not finished is left out, and said so on stderr; none at all is
exit 1.

    python3 scripts/device/needle_sweep.py docs/comparison.json 32768 leaky_rerope,dual_chunk,rerope sweep.yaml
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml


def is_needle_row(row: dict) -> bool:
    """A row searched with the objective needle-ppl (the page's `objective`; pages before it said `kind: needle`)."""
    return row.get("objective") == "needle-ppl" or row.get("kind") == "needle"


def needle_configs(page: dict, length: int, methods: list[str]) -> list[dict]:
    """The method configs of the needle-ppl rows of `methods` at `length`, in the page's row order."""
    configs = []
    for row in page["rows"]:
        if not is_needle_row(row) or row["method"] not in methods:
            continue
        config = row["configs"].get(str(length))
        if config is None:
            print(f"needle_sweep: {row['label']} has no parameters at {length} yet: left out", file=sys.stderr)
        else:
            configs.append(config)
    return configs


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    page_file, length, methods, output = argv
    configs = needle_configs(json.loads(Path(page_file).read_text()), int(length), methods.split(","))
    if not configs:
        print(f"needle_sweep: no needle-ppl row of {methods} has parameters at {length}", file=sys.stderr)
        return 1
    header = f"# the needle-ppl rows of {page_file} at {length} ({methods}), written by {Path(__file__).name}\n"
    Path(output).write_text(header + yaml.safe_dump({"methods": configs}, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
