"""Pretraining data: raw JSON lines to packed, masked torch batches that resume exactly,
also on another number of ranks.

Run it with ``python tutorials/07_pretraining_data.py``. It needs ``infinibatch_like`` with
its ``torch`` extra and the ``tokenizers`` package (nothing is downloaded: the tokenizer is
trained here, on the example corpus).

The story, top to bottom:

1. raw data: three JSON-lines sources of very different document lengths (short web
   pages, long books, medium code files);
2. ``chunk_corpus`` cuts each source into chunks with an index;
3. a byte-level BPE tokenizer is trained on the raw text with ``tokenizers``;
4. each of 4 virtual shards tokenizes its chunks of every source, mixes the sources by
   *tokens* (`TokenBudgetMultiplexIterator`: 50 % web, 30 % books, 20 % code), packs the
   documents into sequences of 128 tokens (`PackingIterator`, best fit) and batches them;
   `collate_packed` turns a batch into tensors with segment ids, positions, labels, a loss
   mask and ``cu_seqlens``;
5. two ranks train a toy model for a few steps, with a block-diagonal causal mask built
   from the segment ids;
6. the ranks checkpoint (a few KB: no tokens), the job "crashes", and three ranks resume:
   every shard continues exactly where it stopped.

Every claim the comments make is checked with an ``assert``.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from collections import defaultdict
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # before worker processes fork

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from infinibatch_like import PackingIterator, TokenBudgetMultiplexIterator
from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.distributed.elastic import elastic_state
from infinibatch_like.distributed.sharded import ShardedIterator
from infinibatch_like.io import read_jsonl
from infinibatch_like.iterators import CheckpointableIterator, FixedBatchIterator, MapIterator
from infinibatch_like.prepare import chunk_corpus, load_index
from infinibatch_like.torch import PackedBatch, collate_packed

NUM_SHARDS = 4
SEQ_LEN = 128
BATCH_SIZE = 4
WEIGHTS = {"web": 0.5, "books": 0.3, "code": 0.2}  # shares of tokens, not of documents

# ---------------------------------------------------------------------------------------
# Step 1: raw data. Web pages of ~25 words, books of ~250, code files of ~80.
# ---------------------------------------------------------------------------------------

WORDS = [
    "the",
    "of",
    "data",
    "model",
    "train",
    "token",
    "shard",
    "batch",
    "resume",
    "mix",
    "pack",
    "loss",
    "step",
    "rank",
]
SYMBOLS = [
    "def",
    "return",
    "(",
    ")",
    ":",
    "=",
    "+",
    "-",
    "[",
    "]",
    "self",
    "if",
    "else",
    "for",
    "in",
]


def write_source(path: Path, count: int, mean_words: int, vocabulary: list[str]) -> None:
    rng = random.Random(path.name)
    with path.open("w", encoding="utf-8") as out:
        for number in range(count):
            words = max(1, int(rng.lognormvariate(0, 0.6) * mean_words))
            text = " ".join(rng.choice(vocabulary) for _ in range(words))
            out.write(json.dumps({"id": f"{path.stem}-{number}", "text": text}) + "\n")


workdir = Path(tempfile.mkdtemp(prefix="pretraining_data_"))
(workdir / "raw").mkdir()
LAYOUT = {"web": (800, 25, WORDS), "books": (120, 250, WORDS), "code": (300, 80, SYMBOLS + WORDS)}
for name, (count, mean_words, vocabulary) in LAYOUT.items():
    write_source(workdir / "raw" / f"{name}.jsonl", count, mean_words, vocabulary)

# ---------------------------------------------------------------------------------------
# Step 2: chunk every source (`python -m infinibatch_like chunk` does the same from a
# shell) and split its chunks into the 4 shards by item count.
# ---------------------------------------------------------------------------------------

shards: dict[str, list[list[str]]] = {}
for name, (count, _mean_words, _vocabulary) in LAYOUT.items():
    chunk_corpus([str(workdir / "raw" / f"{name}.jsonl")], str(workdir / name),
                 items_per_chunk=-(-count // 8), workers=1)  # fmt: skip
    index = load_index(str(workdir / name))
    assert len(index) == count
    assert len(index.chunks) == 8
    shards[name] = index.shards(NUM_SHARDS)

# ---------------------------------------------------------------------------------------
# Step 3: a byte-level BPE trained on the raw text, with pad, BOS and EOS tokens.
# ---------------------------------------------------------------------------------------

tokenizer = Tokenizer(models.BPE())
tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
trainer = trainers.BpeTrainer(
    vocab_size=400,
    special_tokens=["[PAD]", "[BOS]", "[EOS]"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
)
texts = (json.loads(line)["text"] for name in LAYOUT for line in
         (workdir / "raw" / f"{name}.jsonl").open(encoding="utf-8"))  # fmt: skip
tokenizer.train_from_iterator(texts, trainer)


def token_id(token: str) -> int:
    found = tokenizer.token_to_id(token)
    assert found is not None, f"the tokenizer has no {token}"
    return found


PAD, BOS, EOS = (token_id(token) for token in ("[PAD]", "[BOS]", "[EOS]"))
VOCAB = tokenizer.get_vocab_size()
assert (PAD, BOS, EOS) == (0, 1, 2)

# ---------------------------------------------------------------------------------------
# Step 4: one shard's pipeline. Records -> (source, token ids) -> mixed by tokens -> packed
# -> batches of 4 sequences, tagged with the shard (to check the resume below).
# ---------------------------------------------------------------------------------------


def tokenized(name: str, record: dict[str, Any]) -> tuple[str, list[int]]:
    return name, tokenizer.encode(record["text"]).ids


def token_count(item: tuple[str, list[int]]) -> int:
    return len(item[1])


def mixed_documents(shard: int) -> TokenBudgetMultiplexIterator[tuple[str, list[int]]]:
    sources = [
        MapIterator(
            chunked_dataset_iterator(shards[name][shard], read_jsonl, buffer_size=100, seed=shard),
            partial(tokenized, name),
        )
        for name in WEIGHTS
    ]
    return TokenBudgetMultiplexIterator(sources, list(WEIGHTS.values()), cost=token_count)


def ids_of(item: tuple[str, list[int]]) -> list[int]:
    return item[1]


def tagged(shard: int, batch: list[Any]) -> tuple[int, list[Any]]:
    return shard, batch


def shard_pipeline(shard: int, num_shards: int) -> CheckpointableIterator[tuple[int, list[Any]]]:
    documents = MapIterator(mixed_documents(shard), ids_of)
    packed = PackingIterator(documents, SEQ_LEN, strategy="best_fit", window=8,
                             pad_id=PAD, bos_id=BOS, eos_id=EOS)  # fmt: skip
    return MapIterator(FixedBatchIterator(packed, BATCH_SIZE), partial(tagged, shard))


def to_tensors(item: tuple[int, list[Any]]) -> tuple[int, PackedBatch]:
    shard, sequences = item
    return shard, collate_packed(sequences)


def rank_pipeline(rank: int, world_size: int) -> MapIterator[tuple[int, PackedBatch]]:
    return MapIterator(ShardedIterator(shard_pipeline, NUM_SHARDS, rank, world_size), to_tensors)


# Mixing counts tokens: over 1,000 documents of shard 0 the token shares are the weights
# within a percent, while the document shares are far from them (web pages are short).
tokens_per_source: dict[str, int] = defaultdict(int)
documents_per_source: dict[str, int] = defaultdict(int)
for name, ids in islice(mixed_documents(0), 1000):
    tokens_per_source[name] += len(ids)
    documents_per_source[name] += 1
total_tokens = sum(tokens_per_source.values())
for name, weight in WEIGHTS.items():
    share = tokens_per_source[name] / total_tokens
    print(
        f"{name:>5}: {share:.1%} of the tokens, {documents_per_source[name] / 10:.1f}% of "
        f"the documents (target {weight:.0%} of the tokens)"
    )
    assert abs(share - weight) < 0.01
assert documents_per_source["web"] > 5 * documents_per_source["books"]

# ---------------------------------------------------------------------------------------
# Step 5: two ranks train a toy model for 6 steps. The segment ids give each document its
# own causal attention block; labels are the next token of the same document (-100 where
# there is none); the loss mask leaves padding out.
# ---------------------------------------------------------------------------------------

torch.manual_seed(0)
embedding = torch.nn.Embedding(VOCAB, 32)
head = torch.nn.Linear(32, VOCAB)
optimizer = torch.optim.SGD([*embedding.parameters(), *head.parameters()], lr=0.1)


def train_step(batch: PackedBatch) -> float:
    segments = batch.segment_ids
    causal = torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool).tril()
    allowed = (segments[:, :, None] == segments[:, None, :]) & causal  # (batch, L, L)
    hidden = embedding(batch.tokens)
    attended = torch.nn.functional.scaled_dot_product_attention(
        hidden[:, None], hidden[:, None], hidden[:, None], attn_mask=allowed[:, None]
    )[:, 0]
    logits = head(attended)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch.labels.reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


old_ranks = [rank_pipeline(rank, 2) for rank in range(2)]
for step in range(6):
    for rank, pipeline in enumerate(old_ranks):
        shard, batch = next(pipeline)
        assert batch.tokens.shape == (BATCH_SIZE, SEQ_LEN)
        assert shard % 2 == rank
        assert torch.equal(batch.loss_mask, batch.segment_ids > 0)
        assert int(batch.cu_seqlens[-1]) == BATCH_SIZE * SEQ_LEN
        loss = train_step(batch)
    print(f"step {step}: loss {loss:.3f}, padding {1 - batch.loss_mask.float().mean():.1%}")

# ---------------------------------------------------------------------------------------
# Step 6: checkpoint. In a job, `gather_state(pipeline)` collects every rank's state and
# rank 0 saves it next to the model; here the two ranks live in one process. The state
# names source positions, never tokens: a few KB for the whole job.
# ---------------------------------------------------------------------------------------

saved = json.dumps([pipeline.getstate() for pipeline in old_ranks])
print(f"data state of 2 ranks and {NUM_SHARDS} shards: {len(saved):,} bytes of JSON")
assert len(saved) < 16_000

# What the run would have seen without a crash, per shard: 5 more batches each.
expected: dict[int, list[PackedBatch]] = defaultdict(list)
for pipeline in old_ranks:
    for shard, batch in islice(pipeline, 10):
        expected[shard].append(batch)
    pipeline.close()

# The job "crashes" and comes back on 3 ranks. Each rank restores its shards from the old
# ranks' states (`restore_state(pipeline, gathered)` in a job does this from the
# `gather_state` result); a rank owning two shards gets both.
states = json.loads(saved)
resumed: dict[int, list[PackedBatch]] = defaultdict(list)
for rank in range(3):
    pipeline = rank_pipeline(rank, 3)
    pipeline.setstate(elastic_state(pipeline, states, rank, 3))
    owned = range(rank, NUM_SHARDS, 3)  # shard s runs on rank s % world_size
    for shard, batch in islice(pipeline, 5 * len(owned)):
        resumed[shard].append(batch)
    pipeline.close()

for shard in range(NUM_SHARDS):
    assert len(resumed[shard]) == len(expected[shard]) == 5
    for got, want in zip(resumed[shard], expected[shard], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got[:6], want[:6], strict=True))
print("3 ranks resumed every shard exactly where the 2 ranks stopped")
