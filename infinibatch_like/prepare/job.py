"""Running a chunking job: plan it, check the output directory, do the pieces not yet done
on a process pool (or a Dask cluster), and write the index.

Resuming: the job's identity (``job.json``) is written before any chunk, each finished
piece leaves a manifest, and the index is written last. A re-run of the same job skips
the pieces that have a manifest and the chunk files that exist (writes are atomic), so an
interrupted job finishes without writing a chunk twice; a re-run after the index exists
does nothing. An output directory that holds another job is refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, as_completed
from typing import Any

from .._base import require_int
from ..io import list_chunks, open_chunk, open_output
from ..progress import progress_bar
from ._refs import base_name, is_url, join_ref
from .index import INDEX_NAME, ChunkEntry, ChunkIndex, chunk_files, parse_index
from .plan import (
    COMPRESSIONS,
    DEFAULT_SPLIT_BYTES,
    Job,
    Piece,
    file_pieces,
    input_kind,
    line_pieces,
    piece_of,
    plan_digest,
)
from .writer import PIECES_DIR, write_piece

JOB_NAME = "job.json"
_OWNER = "chunk"


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
    storage_options: dict[str, Any] | None = None,
    show_progress: bool | None = None,
) -> ChunkIndex:
    """Cut `inputs` into chunk files of `items_per_chunk` items under `out`, with an index.

    Args:
        inputs: text-line or JSON-lines files (paths, URLs or globs of either; compressed
            by suffix: .gz, .bz2, .xz, .zst), or local directories whose files become one
            record each (named by their path relative to the directory).
        out: the output directory or URL (created if needed).
        items_per_chunk: the most lines (or files) per chunk. Each piece (an input file, a
            `split_bytes` range of a large uncompressed local file, or a directory's files)
            of n items is cut into ``ceil(n / items_per_chunk)`` chunks whose sizes differ
            by one item at most, rather than full chunks and a short remainder, so that
            chunks balance well over shards (`ChunkIndex.shards`). To count its items
            first, each input file is read twice (decompressed or downloaded twice).
        compress: ``"gz"``, ``"zst"`` or ``"none"``.
        input_format: ``"auto"`` (from the suffix), ``"lines"`` or ``"jsonl"``.
        workers: processes (default: every core); 1 works in this process.
        client: a ``dask.distributed.Client``: the pieces run as its tasks instead (every
            worker must reach the inputs and `out`).
        split_bytes: the byte range size for large uncompressed local inputs.
        storage_options: passed to fsspec for URLs.
        show_progress: a progress bar on stderr; None: when stderr is a terminal.

    Returns:
        The index written (as `load_index` reads it).

    Raises:
        ValueError: for a bad argument, an input that matches nothing, an unsupported
            suffix, mixed input kinds, or an `out` that holds another job's chunks.
    """
    require_int(_OWNER, "items_per_chunk", items_per_chunk, 1)
    require_int(_OWNER, "split_bytes", split_bytes, 1)
    if workers is not None:
        require_int(_OWNER, "workers", workers, 1)
    if compress not in COMPRESSIONS:
        raise ValueError(
            f"{_OWNER}: compress must be one of {sorted(COMPRESSIONS)}, got {compress!r}"
        )
    if input_format not in ("auto", "lines", "jsonl"):
        raise ValueError(
            f"{_OWNER}: input_format must be 'auto', 'lines' or 'jsonl', got {input_format!r}"
        )
    if isinstance(inputs, str) or not inputs:
        raise ValueError(f"{_OWNER}: inputs must be a non-empty list of paths, got {inputs!r}")
    kind, pieces = _plan(list(inputs), input_format, items_per_chunk, split_bytes, storage_options)
    job = Job(kind, tuple(inputs), items_per_chunk, compress, split_bytes, plan_digest(pieces))
    finished = _check_output(job, out, storage_options)
    if finished is not None:
        return finished
    done = _read_manifests(out, storage_options)
    existing: dict[int, set[str]] = {}
    for ref in chunk_files(out, storage_options):
        name = base_name(ref)
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

        def finished_piece(piece: Piece, entries: list[ChunkEntry]) -> None:
            nonlocal items
            done[piece.number] = entries
            items += sum(entry.items for entry in entries)
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
        _run_pieces(job, work, out, storage_options, workers, client, finished_piece)
    chunks = tuple(entry for piece in pieces for entry in done[piece.number])
    index = ChunkIndex(out, job.to_json(), chunks)
    _write_json(join_ref(out, INDEX_NAME), index.to_json(), storage_options)
    return index


def _plan(
    inputs: list[str],
    input_format: str,
    items_per_chunk: int,
    split_bytes: int,
    storage_options: dict[str, Any] | None,
) -> tuple[str, list[Piece]]:
    """The job's kind and its pieces."""
    directories = [ref for ref in inputs if not is_url(ref) and os.path.isdir(ref)]
    if directories:
        if len(directories) != len(inputs) or len(directories) > 1:
            raise ValueError(
                f"{_OWNER}: a directory input ({directories[0]!r}) must be the only input"
            )
        return "files", file_pieces(directories[0], items_per_chunk)
    refs: list[str] = []
    for pattern in inputs:
        if (
            not is_url(pattern)
            and not any(c in pattern for c in "*?[")
            and not os.path.exists(pattern)
        ):
            raise ValueError(f"{_OWNER}: input {pattern!r} does not exist")
        try:
            matched = list_chunks(pattern, storage_options=storage_options)
        except FileNotFoundError as error:
            raise ValueError(f"{_OWNER}: input {pattern!r} matches no file ({error})") from None
        refs.extend(matched)
    kinds = {ref: input_kind(ref, input_format) for ref in refs}
    if len(set(kinds.values())) > 1:
        lines = next(ref for ref, kind in kinds.items() if kind == "lines")
        jsonl = next(ref for ref, kind in kinds.items() if kind == "jsonl")
        raise ValueError(
            f"{_OWNER}: the inputs mix text lines ({lines!r}) and JSON lines ({jsonl!r}); "
            "chunk them as separate jobs"
        )
    return next(iter(kinds.values())), line_pieces(refs, split_bytes)


def _check_output(job: Job, out: str, storage_options: dict[str, Any] | None) -> ChunkIndex | None:
    """The index if `out` holds this job finished; None after recording the job in `out`
    if it holds nothing or this job unfinished; ValueError if it holds another job."""
    present = {base_name(ref) for ref in _listed(join_ref(out, "*.json"), storage_options)}
    wanted = job.to_json()
    for name in (INDEX_NAME, JOB_NAME):
        if name not in present:
            continue
        text = _read_text(join_ref(out, name), storage_options)
        recorded = parse_index(out, text).job if name == INDEX_NAME else json.loads(text)
        if not isinstance(recorded, dict):
            raise ValueError(f"{_OWNER}: {join_ref(out, name)} is damaged (not a JSON object)")
        if recorded != wanted:
            changed = sorted(key for key in wanted if recorded.get(key) != wanted[key])
            details = "; ".join(
                f"{key}: {recorded.get(key)!r} there, {wanted[key]!r} now" for key in changed
            )
            raise ValueError(
                f"{_OWNER}: the output {out!r} holds the chunks of a different job ({details}); "
                "choose another output directory, or delete this one to start over"
            )
        if name == INDEX_NAME:
            return parse_index(out, text)
    if JOB_NAME not in present:
        _write_json(join_ref(out, JOB_NAME), wanted, storage_options)
    return None


def _read_manifests(
    out: str, storage_options: dict[str, Any] | None
) -> dict[int, list[ChunkEntry]]:
    """The entries of the pieces already done, by piece number."""
    done = {}
    for ref in _listed(join_ref(out, f"{PIECES_DIR}/piece-*.json"), storage_options):
        number = int(base_name(ref)[len("piece-") : -len(".json")])
        raw = json.loads(_read_text(ref, storage_options))
        done[number] = [
            ChunkEntry(entry["name"], entry["items"], entry["bytes"], entry["sha256"])
            for entry in raw
        ]
    return done


def _run_pieces(
    job: Job,
    work: list[tuple[Piece, frozenset[str]]],
    out: str,
    storage_options: dict[str, Any] | None,
    workers: int | None,
    client: Any,
    finished: Callable[[Piece, list[ChunkEntry]], None],
) -> None:
    """Do the pieces of `work`, calling `finished` as each completes (in any order)."""
    if client is None and (workers == 1 or len(work) <= 1):
        for piece, existing in work:
            finished(piece, write_piece(job, piece, out, existing, storage_options))
        return
    executor: Executor = (
        client.get_executor()
        if client is not None
        else ProcessPoolExecutor(min(workers or os.cpu_count() or 1, len(work)))
    )
    futures: dict[Future[list[ChunkEntry]], Piece] = {
        executor.submit(write_piece, job, piece, out, existing, storage_options): piece
        for piece, existing in work
    }
    try:
        for future in as_completed(futures):
            finished(futures[future], future.result())
    finally:
        for future in futures:
            future.cancel()
        executor.shutdown(wait=True)


def _listed(pattern: str, storage_options: dict[str, Any] | None) -> list[str]:
    """The refs matching `pattern`; none where nothing (or no directory) matches."""
    try:
        return list_chunks(pattern, storage_options=storage_options)
    except FileNotFoundError:
        return []


def _read_text(ref: str, storage_options: dict[str, Any] | None) -> str:
    with open_chunk(ref, storage_options=storage_options) as stream:
        data: bytes = stream.read()
    return data.decode("utf-8")


def _write_json(ref: str, value: Any, storage_options: dict[str, Any] | None) -> None:
    with open_output(ref, storage_options=storage_options) as output:
        output.write(json.dumps(value, indent=1).encode("utf-8"))
