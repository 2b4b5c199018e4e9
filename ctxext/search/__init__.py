"""`ctxext search`: a method's best parameters on the user's own model, by its perplexity at the target length.

- `space`     the ranges searched: declared next to each parameter (`param(..., search=(low, high, ...))`) or a YAML
- `loop`      TPE (Optuna) over scalar ranges and CMA-ES over LongRoPE's per-pair factors; trials.jsonl; resume
- `longrope`  the starting curve and the monotone knot parametrisation of LongRoPE's factors
- `objective` calibration perplexity, passkey accuracy, or both
- `session`   one search end to end: settings (search.json), trials, held-out re-scoring, results.json, plots

Importing this package is cheap; Optuna and cma (the `search` extra) are imported only when a search runs.
"""
