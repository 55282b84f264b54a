"""The core every other package builds on: the protocol, `Stage`, and the small pieces of
machinery a stage needs.

- `protocol`: `CheckpointableIterator`, `SkippableIterator`, `StateMismatchError`, `State`.
- `stage`: `Stage`, the base of every stage of the library (states, restores, close), and
  the restore observers (statistics and the marking of consumers subscribe).
- `schema`: the state fields a stage declares, with validators, and their one check.
- `regroup`: what elastic restore gives the stages that regroup their states themselves.
- `graph`: the one walk over a pipeline's stages, the one path format, stages' reprs.
- `arguments`: a stage's stream-deciding arguments (fingerprint, checks, labels).
- `pickling`: a stage pickles as its constructor call and its state.
- `names`: short reprs and callables' names, for messages.
- `checks`: checks of constructor arguments (naming the stage and the argument).
- `notes`: which stage's user callable raised an error (the note added to it).
- `probe`: the per-stage counters of `infinibatch_like.stats`.
- `stretch`: exact item counts of an iterator's stretches, for the probes.
- `rng`: seeded generators whose position fits in a small state.
- `fingerprint`: short, stable fingerprints of the arguments that decide a stream.
- `extras`: the error raised when an optional extra is not installed.
"""
