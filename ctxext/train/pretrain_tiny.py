"""A tiny LLaMA pretrained on Shakespeare at a short context: the base model of the miniature PI experiment.

    path = tiny_shakespeare_checkpoint()     # builds once (about 10-20 min on 2 CPU cores), then cached

The build is deterministic for its settings: the same seed gives the same tokenizer, the same batches and
the same weights. Two plays (Othello and Macbeth by default) are held out of both the tokenizer and the
model, so that the miniature experiment can measure perplexity on text the model has never seen. The
First Folio duplicates (`*_gut_f`) are left out everywhere, so no play leaks in under another spelling.

The checkpoint directory holds a plain LlamaForCausalLM (config.json + safetensors), its BPE tokenizer
(a PreTrainedTokenizerFast), and `pretrain.json` (the settings and the loss curve).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from .. import assets
from ..errors import CtxextError, did_you_mean
from ..outputs import write_json
from ..runtime import resolve_device, training_precision

HELD_OUT_PLAYS = ("othello_gut", "macbeth_gut")
END_OF_TEXT = "<|endoftext|>"
TINY_MODEL_PREFIX = "ctxext:"  # recipes name the tiny model "ctxext:tiny-shakespeare"


@dataclass(frozen=True)
class TinyPretrainSettings:
    """Everything the tiny model depends on; the cache directory name is a hash of these values."""

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 704  # about 8/3 x hidden, as in LLaMA
    num_layers: int = 4
    num_heads: int = 4  # head_dim 64, like LLaMA
    context: int = 256  # L: the pre-training context the experiment extends
    rope_theta: float = 10000.0
    steps: int = 1200
    batch_size: int = 16
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 50
    weight_decay: float = 0.1
    seed: int = 0
    held_out: tuple[str, ...] = HELD_OUT_PLAYS
    precision: str = "auto"  # auto: bf16 autocast where the CPU/GPU has native bf16, else fp32

    def key(self) -> str:
        data = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(data).hexdigest()[:10]


TINY_PRESETS = {"tiny-shakespeare": TinyPretrainSettings()}


def training_texts(held_out: tuple[str, ...]) -> list[tuple[str, str]]:
    """(stem, text) of every modern-spelling Shakespeare text except the held-out ones, sorted by name."""
    folder = assets.shakespeare_dir()
    stems = sorted(p.stem for p in folder.glob("*.txt") if not p.stem.endswith("_f"))
    missing = [name for name in held_out if name not in stems]
    if missing:
        raise CtxextError(f"held-out text '{missing[0]}' is not a Shakespeare text{did_you_mean(missing[0], stems)}")
    return [(stem, (folder / f"{stem}.txt").read_text(encoding="utf-8")) for stem in stems if stem not in held_out]


def train_bpe_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE (GPT-2 style, so every string is encodable) wrapped as a PreTrainedTokenizerFast."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(texts, trainer)
    # No BOS: like SmolLM2, texts are not prefixed; documents are separated by end-of-text.
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=END_OF_TEXT, pad_token=END_OF_TEXT, model_max_length=10**9
    )


def tiny_llama_config(settings: TinyPretrainSettings, eos_token_id: int):
    return LlamaConfig(
        vocab_size=settings.vocab_size,
        hidden_size=settings.hidden_size,
        intermediate_size=settings.intermediate_size,
        num_hidden_layers=settings.num_layers,
        num_attention_heads=settings.num_heads,
        num_key_value_heads=settings.num_heads,
        head_dim=settings.hidden_size // settings.num_heads,
        max_position_embeddings=settings.context,
        rope_theta=settings.rope_theta,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        attn_implementation="sdpa",
    )


def token_stream(texts: list[str], tokenizer) -> torch.Tensor:
    """All texts as one 1-D stream, each followed by end-of-text."""
    ids = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False, verbose=False).input_ids)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def cosine_lr(step: int, settings: TinyPretrainSettings) -> float:
    """Linear warm-up to lr, then cosine decay to min_lr at the last step."""
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - 1 - settings.warmup_steps)
    return settings.min_lr + 0.5 * (settings.lr - settings.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def pretrain(settings: TinyPretrainSettings, output: Path, progress: bool = True) -> dict:
    """Train the tokenizer and the model from scratch and save both to `output` (an existing empty dir)."""
    import resource  # noqa: PLC0415 -- Unix only: the module stays importable on Windows

    started = time.perf_counter()
    cpu_started = resource.getrusage(resource.RUSAGE_SELF)
    texts = training_texts(settings.held_out)
    tokenizer = train_bpe_tokenizer([text for _, text in texts], settings.vocab_size)
    stream = token_stream([text for _, text in texts], tokenizer)

    torch.manual_seed(settings.seed)
    model = LlamaForCausalLM(tiny_llama_config(settings, tokenizer.eos_token_id))
    device = resolve_device("auto")
    model.to(device).train()
    bf16 = training_precision(settings.precision, device, sharded=False) != "fp32"  # autocast over fp32 weights
    losses = train_from_scratch(model, stream, settings, device, bf16, progress)
    model.eval()
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    record = {
        "what": "tiny LLaMA pretrained on Shakespeare by ctxext.train.pretrain_tiny",
        "settings": dataclasses.asdict(settings),
        "training_texts": [stem for stem, _ in texts],
        "training_tokens": len(stream),
        "tokens_seen": settings.steps * settings.batch_size * settings.context,
        "bf16_autocast": bf16,
        "torch_threads": torch.get_num_threads(),
        "seconds": round(time.perf_counter() - started, 1),
        "cpu_seconds": round(_cpu_seconds_since(cpu_started), 1),  # wall time depends on other jobs; this less so
        "loss_every_step": losses,
    }
    write_json(output / "pretrain.json", record)
    return record


def train_from_scratch(model, stream: torch.Tensor, settings: TinyPretrainSettings, device, bf16: bool, progress):
    """AdamW with the cosine schedule on random windows of the stream; returns the loss of every step."""
    # Weight decay on matrices only (not on norms), as nanoGPT does.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr,
        betas=(0.9, 0.95),
    )
    # Random windows of the stream, drawn from a seeded generator: the same batches on every run.
    generator = torch.Generator().manual_seed(settings.seed)
    starts_max = len(stream) - settings.context
    losses = []
    bar = tqdm(range(settings.steps), desc="pretraining tiny LLaMA", disable=not progress, mininterval=5)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, settings)
        starts = torch.randint(0, starts_max, (settings.batch_size,), generator=generator)
        batch = torch.stack([stream[s : s + settings.context] for s in starts.tolist()]).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 4))
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    return losses


def _cpu_seconds_since(start) -> float:
    import resource  # noqa: PLC0415 -- Unix only: the module stays importable on Windows

    now = resource.getrusage(resource.RUSAGE_SELF)
    return (now.ru_utime - start.ru_utime) + (now.ru_stime - start.ru_stime)


def tiny_shakespeare_checkpoint(settings: TinyPretrainSettings | None = None, progress: bool = True) -> Path:
    """The cached checkpoint for `settings` (default: the 'tiny-shakespeare' preset), built if missing."""
    settings = settings or TINY_PRESETS["tiny-shakespeare"]
    target = assets.cache_dir() / f"tiny-llama-shakespeare-{settings.key()}"
    if (target / "config.json").is_file():
        return target
    print(f"ctxext: pretraining the tiny Shakespeare LLaMA once; it is cached in {target}", flush=True)
    with assets._building(target) as scratch:
        record = pretrain(settings, scratch, progress=progress)
    print(
        f"ctxext: pretrained in {record['seconds']:.0f} s (final loss {record['loss_every_step'][-1]:.3f})", flush=True
    )
    return target


def resolve_model_name(name: str) -> str:
    """'ctxext:tiny-shakespeare' -> the cached checkpoint's path; any other name is returned as is."""
    if not name.startswith(TINY_MODEL_PREFIX):
        return name
    preset = name.removeprefix(TINY_MODEL_PREFIX)
    if preset not in TINY_PRESETS:
        raise CtxextError(
            f"unknown built-in model '{name}'{did_you_mean(preset, TINY_PRESETS)}; "
            f"built-in models: {', '.join(TINY_MODEL_PREFIX + p for p in TINY_PRESETS)}"
        )
    return str(tiny_shakespeare_checkpoint(TINY_PRESETS[preset]))


if __name__ == "__main__":
    print(tiny_shakespeare_checkpoint())
