"""Long-context tasks from lm-evaluation-harness (RULER, LongBench v2, babilong, ...) under ctxext's methods.

`ctxext.tasks.harness` runs lm-eval on a model patched in memory (lm-eval is the optional extra
`ctxext[tasks]`, imported only there); `ctxext.tasks.report` writes the side-by-side tables and heat map.
"""
