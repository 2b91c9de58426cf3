"""Check 3 of :mod:`dpexp.privacy.verification`: no state carried from one batch to a later forward.

A private step's released sum must depend on its own micro-batch (and the parameters) alone. State a
training forward leaves in the model carries that batch's data into later outputs, neither clipped nor
noised, and the accounting does not see it. Three places hold such state:

- **Buffers.** A training forward that changes one (BatchNorm's and I-BERT's running statistics) is refused
  at its end, whatever the values: buffers reach evaluation and the saved model.
- **Parameters and buffers written out of autograd's sight** (Glow's ActNorm sets its bias from the first
  batch's mean through ``.data``, which bumps no version counter): a verified forward (the first of each
  input structure, every one with ``verify_every_step``) must leave every parameter's and buffer's storage
  and values as they were (compared by sum and norm, so no copy is kept).
- **Plain attributes that hold tensors** (``self.prev = h.detach()``, tensors in lists and dicts), which
  ``state_dict`` does not show. A module may keep one legitimately: a table computed from shapes alone (ESM's
  rotary cache), or state its owner resets before every call (RecurrentGemma's RG-LRU). So an attribute a
  training forward wrote is refused when a later call of its module still finds it (the same tensor at the
  same in-place version) and it is not established as free of the batch's data. Check 4's replay of a
  verified forward establishes it: the attributes that forward wrote are set back to copies of their values
  before it, the forward runs again with example 0 replaced, and an attribute whose values come out
  different depends on the data (:meth:`StateWatch.replaying`). An attribute the replay found independent
  must stay so: written again with the same shapes and other values, it is refused at once if a call of
  that forward found the earlier value, and counts as dependent from then on.

The replay changes example 0 only, as check 4 does: a value computed from other examples alone (a batch
maximum example 0 does not reach) passes it, and is refused when a later forward that found it writes other
values of the same shapes, at that forward's end, before its backward. The engine cannot see whether a
call reads an attribute: one it finds is taken as read (a module that records its last attention map for
inspection and never reads it is refused once the map is found to hold data; delete it after use). An
attribute read by a module other than its owner is seen only through its owner's calls.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

_MODULE_FIELDS = frozenset(vars(nn.Module()))  # nn.Module's bookkeeping: parameters, buffers, hooks
_ABSENT = object()  # an attribute a module did not have

Key = tuple[str, str]  # (module name, attribute)


def attribute_tensors(value: Any, depth: int = 0) -> list[torch.Tensor]:
    """The tensors an attribute holds: itself, or those in its lists, tuples and dicts (three levels);
    parameters are left out (the optimizer changes them, and :meth:`StateWatch.check` watches them)."""
    if isinstance(value, nn.Parameter):
        return []
    if torch.is_tensor(value):
        return [value]
    if depth > 2:
        return []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return [t for v in value for t in attribute_tensors(v, depth + 1)]
    return []


def _copied(value: Any) -> Any:
    """``value`` with its lists, tuples and dicts rebuilt and its tensors cloned (detached); anything else,
    parameters included, as it is."""
    if torch.is_tensor(value) and not isinstance(value, nn.Parameter):
        return value.detach().clone()
    if type(value) is dict:
        return {k: _copied(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_copied(v) for v in value)
    return value


def _fingerprints(model: nn.Module) -> dict[str, tuple[int, torch.Tensor]]:
    """Every parameter's and buffer's storage and values, summarised without a copy: (data pointer, (sum,
    norm)); equal values give equal summaries (the reductions are deterministic)."""
    out = {}
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            t = t.detach()
            moments = [t.sum()] + ([torch.linalg.vector_norm(t)] if t.is_floating_point() else [])
            out[name] = (t.data_ptr(), torch.stack([m.double() for m in moments]).cpu())
    return out


def _same_values(a: Any, b: Any) -> bool:
    ta, tb = attribute_tensors(a), attribute_tensors(b)
    return len(ta) == len(tb) and all(
        x.shape == y.shape and x.dtype == y.dtype and torch.equal(x.detach(), y.detach())
        for x, y in zip(ta, tb, strict=True)
    )


def _shapes(value: Any) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in attribute_tensors(value))


class StateWatch:
    """Check 3 on one model (module docstring). The verifier calls :meth:`start` and :meth:`check` around
    every training forward and runs check 4's replay inside :meth:`replaying`; the opacus baseline installs
    :meth:`hooks`, and never replays, so there every attribute read again is refused. ``ignored`` names
    attributes a backend's own hooks keep on modules (Opacus' ``activations``)."""

    def __init__(self, model: nn.Module, ignored: frozenset[str] = frozenset()) -> None:
        self.model, self._ignored = model, _MODULE_FIELDS | ignored
        self._buffers: dict[str, tuple[int, int]] = {}
        self._before: dict[Key, tuple] = {}  # at the forward's start: each attribute's (id, version)s
        self._values: dict[str, tuple] | None = None  # parameters' and buffers' values before a verification
        self._snapshot: dict[Key, Any] | None = None  # copies of all attributes before a verification
        self._pending: set[Key] = set()  # written since the snapshot, not yet replayed
        self._written: dict[Key, list[tuple[weakref.ref, int]]] = {}  # what a training forward left
        self._independent: dict[Key, dict[tuple, Any]] = {}  # the replay found no data: values by shapes
        self._dependent: set[Key] = set()
        self._found: set[Key] = set()  # independent attributes a call of this forward found again
        self._watched: dict[str, Any] = {}  # module name -> its pre-hook's handle

    # ------------------------------------------------------------------ around a training forward
    def _attributes(self) -> dict[Key, Any]:
        return {
            (name, key): value
            for name, module in self.model.named_modules()
            for key, value in vars(module).items()
            if key not in self._ignored
        }

    def start(self, snapshot: bool = False) -> None:
        """A training forward begins; ``snapshot``: it is the first of a verification, which check 4 will
        replay from the attributes as they are now."""
        self._buffers = {name: (id(b), b._version) for name, b in self.model.named_buffers()}
        self._found = set()
        attributes = self._attributes()
        self._before = {
            key: tuple((id(t), t._version) for t in attribute_tensors(value))
            for key, value in attributes.items()
        }
        if snapshot:
            self._snapshot = {key: _copied(value) for key, value in attributes.items()}
            self._pending = set()
            self._values = _fingerprints(self.model)

    def check(self) -> None:
        """A training forward ended: refuse a changed buffer (and, in a verification, a parameter or buffer
        whose values changed out of autograd's sight); note the tensor attributes it wrote."""
        self._check_buffers()
        self._check_values()
        for key, value in self._attributes().items():
            tensors = attribute_tensors(value)
            if not tensors or self._before.get(key) == tuple((id(t), t._version) for t in tensors):
                continue
            self._written[key] = [(weakref.ref(t), t._version) for t in tensors]
            if self._snapshot is not None:
                self._pending.add(key)
            if key in self._independent:
                self._check_unchanged(key, value)
            name = key[0]
            if name not in self._watched:
                module = self.model.get_submodule(name)
                self._watched[name] = module.register_forward_pre_hook(partial(self._called, name))

    def _check_buffers(self) -> None:
        after = {name: (id(b), b._version) for name, b in self.model.named_buffers()}
        changed = [name for name, state in after.items() if self._buffers.get(name) != state]
        if not changed:
            return
        owner, _, buffer = changed[0].rpartition(".")
        raise ValueError(
            f"module {owner!r} ({type(self.model.get_submodule(owner)).__name__}) changed its buffer "
            f"{buffer!r} in a training forward: state computed from raw batches is neither clipped nor "
            "noised and leaks through the model's later outputs. Stop the module from tracking it (e.g. "
            "track_running_stats=False), or replace the module."
            + (f" Also changed: {changed[1:5]}." if len(changed) > 1 else "")
        )

    def _check_values(self) -> None:
        """A data-dependent initialisation (Glow's ActNorm sets its bias from the first batch's mean through
        ``.data``, which no version counter sees) puts raw data into every later step."""
        if self._values is None:
            return
        now = _fingerprints(self.model)
        changed = [
            name
            for name, (pointer, moments) in self._values.items()
            if name not in now or now[name][0] != pointer or not torch.equal(now[name][1], moments)
        ]
        if not changed:
            return
        owner, _, leaf = changed[0].rpartition(".")
        raise ValueError(
            f"module {owner!r} ({type(self.model.get_submodule(owner)).__name__}) changed {leaf!r} in a "
            "training forward (e.g. a data-dependent initialisation through .data): values computed from a "
            "raw batch are neither clipped nor noised and reach every later step. Initialise it before "
            "training, from public data, or with the model's own initialiser."
        )

    def _check_unchanged(self, key: Key, value: Any) -> None:
        """An attribute the replay found free of data, written again: same shapes must mean same values. If
        not, it depends on the data after all, and this forward is refused if one of its calls found the
        earlier value (else the attribute is only dependent from now on)."""
        seen = self._independent[key]
        shapes = _shapes(value)
        if shapes not in seen:
            seen[shapes] = _copied(value)
        elif not _same_values(seen[shapes], value):
            self._dependent.add(key)
            del self._independent[key]
            if key not in self._found:
                return
            raise ValueError(
                f"{self._describe(key)} was written by this training forward with other values than an "
                "earlier one of the same shapes, so it depends on the batch's data (check 4's replay, which "
                "changes one example, had not shown it): state carried from one batch to the next is "
                "neither clipped nor noised. Reset or delete the attribute before each call, or compute it "
                "from the call's own inputs."
            )

    # ------------------------------------------------------------------ calls that find an attribute again
    def _called(self, name: str, module: nn.Module, args: tuple) -> None:
        for key, refs in self._written.items():
            if key[0] != name or key in self._pending:
                continue
            tensors = attribute_tensors(vars(module).get(key[1]))
            if not any(ref() is t and t._version == v for t in tensors for ref, v in refs):
                continue
            if key not in self._independent:
                raise ValueError(self._stale_message(key))
            self._found.add(key)

    def _stale_message(self, key: Key) -> str:
        if key in self._dependent:
            why = (
                "and check 4's replay, with one example changed, gave it other values: it holds the "
                "batch's data"
            )
        else:
            why = (
                "and no replay established that it is free of the batch's data (it was written by a "
                "forward that was not verified: construct the PrivacyEngine with verify_every_step=True, "
                "or use the engine rather than a baseline that does not verify)"
            )
        return (
            f"{self._describe(key)} was written by an earlier training forward and is still there at this "
            f"call, {why}. State carried from one batch to a later forward is neither clipped nor noised. "
            "Reset or delete the attribute before each call (as Hugging Face's RecurrentGemma does), or "
            "compute it from the call's own inputs."
        )

    def _describe(self, key: Key) -> str:
        name, attribute = key
        return (
            f"module {name!r} ({type(self.model.get_submodule(name)).__name__}): its attribute {attribute!r}"
        )

    # ------------------------------------------------------------------ check 4's replay
    @contextmanager
    def replaying(self) -> Iterator[None]:
        """Run check 4's replay of the pending verification inside: the attributes the verified forward
        wrote are set to copies of their values before it; after the replay, an attribute with the real
        forward's values is independent of the data, one with other values dependent; the real values are
        put back. A replay that raises classifies nothing."""
        pending, snapshot = self._pending, self._snapshot or {}
        self._pending, self._snapshot = set(), None
        modules = {key: self.model.get_submodule(key[0]) for key in pending}
        real = {key: vars(modules[key]).get(key[1], _ABSENT) for key in pending}
        for key in pending:
            self._set(modules[key], key[1], _copied(snapshot.get(key, _ABSENT)))
        try:
            yield
        except BaseException:
            for key in pending:
                self._set(modules[key], key[1], real[key])
            raise
        for key in pending:
            replayed = vars(modules[key]).get(key[1], _ABSENT)
            if real[key] is not _ABSENT and replayed is not _ABSENT and _same_values(real[key], replayed):
                if key not in self._dependent:
                    self._independent.setdefault(key, {})[_shapes(real[key])] = _copied(real[key])
            else:
                self._dependent.add(key)
                self._independent.pop(key, None)
            self._set(modules[key], key[1], real[key])

    @staticmethod
    def _set(module: nn.Module, attribute: str, value: Any) -> None:
        if value is _ABSENT:
            vars(module).pop(attribute, None)
        else:
            vars(module)[attribute] = value

    # ------------------------------------------------------------------ a watch without a verifier
    def hooks(self) -> list[Any]:
        """Check around every training forward of the model; returns the removable hook handles."""

        def before(module: nn.Module, args: tuple) -> None:
            if torch.is_grad_enabled():
                self.start()

        def after(module: nn.Module, args: tuple, output: Any) -> None:
            if torch.is_grad_enabled():
                self.check()

        return [self.model.register_forward_pre_hook(before), self.model.register_forward_hook(after)]

    def settle(self) -> None:
        """The verification's backward ended: attributes it wrote and did not replay stay unestablished."""
        self._snapshot, self._pending, self._values = None, set(), None

    def remove(self) -> None:
        for handle in self._watched.values():
            handle.remove()
        self._watched.clear()
