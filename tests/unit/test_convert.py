"""raydl._internal.workers.convert: batches cross the Ray object store as numpy and come back as tensors."""

from __future__ import annotations

import pickle
from collections import OrderedDict, namedtuple
from typing import Any

import numpy as np
import pytest
import torch

from raydl._internal.workers.convert import (
    array_to_tensor,
    numpy_batch_to_tensors,
    numpy_to_tensors,
    owned_blocks,
    tensors_to_numpy,
    writable_view,
)

pytestmark = pytest.mark.timeout(30)

Point = namedtuple("Point", ["x", "y"])


def _round_trip(obj: Any) -> Any:
    """What a worker sends and the training process receives (pickled, as Ray would)."""
    return numpy_to_tensors(pickle.loads(pickle.dumps(tensors_to_numpy(obj))), owned=True)


def _assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype
        assert a.shape == b.shape
        assert a.layout == b.layout
        if a.is_sparse:
            a, b = a.to_dense(), b.to_dense()
        assert torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


NESTED = {
    "image": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "label": torch.tensor([1, 2, 3]),
    "meta": {"names": ["a", "b"], "ids": (torch.tensor([7]), 3, "x")},
    "point": Point(x=torch.ones(2), y=[torch.zeros(1, dtype=torch.int16), None]),
    "flag": True,
    "raw": b"bytes",
}


def test_round_trip_nested_structure() -> None:
    _assert_same(_round_trip(NESTED), NESTED)


def test_round_trip_without_pickling() -> None:
    _assert_same(numpy_to_tensors(tensors_to_numpy(NESTED), owned=True), NESTED)


def test_tensors_become_numpy_and_structure_is_kept() -> None:
    converted = tensors_to_numpy(NESTED)
    assert type(converted) is dict
    assert type(converted["point"]) is Point
    assert type(converted["meta"]["ids"]) is tuple
    assert type(converted["point"].y) is list
    assert not isinstance(converted["image"], torch.Tensor)
    assert converted["meta"]["names"] == ["a", "b"]
    assert converted["flag"] is True


def test_tensors_to_numpy_is_zero_copy() -> None:
    tensor = torch.arange(4)
    wrapped = tensors_to_numpy(tensor)
    back = numpy_to_tensors(wrapped, owned=False)
    back[0] = 100
    assert tensor[0] == 100


def test_round_trip_ordered_dict_keeps_type_and_order() -> None:
    batch = OrderedDict([("b", torch.tensor(1)), ("a", torch.tensor(2))])
    out = _round_trip(batch)
    assert type(out) is OrderedDict
    assert list(out) == ["b", "a"]


def test_namedtuple_type_is_kept() -> None:
    out = _round_trip(Point(torch.tensor([1.0]), torch.tensor([2.0])))
    assert isinstance(out, Point)
    assert torch.equal(out.x, torch.tensor([1.0]))


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor(3),  # zero-dim
        torch.empty(0, 5),
        torch.tensor([True, False]),
        torch.arange(6).reshape(2, 3).t(),  # non-contiguous
        torch.arange(10)[::3],  # strided view
        torch.zeros(2, dtype=torch.float16),
        torch.zeros(2, dtype=torch.uint8),
        torch.tensor([1 + 2j], dtype=torch.complex64),
    ],
    ids=["scalar", "empty", "bool", "transposed", "strided", "float16", "uint8", "complex64"],
)
def test_round_trip_tensor_kinds(tensor: torch.Tensor) -> None:
    _assert_same(_round_trip(tensor), tensor)


def test_bfloat16_travels_as_its_bits_and_comes_back_bfloat16() -> None:
    tensor = torch.tensor([1.5, 2.5], dtype=torch.bfloat16)
    converted = tensors_to_numpy({"x": tensor})
    assert not isinstance(converted["x"], torch.Tensor)  # an int16 numpy carrier, no pickling
    out = _round_trip({"x": tensor})
    assert out["x"].dtype == torch.bfloat16
    assert torch.equal(out["x"], tensor)


def test_requires_grad_tensor_is_kept_as_tensor() -> None:
    tensor = torch.ones(2, requires_grad=True)
    assert tensors_to_numpy(tensor) is tensor


def test_user_numpy_arrays_stay_numpy() -> None:
    # Only arrays that were tensors come back as tensors.
    batch = {"np": np.arange(3), "t": torch.arange(3)}
    out = _round_trip(batch)
    assert isinstance(out["np"], np.ndarray)
    assert isinstance(out["t"], torch.Tensor)


@pytest.mark.parametrize("owned", [True, False])
def test_read_only_arrays_become_writable_tensors(owned: bool) -> None:
    # Arrays from Ray's object store are read-only; the tensors handed to users must not be.
    wrapped = tensors_to_numpy(torch.arange(4))
    wrapped.array.setflags(write=False)
    tensor = numpy_to_tensors(wrapped, owned=owned)
    tensor[0] = 9  # would warn/raise on a read-only buffer
    assert tensor.tolist() == [9, 1, 2, 3]
    assert bool(wrapped.array[0] == 9) is owned  # owned: the same memory; otherwise a copy


def test_array_to_tensor_copies_only_read_only_arrays_it_does_not_own() -> None:
    writable = np.arange(3)
    assert array_to_tensor(writable, owned=False).data_ptr() == writable.ctypes.data
    frozen = np.arange(3)
    frozen.setflags(write=False)
    tensor = array_to_tensor(frozen, owned=False)
    assert tensor.data_ptr() != frozen.ctypes.data
    assert tensor.tolist() == [0, 1, 2]


def _frozen(*shape: int, dtype: Any = np.float32) -> np.ndarray:
    array = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    array.setflags(write=False)
    return array


@pytest.mark.filterwarnings("error")  # torch's "non-writable array" warning must not reach users
def test_an_owned_read_only_array_becomes_a_tensor_over_its_memory_without_a_warning() -> None:
    frozen = _frozen(4, 3)
    tensor = array_to_tensor(frozen, owned=True)
    assert tensor.data_ptr() == frozen.ctypes.data
    tensor.sub_(1)
    assert frozen[0, 0] == -1


def test_a_writable_view_keeps_its_array_alive_and_keeps_strides() -> None:
    strided = _frozen(6, 4)[::2, 1:]
    view = writable_view(strided)
    assert view.flags.writeable and view.strides == strided.strides
    tensor = torch.from_numpy(view)
    del strided, view
    import gc

    gc.collect()
    assert tensor.tolist() == [[1, 2, 3], [9, 10, 11], [17, 18, 19]]


def test_writable_view_leaves_writable_and_object_arrays_alone() -> None:
    writable = np.arange(3)
    assert writable_view(writable) is writable
    objects = np.array([b"a", None], dtype=object)
    objects.setflags(write=False)
    assert writable_view(objects) is objects


def test_owned_blocks_are_writable_views_and_their_batches_are_not_copied() -> None:
    block = {"x": _frozen(8, 2), "s": np.array(["a"] * 8)}
    (owned,) = owned_blocks([block])
    assert owned["x"].flags.writeable and np.shares_memory(owned["x"], block["x"])
    assert owned["s"] is block["s"]
    batch = numpy_batch_to_tensors({"x": owned["x"][2:6]})  # a batch cut from the block
    assert batch["x"].data_ptr() == block["x"][2:6].ctypes.data


# torch's DataLoader hands these to the training process unchanged; a worker must too.
@pytest.mark.parametrize(
    "tensor",
    [
        pytest.param(
            torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (3,), check_invariants=True),
            id="sparse_coo",
        ),
        pytest.param(torch.tensor([1 + 2j, 3 - 1j]).conj(), id="conj_bit"),
        pytest.param(torch.zeros(3, dtype=torch.float8_e4m3fn), id="float8"),
    ],
)
def test_tensors_numpy_cannot_hold_travel_as_tensors(tensor: torch.Tensor) -> None:
    out = _round_trip({"x": tensor})["x"]
    assert isinstance(out, torch.Tensor)
    assert out.dtype == tensor.dtype
    assert out.layout == tensor.layout
    expected = tensor.to_dense() if tensor.is_sparse else tensor.resolve_conj()
    got = out.to_dense() if out.is_sparse else out.resolve_conj()
    assert torch.equal(
        got.float() if got.dtype == torch.float8_e4m3fn else got,
        expected.float() if expected.dtype == torch.float8_e4m3fn else expected,
    )


# ---------------------------------------------------------------- Ray Data batches


def test_numpy_batch_numeric_columns_become_tensors() -> None:
    batch = {
        "i": np.arange(4, dtype=np.int64),
        "f": np.ones((4, 2), dtype=np.float32),
        "b": np.array([True, False, True, False]),
        "u": np.arange(4, dtype=np.uint8),
        "c": np.ones(4, dtype=np.complex64),
    }
    out = numpy_batch_to_tensors(batch)
    assert list(out) == list(batch)
    for name, column in batch.items():
        assert isinstance(out[name], torch.Tensor), name
        np.testing.assert_array_equal(out[name].numpy(), column)
    assert out["f"].shape == (4, 2)
    assert out["b"].dtype == torch.bool


def test_numpy_batch_read_only_column_becomes_writable_tensor() -> None:
    column = np.arange(3)
    column.setflags(write=False)
    out = numpy_batch_to_tensors({"x": column})
    out["x"][0] = 5
    assert out["x"].tolist() == [5, 1, 2]


def test_numpy_batch_string_columns_stay_numpy() -> None:
    batch = {"s": np.array(["a", "bc"]), "o": np.array(["x", "yz"], dtype=object)}
    out = numpy_batch_to_tensors(batch)
    assert isinstance(out["s"], np.ndarray)
    assert out["s"].tolist() == ["a", "bc"]
    assert isinstance(out["o"], np.ndarray)
    assert out["o"].tolist() == ["x", "yz"]


def test_numpy_batch_object_column_of_equal_shape_arrays_is_stacked() -> None:
    column = np.empty(3, dtype=object)
    for i in range(3):
        column[i] = np.full((2, 2), i, dtype=np.float32)
    out = numpy_batch_to_tensors({"x": column})
    assert isinstance(out["x"], torch.Tensor)
    assert out["x"].shape == (3, 2, 2)
    assert out["x"].dtype == torch.float32
    assert out["x"][2].eq(2).all()


def test_numpy_batch_ragged_column_stays_object_array() -> None:
    column = np.empty(2, dtype=object)
    column[0] = np.zeros(2)
    column[1] = np.zeros(3)
    out = numpy_batch_to_tensors({"x": column})
    assert isinstance(out["x"], np.ndarray)
    assert out["x"].dtype == object
    assert [len(v) for v in out["x"]] == [2, 3]


def test_numpy_batch_mixed_object_column_stays_object_array() -> None:
    column = np.empty(2, dtype=object)
    column[0] = np.zeros(2)
    column[1] = "not an array"
    out = numpy_batch_to_tensors({"x": column})
    assert out["x"] is column


def test_numpy_batch_empty_object_column_stays_numpy() -> None:
    column = np.empty(0, dtype=object)
    out = numpy_batch_to_tensors({"x": column})
    assert out["x"] is column


def test_an_owned_reply_copies_its_small_arrays_so_they_keep_no_images_alive() -> None:
    # A trainer keeping each batch's ids must not keep each batch's images in the store.
    wrapped = tensors_to_numpy({"image": torch.zeros(64, 3, 32, 32), "id": torch.arange(64)})
    for leaf in wrapped.values():
        leaf.array.setflags(write=False)  # as ray.get hands them back
    batch = numpy_to_tensors(wrapped, owned=True)
    assert batch["image"].data_ptr() == wrapped["image"].array.ctypes.data  # viewed
    assert batch["id"].data_ptr() != wrapped["id"].array.ctypes.data  # copied
    assert batch["id"].tolist() == list(range(64))
    # Arrays of like sizes are all viewed (a tabular batch's columns).
    alike = tensors_to_numpy((torch.zeros(64, 4), torch.arange(64)))
    for leaf in alike:
        leaf.array.setflags(write=False)  # as ray.get hands them back
    back = numpy_to_tensors(alike, owned=True)
    assert [t.data_ptr() for t in back] == [leaf.array.ctypes.data for leaf in alike]


def test_owned_blocks_copy_their_small_columns() -> None:
    block = {
        "image": _frozen(64, 3, 32, 32),
        "id": _frozen(64, dtype=np.int64),
        "weight": _frozen(64, 8),  # 2 KB, 1/96 of the images
    }
    (owned,) = owned_blocks([block])
    assert np.shares_memory(owned["image"], block["image"])
    assert not np.shares_memory(owned["id"], block["id"])
    assert not np.shares_memory(owned["weight"], block["weight"])
    assert all(column.flags.writeable for column in owned.values())
    assert owned["id"].tolist() == list(range(64)) == block["id"].tolist()
