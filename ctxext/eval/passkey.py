"""Passkey retrieval in the Landmark / YaRN format (docs/METHODS.md, "Passkey retrieval").

A task line, filler, "The pass key is K. Remember it. K is the pass key.", more filler, then
"What is the pass key? The pass key is". Greedy decoding of 10 new tokens; a trial succeeds when the first
integer in the output equals K (a random integer from 1 to 50000).

`depth` places the key line: 0 = straight after the task line, 1 = just before the question.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch
from torch import nn

from ..dispatch import input_device
from ..errors import CtxextError
from ..runtime import Processes
from .perplexity import evaluation_mode

TASK = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there."
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION = "What is the pass key? The pass key is"
NEW_TOKENS = 10
KEY_RANGE = (1, 50000)


def key_line(key: int) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key."


def prompt_text(n_filler: int, depth: float, key: int) -> str:
    before = round(depth * n_filler)
    return "\n".join(
        [TASK, " ".join([FILLER] * before), key_line(key), " ".join([FILLER] * (n_filler - before)), QUESTION]
    )


def first_integer(text: str) -> int | None:
    found = re.search(r"\d+", text)
    return int(found.group()) if found else None


def is_correct(output: str, key: int) -> bool:
    """The scorer: the first integer in the model's output is the key."""
    return first_integer(output) == key


def build_prompt(tokenizer, length: int, depth: float, key: int, bos_token_id: int | None = None) -> torch.Tensor:
    """Token ids of the longest prompt (whole filler sentences) that fits in `length` tokens, BOS included."""
    if not 0.0 <= depth <= 1.0:
        raise CtxextError(f"depth must be between 0 and 1, got {depth}")
    extra = 1 if bos_token_id is not None else 0

    def count(n: int) -> int:
        return len(tokenizer(prompt_text(n, depth, key), add_special_tokens=False).input_ids) + extra

    fixed = count(0)
    per_filler = (count(20) - count(10)) / 10
    if fixed + per_filler > length:
        raise CtxextError(f"a passkey prompt needs more than {length} tokens; use a longer --lengths value")
    n = int((length - fixed) // per_filler)
    while n > 0 and count(n) > length:
        n -= 1
    ids = tokenizer(prompt_text(n, depth, key), add_special_tokens=False).input_ids
    if bos_token_id is not None:
        ids = [bos_token_id] + ids
    return torch.tensor(ids, dtype=torch.long)


@dataclass(frozen=True)
class Trial:
    length: int
    depth: float
    index: int
    key: int


def plan_trials(lengths: list[int], depths: list[float], trials: int, seed: int = 0) -> list[Trial]:
    """`trials` keys per (length, depth) cell; the same keys for every method (seeded)."""
    rng = random.Random(seed)
    return [
        Trial(length, depth, i, rng.randint(*KEY_RANGE))
        for length in lengths
        for depth in depths
        for i in range(trials)
    ]


def answer_nll(model: nn.Module, tokenizer, trial: Trial, bos_token_id: int | None = None) -> tuple[float, int]:
    """(sum of -log p over the answer's tokens, their count) for the prompt of `trial` followed by its answer
    " K.": needle-driven perplexity (LongRoPE2), one forward pass, no generation. Prompt and answer together fill
    `trial.length` tokens."""
    answer = tokenizer(f" {trial.key}.", add_special_tokens=False).input_ids
    prompt = build_prompt(tokenizer, trial.length - len(answer), trial.depth, trial.key, bos_token_id)
    ids = torch.cat([prompt, torch.tensor(answer, dtype=torch.long)])[None]
    device = input_device(model)
    with evaluation_mode(model), torch.inference_mode():
        # the logits at the last len(answer) + 1 positions; all but the last predict the answer's tokens
        logits = model(ids.to(device), logits_to_keep=len(answer) + 1, use_cache=False).logits[0, :-1]
        nll = torch.nn.functional.cross_entropy(logits.double(), ids[0, -len(answer) :].to(device), reduction="sum")
    return float(nll), len(answer)


def generate_answer(model: nn.Module, tokenizer, prompt: torch.Tensor) -> str:
    """Greedy decoding of NEW_TOKENS tokens after the prompt, decoded to text."""
    device = input_device(model)
    inputs = prompt.to(device).unsqueeze(0)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    output = model.generate(
        inputs,
        attention_mask=torch.ones_like(inputs),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        num_beams=1,
        pad_token_id=pad,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    return tokenizer.decode(output[0, inputs.shape[1] :], skip_special_tokens=True)


def run_passkey(
    model: nn.Module, tokenizer, trials: list[Trial], methods, bos_token_id: int | None, processes=None, progress=None
) -> list[dict]:
    """One record per (method, trial): key, depth, length, prompt tokens, output, correct. Same on every process."""
    processes = processes or Processes()
    prompts = {}
    records = []
    for method in methods:
        method.apply(model)
        try:
            with evaluation_mode(model):
                mine = []
                for index in range(processes.rank, len(trials), processes.world_size):
                    trial = trials[index]
                    if progress is not None:
                        progress.set_description(f"{method.label} @ {trial.length}")
                    key = (trial.length, trial.depth, trial.key)
                    if key not in prompts:
                        prompts[key] = build_prompt(tokenizer, trial.length, trial.depth, trial.key, bos_token_id)
                    answer = generate_answer(model, tokenizer, prompts[key])
                    mine.append(
                        {
                            "method": method.label,
                            "trial": index,
                            "length": trial.length,
                            "depth": trial.depth,
                            "key": trial.key,
                            "prompt_tokens": len(prompts[key]),
                            "output": answer,
                            "correct": is_correct(answer, trial.key),
                        }
                    )
                    if progress is not None:
                        progress.update(1)
                records += sorted(processes.gather(mine), key=lambda r: r["trial"])
        finally:
            method.remove(model)
    return records


def accuracy_rows(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """(per method x length x depth, per method x length) accuracies."""
    cells: dict[tuple, list[bool]] = {}
    for r in records:
        cells.setdefault((r["method"], r["length"], r["depth"]), []).append(r["correct"])
        cells.setdefault((r["method"], r["length"], None), []).append(r["correct"])
    by_depth, by_length = [], []
    for (method, length, depth), outcomes in cells.items():
        row = {
            "method": method,
            "length": length,
            "trials": len(outcomes),
            "correct": sum(outcomes),
            "accuracy": sum(outcomes) / len(outcomes),
        }
        (by_length if depth is None else by_depth).append(row if depth is None else {**row, "depth": depth})
    return by_depth, by_length
