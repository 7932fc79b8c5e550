"""The one payload a worker pool sends its actors, pickled; and, when it cannot be, why.

torch's fork-started workers inherit the dataset; raydl's workers are Ray actors
in other processes, so the dataset, ``worker_init_fn`` and ``collate_fn`` travel
pickled (Ray's cloudpickle). Two things a dataset may hold do not survive that:

* something pickle refuses (a ``threading.Lock``, a binary file, a socket):
  cloudpickle's own error names only the type (``cannot pickle '_thread.lock'
  object``);
* an open text file: cloudpickle would send a ``StringIO`` copy of its contents,
  so the worker silently reads a snapshot instead of the file. Refused here.

:func:`pickle_payload` pickles as Ray does; only after a failure does it search the
payload for the first part that fails on its own (attributes, ``__slots__``,
list/tuple/dict items, closures and globals of functions, bound methods,
``functools.partial``), bounded in depth and in objects tried, never entering an
object twice, and raises a ``TypeError`` that names that part by its path
(``dataset.reader._lock``), its type, why it must pickle and the fix. Needs no
running Ray, and keeps no state between calls (safe from any thread).
"""

from __future__ import annotations

import functools
import io
import pickle
import sys
import types
from collections import ChainMap
from collections.abc import Callable, Iterator
from typing import Any

from ray import cloudpickle  # Ray's own copy: the workers unpickle what it writes

__all__ = ["pickle_payload"]

#: How deep the search for the unpicklable part goes below ``dataset`` (and the functions).
MAX_DEPTH = 24
#: Objects the search pickles on their own, at most, before it names the deepest one found.
MAX_PROBES = 2000
#: Items of one container (list, tuple, dict, attributes) tried one by one, at most.
MAX_ITEMS = 1000


class _TextFileError(pickle.PicklingError):
    """An open text file met in the payload (cloudpickle would send a copy of its contents)."""


def _refuse_text_file(obj: io.TextIOWrapper) -> Any:
    if obj is sys.stdout:
        return getattr, (sys, "stdout")  # cloudpickle's own reduction of the standard streams
    if obj is sys.stderr:
        return getattr, (sys, "stderr")
    raise _TextFileError(f"open text file {getattr(obj, 'name', '?')!r}")


class _Pickler(cloudpickle.Pickler):
    """Ray's cloudpickle, except that an open text file is an error."""

    # Read by the C pickler when an instance is made (as cloudpickle's own table is).
    dispatch_table = ChainMap(  # noqa: RUF012
        {io.TextIOWrapper: _refuse_text_file},
        cloudpickle.Pickler.dispatch_table,
    )


class _Sink:
    """A file that forgets what is written (the search only asks whether pickling fails)."""

    def write(self, data: Any) -> int:
        return len(data)


def _drop(buffer: Any) -> None:
    """Out-of-band buffers (numpy arrays) are not copied while searching."""


def pickle_payload(
    dataset: Any,
    worker_init_fn: Callable[[int], None] | None,
    collate_fn: Callable[[Any], Any] | None,
) -> bytes:
    """``(dataset, worker_init_fn, collate_fn)`` pickled as the workers unpickle it.

    Raises:
        TypeError: Some part of it cannot travel pickled (or is an open text
            file); the message names it (``dataset.reader._lock``), its type and
            the fix.

    Example:
        >>> import pickle
        >>> data = pickle_payload([1, 2, 3], None, None)
        >>> pickle.loads(data)
        ([1, 2, 3], None, None)
    """
    payload = (dataset, worker_init_fn, collate_fn)
    with io.BytesIO() as file:
        try:
            _Pickler(file, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(payload)
        except Exception as err:
            raise _explain(payload, err) from err
        return file.getvalue()


def _probe(obj: Any) -> Exception | None:
    """Why ``obj`` alone cannot be pickled, or ``None`` if it can."""
    try:
        _Pickler(_Sink(), protocol=5, buffer_callback=_drop).dump(obj)
    except RecursionError:
        return None  # too deep to tell on its own; not what the search looks for
    except Exception as err:
        return err
    return None


class _Search:
    """The first part of the payload that fails to pickle on its own (depth-first)."""

    def __init__(self) -> None:
        self.probes = 0
        self.seen: set[int] = set()
        self.kept: list[Any] = []  # keeps probed objects alive, so their ids stay unique

    def first_leaf(
        self, obj: Any, path: str, error: Exception, depth: int
    ) -> tuple[str, Any, Exception]:
        """Below ``obj`` (which fails with ``error``): the deepest failing part on the first failing branch."""
        while depth < MAX_DEPTH:
            for name, child in _children(obj, path):
                if id(child) in self.seen or self.probes >= MAX_PROBES:
                    continue
                self.seen.add(id(child))
                self.kept.append(child)
                self.probes += 1
                child_error = _probe(child)
                if child_error is not None:
                    obj, path, error, depth = child, name, child_error, depth + 1
                    break
            else:
                break  # no part fails alone: obj itself is the culprit
        return path, obj, error


def _explain(payload: tuple[Any, Any, Any], error: Exception) -> TypeError:
    """The ``TypeError`` for a payload that failed to pickle with ``error``."""
    search = _Search()
    search.seen.add(id(payload))
    leaf: tuple[str, Any, Exception] | None = None
    for name, part in zip(("dataset", "worker_init_fn", "collate_fn"), payload, strict=True):
        search.seen.add(id(part))
        part_error = _probe(part)
        if part_error is not None:
            leaf = search.first_leaf(part, name, part_error, 0)
            break
    travel = (
        "with num_workers > 0 the dataset, worker_init_fn and collate_fn travel to the "
        "loader's Ray actors pickled (torch's fork-started workers inherit them instead)"
    )
    if leaf is None:
        return TypeError(
            f"the dataset, worker_init_fn and collate_fn cannot be pickled "
            f"({type(error).__name__}: {error}): {travel}. Make them picklable, or pass "
            "num_workers=0 to load in this process"
        )
    path, obj, leaf_error = leaf
    if isinstance(obj, io.TextIOWrapper):
        return TypeError(
            f"{path} is a file open in text mode ({getattr(obj, 'name', '?')!r}): {travel}, "
            "and pickled, each worker would get a StringIO copy of its contents, not the file. "
            "Keep its path and open it lazily in __getitem__ or in worker_init_fn, or pass "
            "num_workers=0 to load in this process"
        )
    why = "" if str(leaf_error).startswith("cannot pickle") else f" ({leaf_error})"
    return TypeError(
        f"{path} (a {_type_name(obj)}) cannot be pickled{why}: {travel}. Create it lazily "
        "in __getitem__ or in worker_init_fn (keep None or a path in __init__), drop it in "
        "__getstate__, or pass num_workers=0 to load in this process"
    )


def _type_name(obj: Any) -> str:
    cls = type(obj)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def _children(obj: Any, path: str) -> Iterator[tuple[str, Any]]:
    """``(path, part)`` of what pickling ``obj`` pickles, as far as it can be told without pickling."""
    try:
        yield from _parts(obj, path)
    except Exception:  # an object whose attributes cannot be listed: it is the leaf
        return


def _parts(obj: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for i, (key, value) in enumerate(obj.items()):
            if i >= MAX_ITEMS:
                return
            yield f"{path}[{key!r}]", value
        return
    if isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj[:MAX_ITEMS]):
            yield f"{path}[{i}]", value
        return
    if isinstance(obj, (set, frozenset)):
        for i, value in enumerate(obj):
            if i >= MAX_ITEMS:
                return
            yield f"{path}.<item {i}>", value
        return
    if isinstance(obj, types.MethodType):
        yield f"{path}.__self__", obj.__self__
        yield f"{path}.__func__", obj.__func__
        return
    if isinstance(obj, functools.partial):
        yield f"{path}.func", obj.func
        for i, value in enumerate(obj.args):
            yield f"{path}.args[{i}]", value
        for key, value in obj.keywords.items():
            yield f"{path}.keywords[{key!r}]", value
        return
    if isinstance(obj, types.FunctionType):
        yield from _function_parts(obj, path)
        return
    if isinstance(obj, type):
        for key, value in list(vars(obj).items())[:MAX_ITEMS]:
            if key not in ("__dict__", "__weakref__", "__doc__", "__module__", "__slots__"):
                yield f"{path}.{key}", value
        return
    cls = type(obj)
    if cls.__reduce_ex__ is not object.__reduce_ex__ or cls.__reduce__ is not object.__reduce__:
        return  # pickled its own way: name the object itself
    if cls.__getstate__ is not object.__getstate__:
        state = obj.__getstate__()
        if isinstance(state, tuple) and len(state) == 2:  # (__dict__, slots), as object's
            for part in state:
                yield from _attributes(part, path)
        elif isinstance(state, dict):
            yield from _attributes(state, path)
        elif state is not None:
            yield f"{path}.__getstate__()", state
    else:
        yield from _attributes(getattr(obj, "__dict__", None), path)
        slots: dict[str, Any] = {}
        for klass in cls.__mro__:
            names = klass.__dict__.get("__slots__", ())
            for name in [names] if isinstance(names, str) else names:
                if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                    slots[name] = getattr(obj, name)
        yield from _attributes(slots, path)
    if cls.__module__ == "__main__":  # pickled by value, with its class attributes
        yield f"{path}.__class__", cls


def _attributes(state: Any, path: str) -> Iterator[tuple[str, Any]]:
    if not isinstance(state, dict):
        return
    for i, (key, value) in enumerate(state.items()):
        if i >= MAX_ITEMS:
            return
        yield f"{path}.{key}", value


def _function_parts(fn: types.FunctionType, path: str) -> Iterator[tuple[str, Any]]:
    """A function's closure variables, defaults and the globals its code names."""
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        yield f"{path}.<locals>.{name}", value
    for i, value in enumerate(fn.__defaults__ or ()):
        yield f"{path}.__defaults__[{i}]", value
    for key, value in (fn.__kwdefaults__ or {}).items():
        yield f"{path}.__kwdefaults__[{key!r}]", value
    fn_globals = fn.__globals__
    for name in _global_names(fn.__code__):
        if name in fn_globals:
            yield f"{path}.<globals>.{name}", fn_globals[name]


def _global_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_names(const)
