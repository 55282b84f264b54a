"""Padding a batch of variable-length items into one numpy array or torch tensor.

This module imports torch only when asked for tensors (``to="torch"``): the numpy path works
where torch is not installed. numpy comes with the ``torch`` extra.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, TypedDict, overload

from .._core.checks import require_int
from .._core.extras import missing_extra

try:
    import numpy as np
    import numpy.typing as npt
except ModuleNotFoundError as error:  # pragma: no cover - exercised in a subprocess test
    raise missing_extra("numpy", "torch", "infinibatch_like.torch.pad_batch") from error

if TYPE_CHECKING:
    import torch
    from typing_extensions import Unpack

PadValue = int | float | bool
"""A pad value: it must be representable in the result's dtype."""

# How far a value of each numpy kind may be cast without losing its meaning: booleans fit
# every numeric dtype, integers (signed or not) fit integers and floats, floats fit floats.
_KIND_RANK = {"b": 0, "u": 1, "i": 1, "f": 2, "c": 3}


class PaddedArrays(NamedTuple):
    """A padded batch as numpy arrays, with its mask (``with_mask=True``, the default).

    Attributes:
        values: shape ``(batch, length, *item_shape)``; row i holds item i, then pad values.
        lengths: shape ``(batch,)``, int64: the length of each item (after truncation).
        mask: shape ``(batch, length)``, bool, True where `values` holds an item's element.
    """

    values: npt.NDArray[Any]
    lengths: npt.NDArray[np.int64]
    mask: npt.NDArray[np.bool_]


class PaddedArraysNoMask(NamedTuple):
    """A padded batch as numpy arrays, without a mask (``with_mask=False``): as
    `PaddedArrays`, with `mask` None."""

    values: npt.NDArray[Any]
    lengths: npt.NDArray[np.int64]
    mask: None


class PaddedTensors(NamedTuple):
    """A padded batch as CPU torch tensors, laid out as `PaddedArrays` (with its mask).

    The tensors are contiguous and may be pinned: ``DataLoader(..., pin_memory=True)``
    pins all three through `pin_memory`.
    """

    values: torch.Tensor
    lengths: torch.Tensor
    mask: torch.Tensor

    def pin_memory(self) -> PaddedTensors:
        """The same batch in page-locked memory (needs an accelerator)."""
        return PaddedTensors(*map(_pinned, self))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PaddedTensors:
        """The same batch on `device`, e.g. ``batch.to("cuda", non_blocking=True)``."""
        return PaddedTensors(*map(_mover(device, non_blocking), self))


class PaddedTensorsNoMask(NamedTuple):
    """A padded batch as CPU torch tensors, without a mask (``with_mask=False``): as
    `PaddedTensors`, with `mask` None."""

    values: torch.Tensor
    lengths: torch.Tensor
    mask: None

    def pin_memory(self) -> PaddedTensorsNoMask:
        """The same batch in page-locked memory (needs an accelerator)."""
        return PaddedTensorsNoMask(_pinned(self.values), _pinned(self.lengths), None)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PaddedTensorsNoMask:
        """The same batch on `device`, e.g. ``batch.to("cuda", non_blocking=True)``."""
        move = _mover(device, non_blocking)
        return PaddedTensorsNoMask(move(self.values), move(self.lengths), None)


def _pinned(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.pin_memory()


def _mover(
    device: torch.device | str, non_blocking: bool
) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda tensor: tensor.to(device, non_blocking=non_blocking)


class PadOptions(TypedDict, total=False):
    """The options of `pad_batch` and `padder` besides `to`, `dtype` and `with_mask` (see
    `pad_batch`), for typing wrappers: ``**options: Unpack[PadOptions]``."""

    pad_value: PadValue
    padding: Literal["longest", "max_length"]
    max_length: int | None
    truncate: bool


@overload
def pad_batch(
    items: Sequence[Any],
    *,
    to: Literal["numpy"] = "numpy",
    dtype: npt.DTypeLike | None = None,
    with_mask: Literal[True] = True,
    **options: Unpack[PadOptions],
) -> PaddedArrays: ...


@overload
def pad_batch(
    items: Sequence[Any],
    *,
    to: Literal["numpy"] = "numpy",
    dtype: npt.DTypeLike | None = None,
    with_mask: Literal[False],
    **options: Unpack[PadOptions],
) -> PaddedArraysNoMask: ...


@overload
def pad_batch(
    items: Sequence[Any],
    *,
    to: Literal["numpy"] = "numpy",
    dtype: npt.DTypeLike | None = None,
    with_mask: bool,
    **options: Unpack[PadOptions],
) -> PaddedArrays | PaddedArraysNoMask: ...


@overload
def pad_batch(
    items: Sequence[Any],
    *,
    to: Literal["torch"],
    dtype: torch.dtype | None = None,
    with_mask: Literal[True] = True,
    **options: Unpack[PadOptions],
) -> PaddedTensors: ...


@overload
def pad_batch(
    items: Sequence[Any],
    *,
    to: Literal["torch"],
    dtype: torch.dtype | None = None,
    with_mask: Literal[False],
    **options: Unpack[PadOptions],
) -> PaddedTensorsNoMask: ...


@overload
def pad_batch(
    items: Sequence[Any],
    *,
    to: Literal["torch"],
    dtype: torch.dtype | None = None,
    with_mask: bool,
    **options: Unpack[PadOptions],
) -> PaddedTensors | PaddedTensorsNoMask: ...


def pad_batch(
    items: Sequence[Any],
    *,
    pad_value: PadValue = 0,
    dtype: Any = None,
    to: Literal["numpy", "torch"] = "numpy",
    padding: Literal["longest", "max_length"] = "longest",
    max_length: int | None = None,
    truncate: bool = False,
    with_mask: bool = True,
) -> PaddedArrays | PaddedArraysNoMask | PaddedTensors | PaddedTensorsNoMask:
    """Pad variable-length items to one length and stack them, with lengths and a mask.

    Each item is a sequence of numbers (a list, a 1-D numpy array or CPU tensor), or an
    array whose first axis is its length and whose other axes (e.g. feature channels) are
    the same for every item; an empty item may be given as ``[]``. Row i of the result
    holds item i followed by `pad_value`. Use it as a DataLoader's ``collate_fn`` with
    ``functools.partial(pad_batch, to="torch", pad_value=...)`` (a partial pickles, for
    workers under ``spawn``).

    Args:
        items: the batch.
        pad_value: the value of the padding positions; it must fit `dtype` exactly when
            that is an integer or bool dtype.
        dtype: the element type: for ``to="numpy"`` anything `numpy.dtype` accepts, for
            ``to="torch"`` a `torch.dtype`; None infers it from the items (as numpy does:
            Python ints give int64, floats float64). Integer items fit integer and float
            dtypes (values are range-checked), floats only float dtypes.
        to: ``"numpy"`` for `PaddedArrays`, ``"torch"`` for `PaddedTensors` (CPU).
        padding: ``"longest"`` pads to the longest item (after truncation);
            ``"max_length"`` pads to `max_length` always (a fixed shape).
        max_length: the most elements an item may have; None means no limit.
        truncate: what to do with an item longer than `max_length`: False raises, True
            keeps its first `max_length` elements.
        with_mask: also return the boolean mask (the lengths are always returned).

    Returns:
        ``(values, lengths, mask)``: `PaddedArrays` for ``to="numpy"``, `PaddedTensors`
        for ``to="torch"``; with ``with_mask=False``, `PaddedArraysNoMask` or
        `PaddedTensorsNoMask`, whose `mask` is None. (mypy types a
        ``functools.partial`` of an overloaded function by its first overload, as numpy
        arrays: for a typed ``collate_fn`` or transform, use `padder`.)

    Raises:
        ValueError: for an empty batch, an item that is ragged inside, has no length
            axis, or another item shape; an item longer than `max_length` without
            `truncate`; an integer item value or `pad_value` that does not fit `dtype`; a
            bad `to`, `padding` or `max_length`.
        TypeError: for an item that is not numeric, or that `dtype` cannot hold without
            losing meaning (floats into an integer dtype), or a `dtype` of the wrong kind.
    """
    width = _checked_options("pad_batch", to, pad_value, padding, max_length)
    arrays = _item_arrays(items)
    lengths = np.array([len(array) for array in arrays], dtype=np.int64)
    if max_length is not None and int(lengths.max()) > max_length:
        if not truncate:
            index = int(np.argmax(lengths > max_length))
            raise ValueError(
                f"pad_batch: items[{index}] has length {lengths[index]} > max_length="
                f"{max_length}; pass truncate=True to cut it"
            )
        np.minimum(lengths, max_length, out=lengths)
    if width is None:
        width = int(lengths.max())
    staging, final = _dtypes(dtype, to, arrays)
    _check_pad_value(pad_value, staging)
    values = np.full((len(arrays), width, *_item_shape(arrays)), pad_value, dtype=staging)
    for row, (array, length) in enumerate(zip(arrays, lengths.tolist(), strict=True)):
        if length:
            values[row, :length] = _checked_cast(array[:length], staging, row)
    mask = np.arange(width) < lengths[:, None] if with_mask else None
    if to == "numpy":
        if mask is None:
            return PaddedArraysNoMask(values, lengths, None)
        return PaddedArrays(values, lengths, mask)
    tensor_values, tensor_lengths, tensor_mask = _as_tensors(values, lengths, mask, final)
    if tensor_mask is None:
        return PaddedTensorsNoMask(tensor_values, tensor_lengths, None)
    return PaddedTensors(tensor_values, tensor_lengths, tensor_mask)


def _checked_options(
    owner: str, to: str, pad_value: object, padding: str, max_length: int | None
) -> int | None:
    """Validate the options that do not depend on the items; the fixed width if
    ``padding="max_length"``."""
    if to not in ("numpy", "torch"):
        raise ValueError(f"{owner}: to must be 'numpy' or 'torch', got {to!r}")
    if not isinstance(pad_value, (int, float)):
        raise TypeError(f"{owner}: pad_value must be an int, float or bool, got {pad_value!r}")
    if max_length is not None:
        require_int(owner, "max_length", max_length, 1)
    if padding == "longest":
        return None
    if padding == "max_length":
        if max_length is None:
            raise ValueError(f"{owner}: padding='max_length' needs max_length")
        return max_length
    raise ValueError(f"{owner}: padding must be 'longest' or 'max_length', got {padding!r}")


@overload
def padder(
    *,
    to: Literal["numpy"] = "numpy",
    dtype: npt.DTypeLike | None = None,
    with_mask: Literal[True] = True,
    **options: Unpack[PadOptions],
) -> Callable[[Sequence[Any]], PaddedArrays]: ...


@overload
def padder(
    *,
    to: Literal["numpy"] = "numpy",
    dtype: npt.DTypeLike | None = None,
    with_mask: Literal[False],
    **options: Unpack[PadOptions],
) -> Callable[[Sequence[Any]], PaddedArraysNoMask]: ...


@overload
def padder(
    *,
    to: Literal["torch"],
    dtype: torch.dtype | None = None,
    with_mask: Literal[True] = True,
    **options: Unpack[PadOptions],
) -> Callable[[Sequence[Any]], PaddedTensors]: ...


@overload
def padder(
    *,
    to: Literal["torch"],
    dtype: torch.dtype | None = None,
    with_mask: Literal[False],
    **options: Unpack[PadOptions],
) -> Callable[[Sequence[Any]], PaddedTensorsNoMask]: ...


def padder(
    *,
    to: Literal["numpy", "torch"] = "numpy",
    dtype: Any = None,
    with_mask: bool = True,
    **options: Any,
) -> Callable[[Sequence[Any]], Any]:
    """`pad_batch` with its options fixed, typed by them: a ``collate_fn`` or transform.

    ``MapIterator(batches, padder(to="torch", pad_value=0))`` is typed as a MapIterator
    of `PaddedTensors` (mypy types ``functools.partial(pad_batch, to="torch")`` by
    pad_batch's first overload, as numpy arrays). The result is a ``functools.partial``,
    so it pickles for workers started with ``spawn``.

    Args:
        to: as in `pad_batch`.
        dtype: as in `pad_batch`.
        with_mask: as in `pad_batch`.
        **options: the other options of `pad_batch` (`PadOptions`).

    Raises:
        ValueError, TypeError: for a bad `to`, `pad_value`, `padding` or `max_length`
            (at once), or an unknown option.
    """
    unknown = sorted(set(options) - set(PadOptions.__annotations__))
    if unknown:
        raise TypeError(f"padder: unknown options {unknown}; see pad_batch's arguments")
    _checked_options(
        "padder",
        to,
        options.get("pad_value", 0),
        options.get("padding", "longest"),
        options.get("max_length"),
    )
    return functools.partial(pad_batch, to=to, dtype=dtype, with_mask=with_mask, **options)


def _item_arrays(items: Sequence[Any]) -> list[npt.NDArray[Any]]:
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise TypeError(f"pad_batch: items must be a sequence of items, got {items!r:.80}")
    if not items:
        raise ValueError(
            "pad_batch: items is empty: a batch needs at least one item (for a padding step, "
            "e.g. an EqualLengthIterator's fill, make a batch of one pad item such as "
            "[[pad_value]] and weight its loss 0)"
        )
    arrays = []
    for index, item in enumerate(items):
        try:
            array = np.asarray(item)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(
                f"pad_batch: items[{index}] cannot be read as a rectangular array of numbers "
                f"({error})"
            ) from None
        if array.dtype.kind not in _KIND_RANK:
            raise TypeError(
                f"pad_batch: items[{index}] must hold numbers, got {array.dtype} values: "
                f"{item!r:.80}"
            )
        if array.ndim == 0:
            raise ValueError(
                f"pad_batch: items[{index}] must be a sequence (with a length), got {item!r:.80}"
            )
        arrays.append(array)
    return arrays


def _item_shape(arrays: list[npt.NDArray[Any]]) -> tuple[int, ...]:
    """The common shape of the items' elements; empty 1-D items fit any."""
    shaped = [(index, a.shape[1:]) for index, a in enumerate(arrays) if a.ndim > 1 or len(a)]
    if not shaped:
        return ()
    first_index, shape = shaped[0]
    for index, other in shaped[1:]:
        if other != shape:
            raise ValueError(
                f"pad_batch: items[{index}] has elements of shape {other}, but "
                f"items[{first_index}] has {shape}; only the first axis may differ"
            )
    return shape


def _dtypes(
    dtype: Any, to: str, arrays: list[npt.NDArray[Any]]
) -> tuple[np.dtype[Any], torch.dtype | None]:
    """The numpy dtype to pad in and, for torch dtypes numpy lacks, the one to convert to."""
    if dtype is None:
        nonempty = [a.dtype for a in arrays if a.size] or [arrays[0].dtype]
        return np.result_type(*nonempty), None
    if to == "numpy":
        try:
            return np.dtype(dtype), None
        except TypeError:
            raise TypeError(
                f"pad_batch: dtype must be a numpy dtype for to='numpy', got {dtype!r}"
            ) from None
    import torch

    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"pad_batch: dtype must be a torch.dtype for to='torch', got {dtype!r}")
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype, None
    except TypeError:  # e.g. bfloat16: pad in float32, then convert
        if not dtype.is_floating_point:
            raise TypeError(f"pad_batch: dtype {dtype} is not supported") from None
        return np.dtype(np.float32), dtype


def _check_pad_value(pad_value: PadValue, dtype: np.dtype[Any]) -> None:
    if dtype.kind in "biu":
        bounds = (0, 1) if dtype.kind == "b" else (np.iinfo(dtype).min, np.iinfo(dtype).max)
        if not float(pad_value).is_integer() or not bounds[0] <= pad_value <= bounds[1]:
            raise ValueError(f"pad_batch: pad_value {pad_value!r} does not fit dtype {dtype}")
    elif dtype.kind not in "fc":
        raise TypeError(f"pad_batch: dtype must be numeric, got {dtype}")


def _checked_cast(array: npt.NDArray[Any], dtype: np.dtype[Any], index: int) -> npt.NDArray[Any]:
    """`array` if its values fit `dtype` without losing meaning, else a clear error."""
    if _KIND_RANK[array.dtype.kind] > _KIND_RANK[dtype.kind]:
        raise TypeError(
            f"pad_batch: items[{index}] holds {array.dtype} values, which dtype {dtype} "
            "cannot hold; choose another dtype or convert the items first"
        )
    if dtype.kind in "iu" and array.dtype.kind in "iu" and not np.can_cast(array.dtype, dtype):
        info = np.iinfo(dtype)
        low, high = array.min(), array.max()
        if low < info.min or high > info.max:
            raise ValueError(
                f"pad_batch: items[{index}] holds values in [{low}, {high}], outside the "
                f"range of dtype {dtype}"
            )
    return array


def _as_tensors(
    values: npt.NDArray[Any],
    lengths: npt.NDArray[np.int64],
    mask: npt.NDArray[np.bool_] | None,
    final: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    import torch

    tensor = torch.from_numpy(values)
    return (
        tensor if final is None else tensor.to(final),
        torch.from_numpy(lengths),
        None if mask is None else torch.from_numpy(mask),
    )
