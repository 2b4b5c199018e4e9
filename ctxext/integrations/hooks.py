"""PEFT's and transformers' adapter save and load, wrapped so that an adapter carries the patch (adapters.py).

Installed by `import ctxext` as soon as transformers is imported (ctxext.registration), beside the rope types and
the load hook; idempotent. Each wrapper calls the original unchanged and only adds ctxext's step:

- `PeftModel.save_pretrained` (what transformers' Trainer, TRL's trainers and ctxext finetune call for a PEFT
  model, for every checkpoint-N/ and the final adapter): after saving, ctxext.yaml beside each adapter's
  adapter_config.json when the base is patched in memory.
- `PeftModel.from_pretrained` (and so every `AutoPeftModelFor*.from_pretrained`): before the adapter goes on, the
  base gets the patch the record beside the adapter names (`carry_patch`; a base that does not match is refused).
- `PeftModel.load_adapter` and transformers' `PreTrainedModel.load_adapter` (which
  `AutoModelForCausalLM.from_pretrained(ADAPTER_DIR)` calls): the same, for an adapter loaded onto a model.

PEFT's mixed models (`PeftMixedModel`) and transformers' own adapter saving (`model.add_adapter` then
`model.save_pretrained`) are not wrapped: an adapter saved that way has no record.
"""

from __future__ import annotations

import functools
import inspect
import os

from peft import PeftModel
from transformers import PreTrainedModel

from .adapters import apply_adapter_record, write_adapter_record

MARK = "_ctxext_adapter_hook"  # on each wrapper: installed once


def install() -> None:
    """Wrap the four methods (once)."""
    _wrap(PeftModel, "save_pretrained", _saving_peft)
    _wrap(PeftModel, "load_adapter", _loading_into_peft)
    _wrap(PreTrainedModel, "load_adapter", _loading_into_transformers)
    original = PeftModel.__dict__["from_pretrained"].__func__
    if not getattr(original, MARK, False):
        PeftModel.from_pretrained = classmethod(_from_pretrained(original))


def _wrap(owner: type, name: str, make) -> None:
    original = getattr(owner, name)  # a function (the class's own or a base's: PeftAdapterMixin's load_adapter)
    if not getattr(original, MARK, False):
        setattr(owner, name, make(original))


def _marked(wrapper, original):
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, MARK, True)
    return wrapper


def _saving_peft(original):
    signature = inspect.signature(original)

    def save_pretrained(self, save_directory, *args, **kwargs):
        result = original(self, save_directory, *args, **kwargs)
        given = signature.bind(self, save_directory, *args, **kwargs).arguments
        if given.get("is_main_process", True):
            names = given.get("selected_adapters") or list(self.peft_config)
            for name in names:
                folder = save_directory if name == "default" else os.path.join(save_directory, name)
                write_adapter_record(self.get_base_model(), folder)
        return result

    return _marked(save_pretrained, original)


def _from_pretrained(original):
    def from_pretrained(cls, model, model_id, *args, **kwargs):
        apply_adapter_record(model, model_id, kwargs)
        return original(cls, model, model_id, *args, **kwargs)

    return _marked(from_pretrained, original)


def _loading_into_peft(original):
    def load_adapter(self, model_id, *args, **kwargs):
        apply_adapter_record(self.get_base_model(), model_id, kwargs)
        return original(self, model_id, *args, **kwargs)

    return _marked(load_adapter, original)


def _loading_into_transformers(original):
    def load_adapter(self, peft_model_id=None, *args, **kwargs):
        apply_adapter_record(self, peft_model_id, {**(kwargs.get("adapter_kwargs") or {}), **kwargs})
        return original(self, peft_model_id, *args, **kwargs)

    return _marked(load_adapter, original)


install()
