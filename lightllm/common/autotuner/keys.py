"""Turning a launcher call into keys: pick parameters by name, freeze keys, measure key distance."""

import inspect
import json
import math
import operator
from typing import Any, Callable, Dict, Sequence, Tuple


class ParamPicker:
    """Takes the values of named launcher parameters from one call, by name or by position.

    Built once per (launcher, key function); ``pick`` runs on every kernel call, so it avoids
    ``inspect.Signature.bind``.
    """

    def __init__(self, kernel_name: str, launcher: Callable, names: Sequence[str]):
        params = inspect.signature(launcher).parameters
        positions = {}
        for i, p in enumerate(params.values()):
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                positions[p.name] = i
        self.kernel_name = kernel_name
        self.names = tuple(names)
        self._slots = []
        for name in self.names:
            if name not in params:
                raise TypeError(f"autotune kernel {kernel_name!r}: launcher has no parameter {name!r} to key on")
            default = params[name].default
            self._slots.append((name, positions.get(name), default is not inspect.Parameter.empty, default))
        # Every picked name positional in the launcher: a call without keyword arguments (the usual one) is read
        # with one itemgetter over its arguments, defaults filled in, with no loop and no dict.
        self.places = places = tuple(positions.get(name) for name in self.names)
        self.fast_from = None  # the fewest positional arguments the fast path takes; None: never
        if places and None not in places:
            ordered = list(params.values())[: max(places) + 1]
            fill = tuple(p.default for p in ordered)
            required = [pos for pos in places if fill[pos] is inspect.Parameter.empty]
            self.fast_from = max(required) + 1 if required else 0
            get = operator.itemgetter(*places) if len(places) > 1 else lambda args: (args[places[0]],)
            width = len(fill)

            def values(args: tuple) -> tuple:
                if len(args) < width:
                    args = args + fill[len(args) :]
                return get(args)

            self.values = values

    def pick(self, args: tuple, kwargs: dict) -> Dict[str, Any]:
        values = {}
        for name, pos, has_default, default in self._slots:
            if name in kwargs:
                values[name] = kwargs[name]
            elif pos is not None and pos < len(args):
                values[name] = args[pos]
            elif has_default:
                values[name] = default
            else:
                raise TypeError(f"autotune kernel {self.kernel_name!r}: call is missing required parameter {name!r}")
        return values


def key_caller(picker: ParamPicker, func: Callable) -> Callable[[tuple, dict], Any]:
    """``(args, kwargs) -> func(picked values)``; a call with no keyword arguments (the usual one) calls ``func``
    positionally, with no dict built (every tuned call calls its static and its run key function)."""
    kinds = [p.kind for p in inspect.signature(func).parameters.values()]
    pick, fast_from = picker.pick, picker.fast_from
    if fast_from is None or not all(k is inspect.Parameter.POSITIONAL_OR_KEYWORD for k in kinds):
        return lambda args, kwargs: func(**pick(args, kwargs))
    if len(picker.places) == 1:  # one parameter, e.g. the run key's: index the call's arguments directly
        (place,) = picker.places

        def call_one(args: tuple, kwargs: dict) -> Any:
            if not kwargs and len(args) > place:
                return func(args[place])
            return func(**pick(args, kwargs))

        return call_one
    values = picker.values

    def call(args: tuple, kwargs: dict) -> Any:
        if not kwargs and len(args) >= fast_from:
            return func(*values(args))
        return func(**pick(args, kwargs))

    return call


def param_names(func: Callable) -> Tuple[str, ...]:
    """Names a key function asks for; ``*args``/``**kwargs`` are not allowed (keys must be explicit)."""
    names = []
    for p in inspect.signature(func).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"{func.__qualname__}: key functions must name launcher parameters, not use *args")
        names.append(p.name)
    return tuple(names)


_SCALAR_TYPES = frozenset((bool, int, float, str, type(None)))


def freeze(key: Any) -> Any:
    """A hashable, JSON-round-trippable form: dicts become sorted item tuples, lists become tuples."""
    if type(key) in _SCALAR_TYPES:  # most values: skip the isinstance chain (every tuned call freezes its keys)
        return key
    if type(key) is dict:
        for k, v in key.items():
            if type(k) is not str or type(v) not in _SCALAR_TYPES:
                break
        else:  # the usual flat key of names and scalars: sorted, it is frozen (unique keys: no value compared)
            return tuple(sorted(key.items()))
    if isinstance(key, dict):
        return tuple(sorted([(str(k), freeze(v)) for k, v in key.items()]))
    if isinstance(key, (list, tuple)):
        return tuple([freeze(v) for v in key])
    if isinstance(key, (bool, int, float, str)) or key is None:
        return key
    # torch.dtype and friends: their str() is stable across processes.
    return str(key)


def is_flat_key(key: Any) -> bool:
    """A dict of str names to scalars: equal such keys freeze equal, and nothing inside one can change in place."""
    return type(key) is dict and all(type(k) is str and type(v) in _SCALAR_TYPES for k, v in key.items())


def key_to_json(key: Any) -> str:
    return json.dumps(key, separators=(",", ":"), sort_keys=True, default=str)


def key_from_json(text: str) -> Any:
    return freeze(json.loads(text))


def default_run_key_distance(run_key: Any, cached_key: Any) -> float:
    """L1 distance between numeric keys (or equal-length tuples of numbers); otherwise equal-or-infinite."""
    if _is_number(run_key) and _is_number(cached_key):
        return abs(run_key - cached_key)
    if isinstance(run_key, tuple) and isinstance(cached_key, tuple) and len(run_key) == len(cached_key):
        if all(_is_number(a) and _is_number(b) for a, b in zip(run_key, cached_key)):
            return sum(abs(a - b) for a, b in zip(run_key, cached_key))
    return 0.0 if run_key == cached_key else math.inf


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
