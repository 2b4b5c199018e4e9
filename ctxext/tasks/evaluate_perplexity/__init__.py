"""The `evaluate` module folder: `evaluate.load(ctxext.tasks.perplexity.evaluate_module_path())`."""

__all__: list[str] = []  # nothing at the package level: `evaluate` loads evaluate_perplexity.py from this folder
