"""Evaluation: sliding-window perplexity (docs/METHODS.md protocol), passkey retrieval, data loading, reports."""

from .perplexity import Window, perplexity, plan_windows, sliding_window_nll, window_nll

__all__ = ["Window", "perplexity", "plan_windows", "sliding_window_nll", "window_nll"]
