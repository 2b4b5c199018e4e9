"""ctxext's sliding-window perplexity as a Hugging Face `evaluate` module: what `ctxext eval` computes.

import evaluate
from ctxext.tasks.perplexity import evaluate_module_path

perplexity = evaluate.load(evaluate_module_path())
perplexity.compute(predictions=texts, model="path/to/model", window=4096, stride=256,
                   method={"method": "yarn", "factor": 2})
"""

import datasets
import evaluate

from ctxext.tasks.perplexity import texts_perplexity

_DESCRIPTION = """Sliding-window perplexity (Press et al.; the Hugging Face docs' loop), per ctxext's protocol:
windows of `window` tokens advance by `stride`; each token is scored once; exp(token-weighted mean NLL) over all
documents; documents are evaluated separately and one shorter than the window is skipped (short_docs='skip') or
scored in one shorter window ('truncate'); BOS starts each window when the tokenizer adds one. The same code as
`ctxext eval`, so the numbers are the same."""

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): the texts, one document each.
    model: a checkpoint path or hub id, or a loaded transformers model (then pass `tokenizer`).
    tokenizer: the tokenizer of a loaded model.
    window (int): the window (evaluated context) in tokens.
    stride (int or 'window'): how far each window advances (default 256); 'window': one pass per document.
    method (str or dict, optional): a ctxext method to patch in, e.g. {"method": "yarn", "factor": 2}.
    bos ('auto', 'yes', 'no'), short_docs ('skip', 'truncate'), device, dtype, attn_implementation: as in ctxext eval.
Returns:
    perplexity, mean_nll, nll_sum, tokens_scored, windows, documents, documents_skipped.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class EvaluatePerplexity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string")}),
            reference_urls=["https://huggingface.co/docs/transformers/perplexity"],
        )

    def _compute(
        self,
        predictions,
        model,
        window,
        tokenizer=None,
        stride=256,
        method=None,
        bos="auto",
        short_docs="skip",
        device="auto",
        dtype="auto",
        attn_implementation="auto",
    ):
        return texts_perplexity(
            list(predictions),
            model,
            tokenizer,
            window=window,
            stride=stride,
            method=method,
            bos=bos,
            short_docs=short_docs,
            device=device,
            dtype=dtype,
            attn_implementation=attn_implementation,
        )
