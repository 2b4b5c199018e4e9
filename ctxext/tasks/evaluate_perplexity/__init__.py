"""The `evaluate` module folder: `evaluate.load(ctxext.tasks.perplexity.evaluate_module_path())`."""
