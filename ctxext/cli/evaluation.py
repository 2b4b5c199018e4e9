"""The arguments `ctxext eval`, `ctxext passkey` and `ctxext tasks` share -> the library's option dataclasses
(ctxext.run_options, ctxext.eval.rows). Imported by their `run` only."""

from __future__ import annotations

from .common import method_selection  # noqa: F401  (the commands' method rows)


def runtime_options(args):
    from ..dispatch import check_tensor_parallel
    from ..run_options import RuntimeOptions

    placement = placement_from_args(args)
    # the flags alone, before anything is launched or loaded
    check_tensor_parallel(getattr(args, "tp", 1), placement, args.device)
    return RuntimeOptions(
        device=args.device,
        dtype=args.dtype,
        attn_implementation=args.attn_implementation,
        bos=getattr(args, "bos", "auto"),
        progress=not args.no_progress,
        kept_keys=not getattr(args, "no_kept_keys", False),
        placement=placement,
        tp=getattr(args, "tp", 1),
    )


def placement_from_args(args):
    """--device-map and --max-memory as a ctxext.dispatch.Placement (None: neither given)."""
    from ..dispatch import placement_from_flags

    return placement_from_flags(args.device_map, args.max_memory)


def data_options(args):
    from ..run_options import DataOptions

    return DataOptions(
        text_files=args.text_file,
        dataset=args.dataset,
        split=args.split,
        dataset_config=args.dataset_config,
        text_field=args.text_field,
        max_docs=args.max_docs,
        min_doc_tokens=args.min_doc_tokens,
    )


def invocation(args):
    """The command line and its parsed arguments, recorded in results.json."""
    from ..run_options import Invocation

    return Invocation(arguments=dict(vars(args)))
