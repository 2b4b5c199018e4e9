"""Long-context tasks from lm-evaluation-harness (RULER, LongBench v2, babilong, ...) under ctxext's methods, and
ctxext's perplexity as an `evaluate` module.

`ctxext.tasks.harness` runs lm-eval on a model patched in memory (lm-eval is the optional extra
`ctxext[tasks]`, imported only there); `ctxext.tasks.report` writes the side-by-side tables and heat map;
`evaluate.load(evaluate_module_path())` computes what `ctxext eval` computes (`texts_perplexity`);
`run_tasks(TasksRequest(...))` is what `ctxext tasks` runs (ctxext.tasks.workflow).
"""

from .perplexity import evaluate_module_path, texts_perplexity
from .workflow import TasksRequest, TasksResult, run_tasks

__all__ = ["TasksRequest", "TasksResult", "evaluate_module_path", "run_tasks", "texts_perplexity"]
