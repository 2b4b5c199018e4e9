"""`ctxext compare`: every method that applies to a model, at its defaults and searched within a budget, against
the model's native quality on held-out text, with passkey retrieval, cost, and a recommendation per serving target.

    from ctxext.compare import CompareRequest, run_compare

    result = run_compare(CompareRequest(model="./model", lengths=[16384, 32768], output="out", data=...))
    result.results["recommendations"]["vllm"]
"""

from .ranking import RANKING_RULE, RowNumbers, needle_tier, rank_rows, recommend
from .request import CompareRequest, parse_budget, parse_methods
from .workflow import CompareResult, run_compare

__all__ = [
    "RANKING_RULE",
    "CompareRequest",
    "CompareResult",
    "RowNumbers",
    "needle_tier",
    "parse_budget",
    "parse_methods",
    "rank_rows",
    "recommend",
    "run_compare",
]
