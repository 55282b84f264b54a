"""The documentation site: it builds with warnings as errors, and its examples run.

- ``mkdocs build --strict`` (mkdocs.yml at the repository root) into a temporary folder;
  every page exists, the API reference shows the documented classes with their docstrings,
  every internal link and anchor of the built site resolves, and the benchmark charts are
  there;
- every ``python`` code block of the pages written for this site runs: the untitled blocks
  of a page in order, as one script (a reader's session), and each block with a
  ``title="name.py"`` on its own, as a standalone script;
- those scripts, the README's example and the tutorials pass ``mypy --strict`` (one run
  over all of them, with the package's settings and cache): what a reader copies
  type-checks as written;
- every docstring of the package parses as a Google-style docstring without warnings
  (the site build leaves those to this test, so that it can name the object).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
from _markdown import python_blocks

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"

# Pages whose examples are ours to run (others' pages are built and link-checked only).
RUNNABLE_PAGES = [
    "index.md",
    "howto/reading-chunks.md",
    "howto/map-style.md",
    "howto/raw-to-batches.md",
    "howto/object-stores.md",
    "howto/parquet.md",
    "howto/webdataset.md",
    "howto/shuffling.md",
    "howto/batching.md",
    "howto/parallelism.md",
    "howto/several-consumers.md",
    "howto/checkpoints.md",
    "howto/long-runs.md",
    "howto/elastic.md",
    "howto/bottleneck.md",
    "howto/write-a-stage.md",
    "concepts.md",
    "migrating.md",
    "distributed.md",
    "mixing.md",
    "howto/pretraining-data.md",
    "pytorch.md",
]

EXPECTED_PAGES = [
    *RUNNABLE_PAGES,
    "benchmarks.md",
    "howto/fault-tolerance.md",
    "api/index.md",
    "api/sources.md",
    "api/flatten-mapping.md",
    "api/shuffle.md",
    "api/batching.md",
    "api/multiplex.md",
    "api/packing.md",
    "api/windowing-recurrent.md",
    "api/parallel.md",
    "api/background.md",
    "api/datasets.md",
    "api/prepare.md",
    "api/io.md",
    "api/checkpoint.md",
    "api/testing.md",
    "api/distributed.md",
    "api/torch.md",
    "api/bad-records.md",
    "api/stats.md",
]

# API page -> (object, a phrase of its docstring) that the page must show.
API_CONTENT = {
    "api/index.md": [("CheckpointableIterator", "whose position can be saved")],
    "api/sources.md": [
        ("InfinitePermutationSourceIterator", "reshuffled before every pass"),
        ("NativeCheckpointableIterator", "re-iterable collection"),
        ("PermutationSourceIterator", "in constant memory"),
    ],
    "api/flatten-mapping.md": [
        ("SelectManyIterator", "a flat-map"),
        ("MapIterator", ""),
        ("FilterIterator", "for which predicate(item) is true"),
    ],
    "api/shuffle.md": [
        ("BlockwiseShuffleIterator", "consecutive blocks"),
        ("BufferedShuffleIterator", "random slot"),
    ],
    "api/batching.md": [
        ("BucketedReadaheadBatchIterator", "sorts them by"),
        ("FixedBatchIterator", "consecutive items"),
    ],
    "api/multiplex.md": [
        ("MultiplexIterator", "control iterator"),
        ("ZipIterator", ""),
        ("TokenBudgetMultiplexIterator", "share of the total"),
    ],
    "api/packing.md": [
        ("PackingIterator", "into sequences of exactly"),
        ("PackedSequence", "One packed sequence"),
    ],
    "api/windowing-recurrent.md": [("WindowedIterator", ""), ("RecurrentIterator", "")],
    "api/parallel.md": [
        ("PrefetchIterator", "produced ahead by a background worker"),
        ("ParallelMapIterator", "worker processes"),
        ("FanOut", "read once, for several consumers"),
        ("attach", "from any process of this host"),
    ],
    "api/background.md": [
        ("WorkerError", ""),
        ("Watchdog", "reports when the consumer waits too long"),
        ("start_background", ""),
    ],
    "api/datasets.md": [("chunked_dataset_iterator", "read chunk by chunk"), ("bump_seed", "")],
    "api/prepare.md": [
        ("chunk_corpus", "into chunk files"),
        ("load_index", "The index that"),
        ("ChunkIndex", "items_per_epoch"),
        ("progress", "while a progress bar counts them"),
    ],
    "api/io.md": [
        ("list_chunks", "sorted: the"),
        ("read_lines", "without their line endings"),
        ("open_output", "appears whole"),
        ("RetryPolicy", "transient storage failures"),
        ("list_parquet_chunks", "The row groups of the Parquet files"),
        ("read_parquet", "Only the byte ranges of the projected columns"),
        ("list_arrow_chunks", "The record batches of the Arrow IPC files"),
        ("read_arrow", "The rows of one record batch"),
        ("read_webdataset", "The samples of a WebDataset tar shard"),
        ("write_webdataset", "as a WebDataset tar shard"),
        ("SkippableIterator", "pass over items without producing them"),
    ],
    "api/testing.md": [
        ("assert_checkpointable", "Check the checkpoint contract"),
        ("check_resume", "interrupted and restored"),
    ],
    "api/checkpoint.md": [
        ("save_checkpoint", "atomically, as JSON"),
        ("load_checkpoint", "Read a state written by"),
        ("CheckpointFileError", ""),
        ("load_checkpoint_info", "telling which file and step were read"),
        ("LoadedCheckpoint", "The state, file and step that"),
        ("CheckpointNotFoundError", "the first run of a job"),
        ("DamagedCheckpointWarning", "loaded an older"),
        ("describe_state", ""),
    ],
    "api/stats.md": [
        ("collect", "Every stage's statistics"),
        ("report", "the stage that limits"),
        ("headspace", "when the consumer takes no time"),
        ("explain", "The origins of the item that"),
        ("LineageLog", "The training side of lineage"),
        ("traced_chunks", "whose records come as"),
    ],
    "api/distributed.md": [
        ("rank_and_world_size", "This process's rank"),
        ("gather_state", "one plain-data dict"),
        ("EqualLengthIterator", "the same number of items"),
        ("balanced_shards", "nearly equal item counts per shard"),
    ],
    "api/torch.md": [
        ("CheckpointableDataset", "IterableDataset"),
        ("pad_batch", ""),
        ("collate_packed", "Stack packed sequences"),
    ],
    "api/bad-records.md": [
        ("SkipPolicy", "whose reading or transform raises"),
        ("skip_ledgers", "The ledgers of every stage"),
        ("ParsedRecords", "goes on with the next record"),
        ("SkipIterator", "leaving out the items at chosen positions"),
    ],
}

def run_script(path: Path, cwd: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, path.name],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, (
        f"{path.name} failed (exit {result.returncode}):\n{result.stdout}\n{result.stderr}"
    )


@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_examples_run(page: str, tmp_path: Path) -> None:
    blocks = python_blocks(page)
    session = [
        f"# --- {page}, line {line}\n{code}" for title, line, code in blocks if title is None
    ]
    scripts = [(title, code) for title, _, code in blocks if title is not None]
    if page != "concepts.md":
        assert session or scripts, f"{page} has no python example"
    if session:
        path = tmp_path / "session.py"
        path.write_text("\n".join(session), encoding="utf-8")
        run_script(path, tmp_path)
    for title, code in scripts:
        path = tmp_path / title
        path.write_text(code, encoding="utf-8")
        run_script(path, tmp_path)


# -- the examples type-check ----------------------------------------------------------------

# Names that a page's examples use without defining them (fragments of a reader's own
# script): declared here with the types a reader's code would give them.
PREAMBLES = {
    "README.md": """
from collections.abc import Callable

import torch

chunk_refs: list[str]
read_chunk_fn: Callable[[str], list[str]]  # e.g. the lines of a text chunk
world_size: int
rank: int
model: torch.nn.Module
path: str
def train_step(batch: list[str]) -> None: ...
""",
}


def typed_modules(out: Path) -> dict[Path, list[tuple[int, str, int]]]:
    """Write every example as a module under `out`; for each, where its lines come from:
    (first line in the module, source file, its line there), in order."""
    modules: dict[Path, list[tuple[int, str, int]]] = {}

    def write(name: str, parts: list[tuple[str, int, str]]) -> None:
        path = out / (re.sub(r"\W", "_", name) + ".py")
        lines: list[str] = []
        origins: list[tuple[int, str, int]] = []
        for source, line, code in parts:
            origins.append((len(lines) + 1, source, line))
            lines.extend(code.splitlines())
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        modules[path] = origins

    pages = [(page, DOCS, f"docs/{page}") for page in RUNNABLE_PAGES]
    pages += [("README.md", REPO, "README.md"), ("api/index.md", DOCS, "docs/api/index.md")]
    for page, root, shown in pages:
        blocks = python_blocks(page, root)
        preamble = PREAMBLES.get(page)
        session = [(shown, line, code) for title, line, code in blocks if title is None]
        if preamble is not None:
            session.insert(0, ("the preamble of " + shown + " in test_docs.py", 0, preamble))
        if session:
            write(f"example {page}", session)
        for title, line, code in blocks:
            if title is not None:
                write(f"example {page} {title}", [(shown, line, code)])
    for tutorial in sorted((REPO / "tutorials").glob("*.py")):
        name = f"tutorials/{tutorial.name}"
        write(f"example {name}", [(name, 1, tutorial.read_text(encoding="utf-8"))])
    return modules


def where(path: Path, line: int, origins: list[tuple[int, str, int]]) -> str:
    start, source, source_line = max(origin for origin in origins if origin[0] <= line)
    return f"{source}:{source_line + line - start}"


@pytest.mark.slow
def test_examples_pass_mypy_strict() -> None:
    # A fixed folder, so that mypy's cache (keyed by module) knows the modules' paths.
    out = REPO / ".mypy_cache" / "doc-examples"
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.py"):
        stale.unlink()
    modules = typed_modules(out)
    result = subprocess.run(
        [
            *(sys.executable, "-m", "mypy", "--config-file", str(REPO / "setup.cfg")),
            *("--cache-dir", str(REPO / ".mypy_cache"), "--no-error-summary"),
            "--untyped-calls-exclude=torch",  # torch leaves some methods unannotated (backward)
            *map(str, modules),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    errors = []
    for message in result.stdout.splitlines():
        found = re.match(r"(?P<file>[^:]+\.py):(?P<line>\d+): (?P<rest>.*)", message)
        if found is None:
            errors.append(message)
            continue
        path = Path(found["file"])
        path = path if path.is_absolute() else REPO / path
        origin = where(path, int(found["line"]), modules[path]) if path in modules else path
        errors.append(f"{origin}: {found['rest']}")
    assert not errors, "the examples do not pass mypy --strict:\n" + "\n".join(errors)
    assert result.returncode == 0, result.stderr


# -- the built site ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [
            *(sys.executable, "-m", "mkdocs", "build", "--strict", "--clean"),
            *("--config-file", str(REPO / "mkdocs.yml"), "--site-dir", str(out)),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr}"
    return out


def built(site: Path, page: str) -> str:
    stem = page[: -len(".md")]
    path = site / (stem[: -len("index")] if stem.endswith("index") else stem + "/") / "index.html"
    assert path.is_file(), f"{page} was not built ({path} is missing)"
    return path.read_text(encoding="utf-8")


def visible_text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html)).replace("&#39;", "'")


@pytest.mark.parametrize("page", EXPECTED_PAGES)
def test_page_is_built(site: Path, page: str) -> None:
    assert "<h1" in built(site, page)


@pytest.mark.parametrize("page", sorted(API_CONTENT))
def test_api_pages_show_the_docstrings(site: Path, page: str) -> None:
    html = built(site, page)
    text = visible_text(html)
    for name, phrase in API_CONTENT[page]:
        assert re.search(rf'id="[\w.]*\b{name}"', html), f"{page} has no entry for {name}"
        assert phrase in text, f"{page} does not show {name}'s docstring ({phrase!r})"


def test_torch_page_lists_every_public_name(site: Path) -> None:
    import infinibatch_like.torch

    html = built(site, "api/torch.md")
    for name in infinibatch_like.torch.__all__:
        assert f'id="infinibatch_like.torch.{name}"' in html, f"api/torch.md omits {name}"


def test_checkpoint_paragraphs_render_as_boxes(site: Path) -> None:
    html = built(site, "api/shuffle.md")
    boxes = re.findall(r'<details class="checkpoint"[^>]*>\s*<summary>Checkpoint</summary>', html)
    assert len(boxes) == 2, "each shuffle stage's Checkpoint paragraph should render as a box"
    assert "Checkpoint:" not in visible_text(html)


def test_benchmark_charts_are_included(site: Path) -> None:
    html = built(site, "benchmarks.md")
    images = re.findall(r'<img[^>]+src="([^"]+\.png)"', html)
    assert images, "the benchmarks page shows no chart"
    for src in images:
        assert (site / "benchmarks" / src).resolve().is_file(), src
        assert src.rsplit("/", 1)[-1] in {path.name for path in (DOCS / "img").glob("*.png")}


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.targets: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if values.get("id"):
            self.ids.add(values["id"] or "")
        if tag == "a" and values.get("href"):
            self.targets.append(values["href"] or "")
        if tag == "img" and values.get("src"):
            self.targets.append(values["src"] or "")


def test_fault_tolerance_page_shows_the_soak_plot_and_the_table(site: Path) -> None:
    html = built(site, "howto/fault-tolerance.md")
    assert re.search(r'<img[^>]+src="[^"]*soak\.png"', html), "the soak plot is missing"
    assert (site / "img" / "soak.png").is_file()
    text = visible_text(html)
    assert "loop SIGKILL" in text
    assert "worker SIGKILL" in text


def test_internal_links_and_anchors_resolve(site: Path) -> None:
    pages: dict[Path, _Links] = {}
    for path in site.rglob("*.html"):
        if path.name == "404.html":  # its links are absolute (it is served at any depth)
            continue
        parser = _Links()
        parser.feed(path.read_text(encoding="utf-8"))
        pages[path.resolve()] = parser
    broken = []
    for path, parser in pages.items():
        for target in parser.targets:
            parts = urlsplit(target)
            if parts.scheme or parts.netloc or target.startswith(("mailto:", "javascript:")):
                continue
            resolved = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if resolved.is_dir():
                resolved = resolved / "index.html"
            if not resolved.exists():
                broken.append(f"{path.relative_to(site)}: {target}")
            elif (
                parts.fragment
                and resolved in pages
                and unquote(parts.fragment) not in pages[resolved].ids
            ):
                broken.append(f"{path.relative_to(site)}: {target} (no such anchor)")
    assert not broken, "broken links:\n" + "\n".join(sorted(set(broken)))


# -- docstrings -----------------------------------------------------------------------------

# Docstrings that griffe cannot fully parse: (module file, start of the warning, the fix).
# Such a docstring renders with that part missing. Remove an entry once it is fixed.
KNOWN_DOCSTRING_WARNINGS: list[tuple[str, str, str]] = [
]


def test_docstrings_parse_as_google_style() -> None:
    import griffe

    package = griffe.load("infinibatch_like", search_paths=[str(REPO)], docstring_parser="google")
    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    handler = Collect()
    logger = logging.getLogger("griffe")
    logger.addHandler(handler)
    try:
        for obj in _walk(package):
            if obj.docstring is not None:
                obj.docstring.parse("google")
    finally:
        logger.removeHandler(handler)
    unexpected = [
        warning
        for warning in warnings
        if not any(
            path in warning and fragment in warning
            for path, fragment, _ in KNOWN_DOCSTRING_WARNINGS
        )
    ]
    assert not unexpected, "docstrings that do not parse:\n" + "\n".join(unexpected)


def _walk(obj: Any) -> Iterator[Any]:
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)
