"""`megatron-lev <subcommand>` (also `python -m megatron_lev`).

Each subcommand lives in its own module exposing `add_arguments(parser)` and
`main(args) -> int | None`; the registry below maps names to modules, so adding a
subcommand is one line. Modules are imported only when their command runs (or
for `--help`), keeping start-up fast.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "config": ("megatron_lev.commands.config_cmd", "print the resolved, validated run config"),
    "demo": (
        "megatron_lev.commands.demo",
        "the main job end to end on a sample corpus built here (resumable)",
    ),
    "params": (
        "megatron_lev.commands.params",
        "parameter count of every embedding variant at every model size, and FLOPs per token",
    ),
    "train": (
        "megatron_lev.commands.train",
        "pretrain or resume a model with DeepSpeed (exit 75 when preempted)",
    ),
    "capacity": (
        "megatron_lev.commands.capacity",
        "representational capacity of embedding matrices; packing sweep and refit",
    ),
    "evaluate": (
        "megatron_lev.commands.evaluate",
        "perplexity overall, by token frequency and in bits per byte",
    ),
    "compare": (
        "megatron_lev.commands.compare",
        "compare runs against TIED: perplexity changes and tokens-to-target",
    ),
    "geometry": (
        "megatron_lev.commands.geometry",
        "embedding geometry (eps, mean cosine, effective rank) of every checkpoint of runs",
    ),
    "lm-eval-tasks": (
        "megatron_lev.commands.lm_eval_tasks",
        "write offline lm-eval task YAMLs for local downstream data",
    ),
    "convert": (
        "megatron_lev.commands.convert",
        "convert a training checkpoint to a validated Hugging Face model",
    ),
    "reshard": ("megatron_lev.commands.reshard", "rewrite a training checkpoint for another TP/PP/DP layout"),
    "preprocess": (
        "megatron_lev.commands.preprocess",
        "tokenise Pile-format text into memory-mapped .bin/.idx shards",
    ),
    "train-tokenizer": (
        "megatron_lev.commands.train_tokenizer",
        "train a SentencePiece BPE tokenizer (byte fallback) on Pile-format text",
    ),
    "sample-corpus": (
        "megatron_lev.commands.sample_corpus",
        "build a Pile-format sample corpus from sources on this machine",
    ),
    "build-indices": (
        "megatron_lev.commands.build_indices",
        "prebuild the cached GPT sample indices of a run offline",
    ),
    "grid": (
        "megatron_lev.commands.grid",
        "the paper's experiment grid: sbatch commands, or the small grid run here",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("MEGATRON_LEV_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("command", nargs="?")
    known, _ = parser.parse_known_args(argv[:1])
    full = argparse.ArgumentParser(
        prog="megatron-lev",
        description="Pretraining with the Leviathan (LEV) input layer on DeepSpeed. "
        "Errors print one line; --debug (or MEGATRON_LEV_DEBUG=1) shows the traceback.",
    )
    full.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    sub = full.add_subparsers(dest="command", metavar="<command>")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        p.set_defaults(_module=module)
        if known.command == name:
            importlib.import_module(module).add_arguments(p)
    args = full.parse_args(argv)
    if not getattr(args, "_module", None):
        full.print_help()
        return 2
    args.debug = debug
    return run_guarded(
        f"megatron-lev {args.command}", lambda: importlib.import_module(args._module).main(args), debug
    )


def entry(argv: list[str] | None = None) -> None:
    """The process's entry point (`megatron-lev`, `python -m megatron_lev`, `pretrain/pretrain_gpt.py`):
    `main`, then the exit. A rank that left a group of several ranks ends through
    `parallel.session.end_process`, without the interpreter's finalization (that module's docstring
    says why), also when an exception escapes `main` (a bug: its traceback is printed, status 1);
    any other process exits the usual way. Code that runs a command in-process calls `main`."""
    try:
        code = main(argv)
    except SystemExit as exc:  # a command that exits by itself
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 - a bug: say where, then leave as every exit does
        import traceback

        traceback.print_exc()
        code = 1
    session = sys.modules.get("megatron_lev.parallel.session")  # never imported: no group was joined
    if session is not None:
        session.end_process(code)
    sys.exit(code)


def run_guarded(prog: str, fn, debug: bool = False) -> int:
    """Run `fn`; print a user error as one line (`prog: message`) and return its exit code.

    Errors a user can act on (`UserError`, missing or unreadable files, a full disk,
    Ctrl-C) never show a traceback unless `debug`; anything else is a bug and does.
    """
    from megatron_lev.errors import ConfigError, UserError

    try:
        return int(fn() or 0)
    except ConfigError as exc:
        if debug:
            raise
        print(f"{prog}: config error: {exc}", file=sys.stderr)
        return exc.exit_code
    except UserError as exc:
        if debug:
            raise
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except (
        FileNotFoundError,
        FileExistsError,
        IsADirectoryError,
        NotADirectoryError,
        PermissionError,
    ) as exc:
        if debug:
            raise
        # raised by our own code as well as by a user's path: always name the file(s), point at --debug
        kinds = (
            (FileNotFoundError, "not found"),
            (IsADirectoryError, "is a directory, expected a file"),
            (NotADirectoryError, "is not a directory"),
            (PermissionError, "permission denied"),
            (FileExistsError, "already exists (a file where a directory is needed?)"),
        )
        what = next((w for cls, w in kinds if isinstance(exc, cls)), exc.strerror or str(exc))
        if exc.filename is None:
            print(
                f"{prog}: error: {type(exc).__name__}: {exc} (no file named; --debug shows the traceback)",
                file=sys.stderr,
            )
            return 1
        name = f"{exc.filename} -> {exc.filename2}" if exc.filename2 is not None else f"{exc.filename}"
        print(
            f"{prog}: error: {name}: {what}; check the path and its permissions "
            "(--debug shows the traceback)",
            file=sys.stderr,
        )
        return 1
    except OSError as exc:
        if exc.errno == errno.EROFS and exc.filename is not None:
            if debug:
                raise
            print(
                f"{prog}: error: {exc.filename}: read-only file system; choose a writable directory "
                "(--debug shows the traceback)",
                file=sys.stderr,
            )
            return 1
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            if debug:
                raise
            where = f" writing {exc.filename}" if exc.filename else ""
            print(
                f"{prog}: error: no space left on the device{where}; free space or choose another "
                "directory, then rerun",
                file=sys.stderr,
            )
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
