"""RayDataLoader's constructor: torch's argument errors, len() and frozen attributes, no Ray."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from raydl import RayDataLoader

pytestmark = pytest.mark.timeout(30)


class MapData(Dataset[int]):
    def __init__(self, n: int = 10) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class StreamData(IterableDataset[int]):
    def __init__(self, n: int = 10) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


class SizedStream(StreamData):
    def __len__(self) -> int:
        return self.n


MAP = MapData(10)
STREAM = StreamData(10)
SEQ = SequentialSampler(MAP)
BATCHES = BatchSampler(SequentialSampler(MAP), batch_size=3, drop_last=False)
NOT_A_CONTEXT = object()

# Each case: (dataset, kwargs) that torch's DataLoader rejects.
BAD_ARGUMENTS = {
    "num_workers_negative": (MAP, {"num_workers": -1}),
    "timeout_negative": (MAP, {"timeout": -0.5}),
    "prefetch_factor_without_workers": (MAP, {"prefetch_factor": 2}),
    "prefetch_factor_negative": (MAP, {"num_workers": 2, "prefetch_factor": -1}),
    "persistent_workers_without_workers": (MAP, {"persistent_workers": True}),
    "sampler_and_shuffle": (MAP, {"sampler": SEQ, "shuffle": True}),
    "batch_sampler_and_batch_size": (MAP, {"batch_sampler": BATCHES, "batch_size": 3}),
    "batch_sampler_and_shuffle": (MAP, {"batch_sampler": BATCHES, "shuffle": True}),
    "batch_sampler_and_sampler": (MAP, {"batch_sampler": BATCHES, "sampler": SEQ}),
    "batch_sampler_and_drop_last": (MAP, {"batch_sampler": BATCHES, "drop_last": True}),
    "batch_size_none_and_drop_last": (MAP, {"batch_size": None, "drop_last": True}),
    "iterable_and_shuffle": (STREAM, {"shuffle": True}),
    "iterable_and_sampler": (STREAM, {"sampler": SEQ}),
    "iterable_and_batch_sampler": (STREAM, {"batch_sampler": BATCHES}),
    # torch checks the IterableDataset conflicts before the generic ones.
    "iterable_and_shuffle_and_sampler": (STREAM, {"shuffle": True, "sampler": SEQ}),
    "context_without_workers": (MAP, {"multiprocessing_context": "spawn"}),
    "context_bad_start_method": (MAP, {"num_workers": 1, "multiprocessing_context": "bad"}),
    "context_not_a_context": (
        MAP,
        {"num_workers": 1, "multiprocessing_context": NOT_A_CONTEXT},
    ),
}


def _torch_error(dataset: Any, kwargs: dict[str, Any]) -> BaseException:
    with pytest.raises(Exception) as info:
        DataLoader(dataset, **kwargs)
    return info.value


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_argument_errors_match_torch(case: str) -> None:
    dataset, kwargs = BAD_ARGUMENTS[case]
    expected = _torch_error(dataset, kwargs)
    with pytest.raises(type(expected), match=f"^{re.escape(str(expected))}$") as info:
        RayDataLoader(dataset, **kwargs)
    assert type(info.value) is type(expected)
    assert not ray.is_initialized()


# The same messages pinned literally, so a change in either library shows up here.
@pytest.mark.parametrize(
    ("case", "message"),
    [
        (
            "num_workers_negative",
            "num_workers option should be non-negative; use num_workers=0 to disable multiprocessing.",
        ),
        ("timeout_negative", "timeout option should be non-negative"),
        (
            "prefetch_factor_without_workers",
            "prefetch_factor option could only be specified in multiprocessing.let num_workers > 0 "
            "to enable multiprocessing, otherwise set prefetch_factor to None.",
        ),
        ("persistent_workers_without_workers", "persistent_workers option needs num_workers > 0"),
        ("sampler_and_shuffle", "sampler option is mutually exclusive with shuffle"),
        (
            "batch_sampler_and_drop_last",
            "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last",
        ),
        (
            "batch_size_none_and_drop_last",
            "batch_size=None option disables auto-batching and is mutually exclusive with drop_last",
        ),
        (
            "iterable_and_shuffle",
            "DataLoader with IterableDataset: expected unspecified shuffle option, but got shuffle=True",
        ),
        (
            "iterable_and_sampler",
            f"DataLoader with IterableDataset: expected unspecified sampler option, but got sampler={SEQ}",
        ),
        (
            "iterable_and_batch_sampler",
            "DataLoader with IterableDataset: expected unspecified batch_sampler option, "
            f"but got batch_sampler={BATCHES}",
        ),
    ],
)
def test_argument_error_messages(case: str, message: str) -> None:
    dataset, kwargs = BAD_ARGUMENTS[case]
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        RayDataLoader(dataset, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"shuffle": False},
        {"shuffle": None},
        {"batch_size": None},
        {"batch_size": 4, "drop_last": True},
        {"num_workers": 2, "prefetch_factor": 0},
        {"num_workers": 1, "persistent_workers": True},
        {"batch_sampler": BATCHES, "batch_size": 1, "shuffle": False, "drop_last": False},
        {"sampler": SEQ, "shuffle": False},
    ],
    ids=repr,
)
def test_arguments_torch_accepts_are_accepted(kwargs: dict[str, Any]) -> None:
    DataLoader(MAP, **kwargs)  # the premise: torch accepts them
    RayDataLoader(MAP, **kwargs)
    assert not ray.is_initialized()


def test_iterable_dataset_accepts_shuffle_false() -> None:
    DataLoader(STREAM, shuffle=False)
    RayDataLoader(STREAM, shuffle=False)


def _sampler_cases() -> dict[str, tuple[Any, dict[str, Any]]]:
    data = MapData(23)
    generator = torch.Generator().manual_seed(0)
    return {
        "default": (data, {}),
        "batch_3": (data, {"batch_size": 3}),
        "batch_3_drop_last": (data, {"batch_size": 3, "drop_last": True}),
        "batch_7_shuffle": (data, {"batch_size": 7, "shuffle": True}),
        "batch_none": (data, {"batch_size": None}),
        "random_sampler_replacement": (
            data,
            {"batch_size": 4, "sampler": RandomSampler(data, replacement=True, num_samples=9)},
        ),
        "subset_sampler": (data, {"batch_size": 2, "sampler": SubsetRandomSampler([1, 5, 7])}),
        "weighted_sampler": (
            data,
            {
                "batch_size": 5,
                "sampler": WeightedRandomSampler([1.0] * 23, 11, generator=generator),
            },
        ),
        "distributed_sampler": (
            data,
            {"batch_size": 3, "sampler": DistributedSampler(data, num_replicas=2, rank=1)},
        ),
        "distributed_sampler_drop_last": (
            data,
            {
                "batch_size": 3,
                "drop_last": True,
                "sampler": DistributedSampler(data, num_replicas=4, rank=3, drop_last=True),
            },
        ),
        "batch_sampler": (
            data,
            {"batch_sampler": BatchSampler(SequentialSampler(data), 4, drop_last=True)},
        ),
        "list_batch_sampler": (data, {"batch_sampler": [[0, 1], [2], [3, 4, 5]]}),
        "sized_iterable": (SizedStream(23), {"batch_size": 4}),
        "sized_iterable_drop_last": (SizedStream(23), {"batch_size": 4, "drop_last": True}),
        "sized_iterable_unbatched": (SizedStream(23), {"batch_size": None}),
        "empty": (MapData(0), {"batch_size": 3}),
    }


SAMPLER_CASES = _sampler_cases()


@pytest.mark.parametrize("case", list(SAMPLER_CASES))
def test_len_matches_torch_without_starting_ray(case: str) -> None:
    dataset, kwargs = SAMPLER_CASES[case]
    expected = len(DataLoader(dataset, **kwargs))
    loader = RayDataLoader(dataset, **kwargs)
    assert len(loader) == expected
    assert not ray.is_initialized()


def test_len_of_unsized_iterable_raises_type_error_like_torch() -> None:
    with pytest.raises(TypeError) as expected:
        len(DataLoader(STREAM, batch_size=2))
    with pytest.raises(TypeError, match=re.escape(str(expected.value))):
        len(RayDataLoader(STREAM, batch_size=2))


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"shuffle": True}, {"batch_size": None}, {"num_workers": 2}, {"batch_sampler": BATCHES}],
    ids=repr,
)
def test_derived_attributes_match_torch(kwargs: dict[str, Any]) -> None:
    ours = RayDataLoader(MAP, **kwargs)
    theirs = DataLoader(MAP, **kwargs)
    assert ours.batch_size == theirs.batch_size
    assert ours.drop_last == theirs.drop_last
    assert type(ours.sampler) is type(theirs.sampler)
    assert type(ours.batch_sampler) is type(theirs.batch_sampler)
    assert ours.prefetch_factor == theirs.prefetch_factor
    assert ours.collate_fn is theirs.collate_fn
    assert ours._auto_collation == theirs._auto_collation
    assert ours._index_sampler is ours.batch_sampler or ours._index_sampler is ours.sampler


def test_default_random_sampler_uses_the_loader_generator() -> None:
    generator = torch.Generator().manual_seed(3)
    loader = RayDataLoader(MAP, shuffle=True, generator=generator)
    assert isinstance(loader.sampler, RandomSampler)
    assert loader.sampler.generator is generator


def test_construction_does_not_touch_the_generator() -> None:
    # torch draws nothing from the generator until iter(); the orders depend on it.
    generator = torch.Generator().manual_seed(3)
    state = generator.get_state()
    RayDataLoader(MAP, shuffle=True, generator=generator, num_workers=2)
    assert torch.equal(generator.get_state(), state)


def test_construction_does_not_touch_the_global_rng() -> None:
    state = torch.get_rng_state()
    RayDataLoader(MAP, shuffle=True, num_workers=2)
    RayDataLoader(STREAM, batch_size=3)
    assert torch.equal(torch.get_rng_state(), state)


FROZEN = ["batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers"]


@pytest.mark.parametrize("attr", FROZEN)
def test_frozen_attributes_raise_like_torch(attr: str) -> None:
    theirs = DataLoader(MAP)
    with pytest.raises(ValueError) as expected:
        setattr(theirs, attr, getattr(theirs, attr))
    ours = RayDataLoader(MAP)
    with pytest.raises(
        ValueError,
        match=re.escape(f"{attr} attribute should not be set after RayDataLoader is initialized"),
    ):
        setattr(ours, attr, getattr(ours, attr))
    assert str(expected.value).replace("DataLoader", "RayDataLoader") == (
        f"{attr} attribute should not be set after RayDataLoader is initialized"
    )


@pytest.mark.parametrize("attr", ["num_workers", "timeout", "worker_init_fn", "pin_memory"])
def test_other_attributes_can_be_set_like_torch(attr: str) -> None:
    value = getattr(RayDataLoader(MAP), attr)
    setattr(DataLoader(MAP), attr, value)
    loader = RayDataLoader(MAP)
    setattr(loader, attr, value)
    assert getattr(loader, attr) == value


def test_construction_and_len_do_not_start_ray() -> None:
    loaders = [
        RayDataLoader(MAP, batch_size=4, shuffle=True, num_workers=2, persistent_workers=True),
        RayDataLoader(SizedStream(5), batch_size=2, num_workers=2),
        RayDataLoader(MAP, sampler=DistributedSampler(MAP, num_replicas=2, rank=0)),
    ]
    assert [len(loader) for loader in loaders] == [3, 3, 5]
    for loader in loaders:
        loader.close()  # closing an unused loader must not need Ray either
    assert not ray.is_initialized()


def test_iter_is_what_starts_ray() -> None:
    # The autouse fixture makes ray.init raise: iter() is the first thing that needs Ray.
    with pytest.raises(AssertionError, match=r"unit tests must not call ray\.init"):
        iter(RayDataLoader(MAP, num_workers=1))


def test_num_workers_0_loads_in_process_without_ray() -> None:
    # As torch: no workers means the batches load in this process; Ray is never started.
    assert [b.tolist() for b in RayDataLoader(MAP, batch_size=4)] == [
        [0.0, 1.0, 2.0, 3.0],
        [4.0, 5.0, 6.0, 7.0],
        [8.0, 9.0],
    ]
    assert [b.tolist() for b in RayDataLoader(SizedStream(3), batch_size=2)] == [[0, 1], [2]]
    assert not ray.is_initialized()


@pytest.mark.parametrize("epoch", [1.5, "2", True])
def test_set_epoch_rejects_wrong_types(epoch: Any) -> None:
    loader = RayDataLoader(MAP)
    with pytest.raises(TypeError, match=re.escape(f"epoch should be an int, got {epoch!r}")):
        loader.set_epoch(epoch)


def test_set_epoch_rejects_negative() -> None:
    loader = RayDataLoader(MAP)
    with pytest.raises(ValueError, match=re.escape("epoch should be non-negative, got -1")):
        loader.set_epoch(-1)


def test_set_epoch_sets_the_next_epoch() -> None:
    loader = RayDataLoader(MAP)
    assert loader.epoch == 0
    loader.set_epoch(4)
    assert loader.epoch == 4


def test_a_world_of_the_wrong_type_is_named_before_it_is_used() -> None:
    with pytest.raises(TypeError, match=r"world option should be a raydl.World or None, got tuple"):
        RayDataLoader(list(range(10)), world=(0, 2))  # type: ignore[arg-type]


# -- num_workers="auto" / prefetch_factor="auto" ------------------------------------------


def test_auto_is_accepted_for_a_map_style_dataset_and_kept_as_given() -> None:
    loader = RayDataLoader(MAP, batch_size=2, num_workers="auto", prefetch_factor="auto")
    assert loader.num_workers == "auto" and loader.prefetch_factor == "auto"
    assert len(loader) == len(DataLoader(MAP, batch_size=2))
    fixed = RayDataLoader(MAP, batch_size=2, num_workers="auto")
    assert fixed.prefetch_factor == 2  # torch's default with workers


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"num_workers": "many"},
            "num_workers option should be a non-negative int or 'auto', got num_workers='many'",
        ),
        (
            {"num_workers": 2, "prefetch_factor": "Auto"},
            "prefetch_factor option should be a non-negative int or 'auto', got "
            "prefetch_factor='Auto'",
        ),
        ({"num_workers": -1}, "num_workers option should be non-negative"),  # torch's
        (
            {"num_workers": 0, "prefetch_factor": "auto"},  # torch's: no workers, no prefetch
            "prefetch_factor option could only be specified in multiprocessing",
        ),
        ({"num_workers": "auto", "cpu_budget": 0}, "cpu_budget option should be a positive"),
    ],
)
def test_bad_auto_values_name_the_option(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=re.escape(match)):
        RayDataLoader(MAP, **kwargs)


def test_a_cpu_budget_of_the_wrong_type_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=re.escape("cpu_budget option should be a number of CPUs")):
        RayDataLoader(MAP, num_workers="auto", cpu_budget="4")


@pytest.mark.parametrize("option", ["num_workers", "prefetch_factor"])
def test_auto_is_refused_for_an_iterable_dataset(option: str) -> None:
    kwargs: dict[str, Any] = {"num_workers": 2, option: "auto"}
    with pytest.raises(ValueError, match=f"{option}='auto' needs a map-style dataset"):
        RayDataLoader(StreamData(), **kwargs)
