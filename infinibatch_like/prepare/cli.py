"""The data-preparation commands of ``python -m infinibatch_like``: chunk, verify, inspect."""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

from .._core.extras import MissingExtraError, missing_extra
from ..checkpoint.inspect import inspect_lines
from ..stages.bad_records import OnError, SkipPolicy
from .index import ChunkIndexError, read_index
from .job import INPUT_FORMATS, chunk_corpus
from .plan import COMPRESSIONS, DEFAULT_SPLIT_BYTES
from .verify import verify_chunks


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int >= `minimum`."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in its error for a non-number
    return parse




def add_commands(commands: Any) -> None:
    """Add the chunk, verify and inspect sub-commands to an argparse sub-parser group."""
    chunk = commands.add_parser(
        "chunk",
        help="cut text/JSON-lines files or a directory of files into chunks (or WebDataset "
        "shards) with an index",
        description="Cut INPUT files (text lines or JSON lines, local or URLs, globs allowed, "
        "compressed by suffix) or a directory of files (one record each) into chunk files of "
        "N items plus index.json. Resumable: run it again after an interruption.",
    )
    chunk.add_argument(
        "inputs", nargs="+", metavar="INPUT", help="a file, URL or glob (quoted), or a directory"
    )
    chunk.add_argument(
        "--out", required=True, metavar="DIR_OR_URL", help="where the chunks and index.json go"
    )
    chunk.add_argument(
        "--items-per-chunk", type=at_least(1), required=True, metavar="N",
        help="the most lines (or files) per chunk; an input of n items becomes "
        "ceil(n / N) chunks whose sizes differ by one item at most",
    )  # fmt: skip
    chunk.add_argument(
        "--compress", choices=sorted(COMPRESSIONS), default="gz",
        help="compression of the chunks (default gz)",
    )  # fmt: skip
    chunk.add_argument(
        "--format",
        choices=INPUT_FORMATS,
        default="auto",
        help="input format (default: from the suffix); wds: write the files of a directory, "
        "grouped by key (0001.jpg, 0001.json: sample 0001), as WebDataset tar shards of N "
        "samples",
    )
    chunk.add_argument(
        "--workers", type=at_least(1), default=None, help="processes (default: every core)"
    )
    chunk.add_argument(
        "--scheduler",
        default=None,
        metavar="ADDRESS",
        help="run on this Dask scheduler instead (needs infinibatch_like[dask])",
    )
    chunk.add_argument(
        "--split-bytes",
        type=at_least(1),
        default=DEFAULT_SPLIT_BYTES,
        metavar="B",
        help="cut uncompressed local inputs larger than this into byte ranges done in "
        f"parallel (default {DEFAULT_SPLIT_BYTES})",
    )
    chunk.add_argument(
        "--skip-bad-lines",
        type=at_least(0),
        default=None,
        metavar="M",
        help="leave out input lines that are not UTF-8 text (or, in JSON lines, not JSON), "
        "at most M of them (in all, or in each --skip-window), and count them in the index "
        "(default: stop at the first, naming it)",
    )
    chunk.add_argument(
        "--skip-window",
        type=at_least(1),
        default=None,
        metavar="N",
        help="with --skip-bad-lines: at most M bad lines in each run of N lines of an input "
        "(a SkipPolicy(max_skips=M, per_items=N))",
    )
    chunk.add_argument("--quiet", action="store_true", help="no progress bar")
    chunk.set_defaults(run=_chunk)

    verify = commands.add_parser(
        "verify",
        help="check every chunk against its index (exit code 1 on a problem, or without a "
        "readable index)",
        description="Read back every chunk that index.json in DIR_OR_URL lists and compare "
        "it with the index: existence, stored size, SHA-256 of the content and item count; "
        "chunk files that the index does not list are reported too. Prints each problem. "
        "Exit code 0: every chunk matches, 1: a problem or no readable index, 2: a bad "
        "argument or a storage error.",
    )
    verify.add_argument(
        "location", metavar="DIR_OR_URL", help="the directory or URL that holds index.json"
    )
    verify.set_defaults(run=_verify)

    inspect = commands.add_parser(
        "inspect",
        help="show a saved pipeline state (JSON or torch checkpoint)",
        description="Show the pipeline state saved in CHECKPOINT (a JSON state or a torch "
        "checkpoint holding one): a line per stage, with the fields that say where it is "
        "(positions, counts, seeds). Exit code 2 for a file that holds no pipeline state.",
    )
    inspect.add_argument(
        "checkpoint", metavar="CHECKPOINT", help="the checkpoint file (JSON or torch) to show"
    )
    inspect.set_defaults(run=_inspect)


def suggest_options(commands: Mapping[str, argparse.ArgumentParser], argv: list[str]) -> None:
    """Exit with a usage error naming the closest option where `argv` gives its command
    (one of `commands`) an option it does not have that is close to one it has (argparse
    would only report the missing required option, or the unknown one without a hint)."""
    command = next((argument for argument in argv if not argument.startswith("-")), None)
    if command is None or command not in commands:
        return
    parser = commands[command]
    known = [option for option in parser._option_string_actions if option.startswith("--")]
    for argument in argv[argv.index(command) + 1 :]:
        if argument == "--":
            return
        name = argument.split("=", 1)[0]
        if not name.startswith("--") or any(option.startswith(name) for option in known):
            continue  # a value, a known option, or an abbreviation argparse accepts
        close = difflib.get_close_matches(name, known, n=1)
        if close:
            parser.error(f"unrecognized argument {name}: did you mean {close[0]}?")


def _chunk(args: argparse.Namespace) -> int:
    on_error: OnError = "raise"
    if args.skip_bad_lines is not None:
        on_error = SkipPolicy(args.skip_bad_lines, args.skip_window)
    elif args.skip_window is not None:
        raise ValueError("--skip-window needs --skip-bad-lines (the most bad lines per window)")
    client: Any = None
    if args.scheduler is not None:
        try:
            distributed: Any = importlib.import_module("dask.distributed")
        except ModuleNotFoundError as error:
            raise missing_extra("distributed", "dask", "chunk --scheduler") from error
        client = distributed.Client(args.scheduler)
    try:
        index = chunk_corpus(
            args.inputs,
            args.out,
            items_per_chunk=args.items_per_chunk,
            compress=args.compress,
            input_format=args.format,
            workers=args.workers,
            client=client,
            split_bytes=args.split_bytes,
            show_progress=False if args.quiet else None,
            on_error=on_error,
        )
    finally:
        if client is not None:
            client.close()
    skipped = (
        f", {index.skipped:,} bad lines skipped (first: {index.skip_examples[0]})"
        if index.skipped
        else ""
    )
    print(
        f"{args.out}: {len(index.chunks)} chunks, {len(index):,} items{skipped}, "
        "index.json written"
    )
    return 0


def _verify(args: argparse.Namespace) -> int:
    try:
        index = read_index(args.location)  # not load_index: verify reports each mismatch
    except ChunkIndexError as error:
        print(f"{args.location}: {error}")
        return 1
    problems = 0
    for _, found in verify_chunks(index):
        for problem in found:
            print(problem)
        problems += len(found)
    if problems:
        print(f"{args.location}: {problems} problem(s) in {len(index.chunks)} chunks")
        return 1
    print(f"{args.location}: OK, {len(index.chunks)} chunks, {len(index):,} items")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    for line in inspect_lines(args.checkpoint):
        print(line)
    return 0


def run(args: argparse.Namespace) -> int:
    """Run a parsed prepare command; a bad input (or a storage error, or a missing extra)
    prints its message and returns 2."""
    try:
        code: int = args.run(args)
    except (ValueError, OSError, MissingExtraError) as error:
        print(f"infinibatch-like {args.command}: error: {error}", file=sys.stderr)
        return 2
    return code
