"""Running a chunking job: plan it, check the output directory, do the pieces not yet done
on a process pool (or a Dask cluster), and write the index.

Resuming: the job's identity (``job.json``: its arguments, and the size and version of
every input file, see `Source`) is written before any chunk, each finished piece leaves a
manifest, and the index is written last. A re-run of the same job skips the pieces that
have a manifest and the chunk files that exist (writes are atomic), so an interrupted job
finishes without writing a chunk twice; a re-run after the index exists does nothing. Once
the index is written, the manifests and the temporary files of killed writes are removed.
An output directory that holds another job is refused, naming each argument and input
that differs; one that another job is writing is refused too (see `_files` for the lock).
The output's path is literal, and files inside it are never read as inputs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, as_completed
from typing import Any

from .._core.checks import require_int
from ..io._store import StorageOptions, Store
from ..io.listing import find_files
from ..io.retry import RetryPolicy
from ..stages.bad_records import OnError, resolve_on_error
from ._files import clean_up, file_names, load_json, output_lock, read_bytes, write_json
from ._refs import is_url, join_ref
from .checks import EXAMPLES
from .index import (
    INDEX_NAME,
    ChunkIndex,
    ChunkIndexError,
    chunk_names,
    parse_index,
)
from .plan import (
    COMPRESSIONS,
    DEFAULT_SPLIT_BYTES,
    Job,
    Piece,
    Source,
    describe_changes,
    directory_files,
    file_pieces,
    input_kind,
    line_pieces,
    piece_of,
    plan_digest,
    sample_pieces,
    source_of,
)
from .progress import progress_bar
from .writer import PIECES_DIR, PieceDone, write_piece

JOB_NAME = "job.json"
_MANIFEST = re.compile(r"^piece-[0-9]{6}\.json$")
_OWNER = "chunk"
INPUT_FORMATS = ("auto", "lines", "jsonl", "wds")


def chunk_corpus(
    inputs: Sequence[str],
    out: str,
    *,
    items_per_chunk: int,
    compress: str = "gz",
    input_format: str = "auto",
    workers: int | None = None,
    client: Any = None,
    split_bytes: int = DEFAULT_SPLIT_BYTES,
    storage_options: StorageOptions | None = None,
    show_progress: bool | None = None,
    on_error: OnError = "raise",
    retry: RetryPolicy | None = None,
) -> ChunkIndex:
    """Cut `inputs` into chunk files of `items_per_chunk` items under `out`, with an index.

    Args:
        inputs: text-line or JSON-lines files (paths, URLs or globs of either; compressed
            by suffix: .gz, .bz2, .xz, .zst), or local directories whose files become one
            record each (named by their path relative to the directory).
        out: the output directory or URL (created if needed).
        items_per_chunk: the most lines (or files, or samples) per chunk. Each piece (an
            input file, a `split_bytes` range of a large uncompressed local file, or a
            directory's files) of n items is cut into ``ceil(n / items_per_chunk)`` chunks
            whose sizes differ by one item at most, rather than full chunks and a short
            remainder, so that chunks balance well over shards (`ChunkIndex.shards`). To
            count its items first, each input file is read twice (decompressed or downloaded twice).
        compress: ``"gz"``, ``"zst"`` or ``"none"``.
        input_format: ``"auto"`` (from the suffix), ``"lines"`` or ``"jsonl"``; or
            ``"wds"`` for a directory input: its files grouped by key into samples
            (``0001.jpg`` and ``0001.json`` make sample ``0001``), written as WebDataset
            tar shards of `items_per_chunk` samples at most (``.tar`` plus the
            compression's suffix), read with `read_webdataset`.
        workers: processes (default: every core); 1 works in this process.
        client: a ``dask.distributed.Client``: the pieces run as its tasks instead (every
            worker must reach the inputs and `out`).
        split_bytes: the byte range size for large uncompressed local inputs.
        storage_options: options of the fsspec file system of URLs (inputs and `out`).
        show_progress: a progress bar on stderr; None: when stderr is a terminal.
        on_error: what an input line that is not UTF-8 text (or, in JSON lines, not JSON)
            does: ``"raise"`` (a ValueError naming it), or a `SkipPolicy`, under which it is
            left out and counted (`ChunkIndex.skipped`), up to ``max_skips`` bad lines in
            each window of ``per_items`` lines of a piece (``per_items=None``: in all).
        retry: the retry policy of transient failures of the store, for every listing,
            read and write of the job (`DEFAULT_RETRY` if None).

    Returns:
        The index written (as `load_index` reads it).

    Raises:
        ValueError: for a bad argument, an input that matches nothing, an unsupported
            suffix, mixed input kinds, a bad line beyond `on_error`, an `out` that holds
            another job's chunks (naming each option and input that differs) or that
            another job is writing, or a damaged job file in `out` (naming it).
    """
    require_int(_OWNER, "items_per_chunk", items_per_chunk, 1)
    require_int(_OWNER, "split_bytes", split_bytes, 1)
    if workers is not None:
        require_int(_OWNER, "workers", workers, 1)
    if compress not in COMPRESSIONS:
        raise ValueError(
            f"{_OWNER}: compress must be one of {sorted(COMPRESSIONS)}, got {compress!r}"
        )
    if input_format not in INPUT_FORMATS:
        raise ValueError(
            f"{_OWNER}: input_format must be one of {', '.join(map(repr, INPUT_FORMATS))}, "
            f"got {input_format!r}"
        )
    if isinstance(inputs, str) or not inputs:
        raise ValueError(f"{_OWNER}: inputs must be a non-empty list of paths, got {inputs!r}")
    policy = resolve_on_error(_OWNER, on_error)
    store = Store.of(storage_options, retry)
    skip: str | dict[str, int | None] = (
        "raise"
        if policy is None
        else {"max_skips": policy.max_skips, "per_items": policy.per_items}
    )
    kind, pieces, sources = _plan(
        list(inputs), out, input_format, items_per_chunk, split_bytes, store
    )
    digest = plan_digest(pieces, sources)
    job = Job(kind, tuple(inputs), items_per_chunk, compress, split_bytes, digest, skip)
    with output_lock(out, _OWNER):
        return _run_job(job, pieces, sources, out, workers, client, store, show_progress)


def _run_job(
    job: Job,
    pieces: list[Piece],
    sources: list[Source],
    out: str,
    workers: int | None,
    client: Any,
    store: Store,
    show_progress: bool | None,
) -> ChunkIndex:
    """`chunk_corpus` once it holds the output: check it, do the pieces not done, write
    the index."""
    finished = _check_output(job, sources, out, store)
    if finished is not None:
        clean_up(out, PIECES_DIR, store)
        return finished
    done = _read_manifests(out, store)
    existing: dict[int, set[str]] = {}
    for name in chunk_names(out, store):
        existing.setdefault(piece_of(name), set()).add(name)
    sizes = [piece.size for piece in pieces]
    by_bytes = None not in sizes  # else the bar counts pieces
    items = 0
    with progress_bar(
        total=sum(size or 0 for size in sizes) if by_bytes else len(pieces),
        desc="chunk",
        unit="B" if by_bytes else "pieces",
        unit_scale=by_bytes,
        disable=None if show_progress is None else not show_progress,
    ) as bar:

        def finished_piece(piece: Piece, result: PieceDone) -> None:
            nonlocal items
            done[piece.number] = result
            items += sum(entry.items for entry in result.entries)
            bar.update((piece.size or 0) if by_bytes else 1)
            bar.set_postfix_str(f"{items:,} items")

        for piece in pieces:
            if piece.number in done:
                finished_piece(piece, done[piece.number])
        work = [
            (piece, frozenset(existing.get(piece.number, ())))
            for piece in pieces
            if piece.number not in done
        ]
        _run_pieces(job, work, out, store, workers, client, finished_piece)
    chunks = tuple(entry for piece in pieces for entry in done[piece.number].entries)
    results = [done[piece.number] for piece in pieces]
    skipped = sum(result.skipped for result in results)
    examples = tuple(example for result in results for example in result.examples)[:EXAMPLES]
    policy = job.skip_policy()
    if policy is not None and policy.per_items is None and skipped > policy.max_skips:
        raise ValueError(
            f"{_OWNER}: {skipped} bad lines in all, more than the budget on_error={policy!r}; "
            f"the first: {'; '.join(examples)}"
        )
    index = ChunkIndex(out, job.to_json(), chunks, skipped, examples)
    write_json(join_ref(out, INDEX_NAME), index.to_json(), store)
    clean_up(out, PIECES_DIR, store)
    return index


def _plan(
    inputs: list[str],
    out: str,
    input_format: str,
    items_per_chunk: int,
    split_bytes: int,
    store: Store,
) -> tuple[str, list[Piece], list[Source]]:
    """The job's kind, its pieces and its input files; files inside `out` are left out."""
    directories = [ref for ref in inputs if not is_url(ref) and os.path.isdir(ref)]
    if directories:
        if len(directories) != len(inputs) or len(directories) > 1:
            raise ValueError(
                f"{_OWNER}: a directory input ({directories[0]!r}) must be the only input"
            )
        directory = directories[0]
        names = directory_files(directory, leave_out=None if is_url(out) else out)
        sources = [source_of(os.path.join(directory, name), store) for name in names]
        files = [(name, source.size) for name, source in zip(names, sources, strict=True)]
        if input_format == "wds":
            return "wds", sample_pieces(directory, files, items_per_chunk), sources
        return "files", file_pieces(directory, files, items_per_chunk), sources
    if input_format == "wds":
        raise ValueError(
            f"{_OWNER}: input_format='wds' writes WebDataset shards from a directory of "
            f"files; {inputs[0]!r} is not a directory"
        )
    refs: dict[str, dict[str, Any]] = {}  # each with what its listing said
    for pattern in inputs:
        if (
            not is_url(pattern)
            and not any(c in pattern for c in "*?[")
            and not os.path.exists(pattern)
        ):
            raise ValueError(f"{_OWNER}: input {pattern!r} does not exist")
        try:
            matched = find_files(pattern, store)
        except FileNotFoundError as error:
            raise ValueError(f"{_OWNER}: input {pattern!r} matches no file ({error})") from None
        outside = {ref: info for ref, info in sorted(matched.items()) if not _inside(ref, out)}
        if not outside:
            raise ValueError(
                f"{_OWNER}: input {pattern!r} matches only files of the output {out!r}"
            )
        refs.update(outside)
    kinds = {ref: input_kind(ref, input_format) for ref in refs}
    if len(set(kinds.values())) > 1:
        lines = next(ref for ref, kind in kinds.items() if kind == "lines")
        jsonl = next(ref for ref, kind in kinds.items() if kind == "jsonl")
        raise ValueError(
            f"{_OWNER}: the inputs mix text lines ({lines!r}) and JSON lines ({jsonl!r}); "
            "chunk them as separate jobs"
        )
    sources = [source_of(ref, store, info) for ref, info in refs.items()]
    return next(iter(kinds.values())), line_pieces(sources, split_bytes), sources


def _inside(ref: str, out: str) -> bool:
    """Whether the file `ref` lies in the output directory `out` (at any depth)."""
    if is_url(ref) or is_url(out):
        return ref.startswith(out.rstrip("/") + "/")
    return os.path.realpath(ref).startswith(os.path.join(os.path.realpath(out), ""))


def _check_output(job: Job, sources: list[Source], out: str, store: Store) -> ChunkIndex | None:
    """The index if `out` holds this job finished; None after recording the job in `out`
    if it holds nothing or this job unfinished; ValueError if it holds another job."""
    names = set(file_names(out, store))
    wanted = job.to_json()

    def job_file() -> dict[str, Any] | None:
        return _read_job_file(out, store) if JOB_NAME in names else None

    if INDEX_NAME in names:
        data = read_bytes(join_ref(out, INDEX_NAME), store)
        try:
            index = parse_index(out, data)
        except ChunkIndexError as error:
            raise ChunkIndexError(f"{_OWNER}: {error}") from None
        _require_same_job(index.job, job_file, wanted, sources, out)
        return index
    recorded = job_file()
    if recorded is not None:
        _require_same_job(recorded, lambda: recorded, wanted, sources, out)
    else:
        record = {**wanted, "sources": [source.to_json() for source in sources]}
        write_json(join_ref(out, JOB_NAME), record, store)
    return None


def _read_job_file(out: str, store: Store) -> dict[str, Any]:
    where = join_ref(out, JOB_NAME)
    try:
        recorded = load_json(read_bytes(where, store), "it")
        if not isinstance(recorded, dict):
            raise ValueError("it is not a JSON object")
    except ValueError as error:
        raise ValueError(
            f"{_OWNER}: the job file {where} is damaged: {error}; delete the output "
            "directory to start over"
        ) from None
    return recorded


def _require_same_job(
    recorded: dict[str, Any],
    job_file: Callable[[], dict[str, Any] | None],
    wanted: dict[str, Any],
    sources: list[Source],
    out: str,
) -> None:
    """ValueError naming each option and input that differs between the `recorded` job
    (of the index or job file) and the `wanted` one; `job_file` gives the recorded inputs
    (None if there is no job file), read only where the plans differ."""
    changed = [key for key in wanted if recorded.get(key) != wanted[key]]
    if not changed:
        return
    details = [
        f"{key}: {recorded.get(key)!r} there, {wanted[key]!r} now"
        for key in changed
        if key != "plan"
    ]
    if "plan" in changed:
        plan = f"plan: {recorded.get('plan')!r} there, {wanted['plan']!r} now"
        details += _input_changes(job_file(), sources, out) or ([] if details else [plan])
    raise ValueError(
        f"{_OWNER}: the output {out!r} holds the chunks of a different job "
        f"({'; '.join(details)}); choose another output directory, or delete this one to "
        "start over"
    )


def _input_changes(job_file: dict[str, Any] | None, sources: list[Source], out: str) -> list[str]:
    """The inputs that changed since the job file was written (none known without one)."""
    if job_file is None or "sources" not in job_file:
        return []
    try:
        return describe_changes(job_file["sources"], sources)
    except ValueError as error:
        raise ValueError(
            f"{_OWNER}: the job file {join_ref(out, JOB_NAME)} is damaged: {error}; delete "
            "the output directory to start over"
        ) from None


def _read_manifests(out: str, store: Store) -> dict[int, PieceDone]:
    """What the pieces already done wrote, by piece number."""
    done = {}
    pieces = join_ref(out, PIECES_DIR)
    for name in file_names(pieces, store):
        if _MANIFEST.match(name) is None:
            continue
        ref = join_ref(pieces, name)
        try:
            result = PieceDone.from_json(load_json(read_bytes(ref, store), "it"))
        except ValueError as error:
            raise ValueError(
                f"{_OWNER}: the piece manifest {ref} is damaged: {error}; delete it and run "
                "the job again to redo that piece"
            ) from None
        done[int(name[len("piece-") : -len(".json")])] = result
    return done


def _run_pieces(
    job: Job,
    work: list[tuple[Piece, frozenset[str]]],
    out: str,
    store: Store,
    workers: int | None,
    client: Any,
    finished: Callable[[Piece, PieceDone], None],
) -> None:
    """Do the pieces of `work`, calling `finished` as each completes (in any order)."""
    if client is None and (workers == 1 or len(work) <= 1):
        for piece, existing in work:
            finished(piece, write_piece(job, piece, out, existing, store))
        return
    executor: Executor = (
        client.get_executor()
        if client is not None
        else ProcessPoolExecutor(min(workers or os.cpu_count() or 1, len(work)))
    )
    futures: dict[Future[PieceDone], Piece] = {
        executor.submit(write_piece, job, piece, out, existing, store): piece
        for piece, existing in work
    }
    try:
        for future in as_completed(futures):
            finished(futures[future], future.result())
    finally:
        for future in futures:
            future.cancel()
        executor.shutdown(wait=True)
