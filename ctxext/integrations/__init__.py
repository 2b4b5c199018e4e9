"""ctxext with other libraries' trainers and loaders: PEFT adapters that carry the patch their base was trained
under (`adapters`, wrapped into PEFT's and transformers' save and load by `hooks` at `import ctxext`), and the
directory TRL's GRPO hands vLLM (`trl`)."""
