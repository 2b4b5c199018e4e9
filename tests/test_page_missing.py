"""The comparison page's list of what it lacks names each row by its label: two searched rows of one method (a
perplexity search and a needle-ppl search) are told apart, so a computed row is never listed as not started."""

from dataclasses import dataclass, field
from types import SimpleNamespace

from ctxext.compare.page import page_missing


@dataclass
class Row:
    label: str
    method: str
    kind: str
    configs: dict
    pending: dict = field(default_factory=dict)


def test_a_pending_search_is_listed_by_its_rows_label():
    done = Row("gali (searched)", "gali", "searched", {16384: {"method": "gali"}})
    pending = Row("gali (searched, needle-ppl)", "gali", "searched", {16384: None}, {16384: "not started"})
    measured = SimpleNamespace(
        native={("doc", 16384): {}}, passkey={}, failed={}, perplexity={("gali (searched)", "doc", 16384): {}}
    )
    missing = page_missing([done, pending], measured, ["doc"], [16384], [], L=8192)
    assert missing == ["search: gali (searched, needle-ppl) at 16384 (not started)"]
