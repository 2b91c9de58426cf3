"""Check 3 of :mod:`dpexp.privacy.verification`: no state carried from one batch to a later forward.

A private step's released sum must depend on its own micro-batch (and the parameters) alone. State a
training forward leaves in the model carries that batch's data into later outputs, neither clipped nor
noised, and the accounting does not see it. Three places hold such state:

- **Buffers.** A training forward that changes one (BatchNorm's and I-BERT's running statistics) is refused
  at its end, whatever the values: buffers reach evaluation and the saved model.
- **Parameters and buffers written out of autograd's sight** (Glow's ActNorm sets its bias from the first
  batch's mean through ``.data``, which bumps no version counter). A verified forward (the first of each
  input structure, every one with ``verify_every_step``) must leave every parameter's and buffer's values
  as they were (compared by sum and norm: no copy is kept), unless it casts them to another dtype (Switch
  Transformers' router moves its classifier to float32 in its forward); refused at its end, before its
  backward. A forward that was not verified is not compared.
- **Plain attributes that hold tensors** (``self.prev = h.detach()``, tensors in lists and dicts), which
  ``state_dict`` does not show. A module may keep one legitimately: a table computed from shapes alone (a
  rotary cache rebuilt for new lengths), or state its owner resets before every call (RecurrentGemma's
  RG-LRU). So an attribute a training forward wrote is refused when a later call of its module still finds
  it (the same tensor at the same in-place version) and it is not established as free of the batch's data.
  Check 4's replay of a verified forward establishes it: the attributes that forward wrote are set back to
  copies of their values before it, the forward runs again with example 0 replaced, and an attribute whose
  values come out different depends on the data (:meth:`StateWatch.replaying`). An attribute the replay
  found independent must stay so: written again with the same shapes and other values, it is refused at
  once if a call of that forward found the earlier value, and counts as dependent from then on. One
  written in a micro-batch that cannot be replayed (one example) stays unestablished.

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

from dpexp.privacy.containers import map_tensors, tensors_in

_MODULE_FIELDS = frozenset(vars(nn.Module()))  # nn.Module's bookkeeping: parameters, buffers, hooks
_ABSENT = object()  # an attribute a module did not have

Key = tuple[str, str]  # (module name, attribute)
_HOLDERS = (torch.Tensor, list, tuple, dict)  # the values :func:`attribute_tensors` finds tensors in


def attribute_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors an attribute holds: itself, or those in its lists, tuples and dicts (three levels);
    parameters are left out (the optimizer changes them, and :meth:`StateWatch.check` watches them)."""
    return [t for t in tensors_in(value, levels=3) if not isinstance(t, nn.Parameter)]


def _copied(value: Any) -> Any:
    """``value`` with its lists, tuples and dicts (their subclasses too: an ``OrderedDict`` cache, a named
    tuple) rebuilt and its tensors cloned (detached); anything else, parameters included, as it is."""
    return map_tensors(value, lambda t: t if isinstance(t, nn.Parameter) else t.detach().clone())


Fingerprint = tuple[int, torch.dtype, torch.Tensor]


def _fingerprints(model: nn.Module) -> dict[str, Fingerprint]:
    """Every parameter's and buffer's storage and values, summarised without a copy: (data pointer, dtype,
    (sum, norm)); equal values give equal summaries (the reductions are deterministic)."""
    out = {}
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            t = t.detach()
            moments = [t.sum()] + ([torch.linalg.vector_norm(t)] if t.is_floating_point() else [])
            out[name] = (t.data_ptr(), t.dtype, torch.stack([m.double() for m in moments]).cpu())
    return out


def _same_fingerprint(a: Fingerprint | None, b: Fingerprint) -> bool:
    return a is not None and a[:2] == b[:2] and torch.equal(a[2], b[2])


def _signature(value: Any) -> tuple:
    """Which tensors an attribute holds, at which in-place versions."""
    return tuple((id(t), t._version) for t in attribute_tensors(value))


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
        self._modules: list[tuple[str, nn.Module]] = []  # the model's, at the forward's start
        self._buffers: dict[str, tuple[int, int]] = {}
        self._before: dict[Key, tuple] = {}  # each tensor attribute's signature at the forward's start
        # a verification, from its first forward to its replay: copies of the attributes as they were, the
        # parameters' and buffers' fingerprints, the tensor attributes its forwards wrote
        self._snapshot: dict[Key, Any] = {}
        self._values: dict[str, Fingerprint] | None = None
        self._pending: set[Key] = set()
        # what training forwards left in attributes, and what the replays established of it
        self._written: dict[Key, list[tuple[weakref.ref, int]]] = {}
        self._independent: dict[Key, dict[tuple, Any]] = {}  # free of data: values seen, by shapes
        self._dependent: set[Key] = set()
        self._unreplayed: set[Key] = set()  # written in a verification that ended without a replay
        self._found: set[Key] = set()  # independent attributes a call of this forward found again
        self._watched: dict[str, Any] = {}  # module name -> its pre-hook's handle
        self._held: list[torch.Tensor] = []  # the attributes' and buffers' tensors at the forward's start

    # ------------------------------------------------------------------ around a training forward
    def _attributes(self, holders: bool = True) -> dict[Key, Any]:
        """Every module's plain attributes (the modules as :meth:`start` found them); ``holders``: only
        those that may hold tensors."""
        out = {}
        for name, module in self._modules:
            attributes = vars(module)
            for key in sorted(attributes.keys() - self._ignored):  # nn.Module's own fields skipped in C
                value = attributes[key]
                if not holders or isinstance(value, _HOLDERS):
                    out[name, key] = value
        return out

    def start(self, snapshot: bool = False) -> None:
        """A training forward begins; ``snapshot``: it is the first of a verification, which check 4 will
        replay from the model's state as it is now."""
        self._modules = list(self.model.named_modules())
        self._buffers = {  # by the modules just listed (the check after the forward walks the model again)
            f"{name}.{key}" if name else key: (id(b), b._version)
            for name, module in self._modules
            for key, b in module._buffers.items()
            if b is not None
        }
        self._found = set()
        attributes = self._attributes()
        self._before = {key: _signature(value) for key, value in attributes.items()}
        # held until :meth:`check`: a tensor the forward drops cannot be freed and its id() given to the one
        # it writes in its place, which the signatures would then take for the same, unwritten
        self._held = [
            *(t for value in attributes.values() for t in attribute_tensors(value)),
            *(b for _, module in self._modules for b in module._buffers.values() if b is not None),
        ]
        if snapshot:  # all attributes: a None the forward replaces is put back as None
            self._snapshot = {key: _copied(value) for key, value in self._attributes(holders=False).items()}
            self._values, self._pending = _fingerprints(self.model), set()

    def check(self) -> None:
        """A training forward ended: refuse a changed buffer, and in a verification a parameter or buffer
        whose values changed out of the version counters' sight; note the tensor attributes it wrote."""
        try:
            self._check_written()
        finally:
            self._held = []

    def _check_written(self) -> None:
        self._check_buffers()
        self._check_values()
        for key, value in self._attributes().items():
            signature = _signature(value)
            if not signature or self._before.get(key) == signature:
                continue
            self._written[key] = [(weakref.ref(t), t._version) for t in attribute_tensors(value)]
            if self._values is not None:
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
        if self._values is None:
            return
        now = _fingerprints(self.model)
        changed = [
            name
            for name, (pointer, dtype, moments) in self._values.items()
            if name not in now
            or (now[name][1] == dtype and not _same_fingerprint(now[name], (pointer, dtype, moments)))
        ]
        if not changed:
            return
        owner, _, leaf = changed[0].rpartition(".")
        raise ValueError(
            f"module {owner!r} ({type(self.model.get_submodule(owner)).__name__}) changed {leaf!r} in a "
            "training forward out of autograd's sight (e.g. a data-dependent initialisation through .data): "
            "values computed from a raw batch are neither clipped nor noised and reach every later step. "
            "Initialise it before training, from public data, or with the model's own initialiser."
            + (f" Also changed: {changed[1:5]}." if len(changed) > 1 else "")
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
        elif key in self._unreplayed:
            why = (
                "and no replay established that it is free of the batch's data: it was written in a "
                "micro-batch that check 4 could not replay with another example (one example, or all "
                "alike); make the first micro-batch of each input structure hold at least two different "
                "examples"
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
        kind = type(self.model.get_submodule(name)).__name__
        return f"module {name!r} ({kind}): its attribute {attribute!r}"

    # ------------------------------------------------------------------ check 4's replay
    @contextmanager
    def replaying(self) -> Iterator[None]:
        """Run check 4's replay of the pending verification inside: the tensor attributes the verified
        forward wrote are set to copies of their values before it; after the replay, one with the real
        forward's values is independent of the data, one with other values dependent; the real values are
        put back. A replay that raises classifies nothing. (Other attributes are left as they are: a flag
        such as Hugging Face's ``_output_capturing_hooks_installed`` stands for hooks a copy cannot undo.)"""
        pending, snapshot = self._pending, self._snapshot
        self._pending = set()
        self.settle()
        self._unreplayed -= pending
        modules = {key: self.model.get_submodule(key[0]) for key in pending}
        real = {key: vars(modules[key]).get(key[1], _ABSENT) for key in pending}
        for key in pending:
            self._set(modules[key], key[1], _copied(snapshot.get(key, _ABSENT)))
        try:
            yield
        finally:
            replayed = {key: vars(modules[key]).get(key[1], _ABSENT) for key in pending}
            for key in pending:
                self._set(modules[key], key[1], real[key])
        for key in pending:
            value, again = real[key], replayed[key]
            if value is not _ABSENT and again is not _ABSENT and _same_values(value, again):
                if key not in self._dependent:
                    self._independent.setdefault(key, {})[_shapes(value)] = _copied(value)
            else:
                self._dependent.add(key)
                self._independent.pop(key, None)

    @staticmethod
    def _set(module: nn.Module, attribute: str, value: Any) -> None:
        if value is _ABSENT:
            vars(module).pop(attribute, None)
        else:
            vars(module)[attribute] = value

    def settle(self) -> None:
        """The verification ended: attributes it wrote and did not replay stay unestablished."""
        self._unreplayed |= self._pending
        self._snapshot, self._values, self._pending = {}, None, set()

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

    def remove(self) -> None:
        for handle in self._watched.values():
            handle.remove()
        self._watched.clear()
