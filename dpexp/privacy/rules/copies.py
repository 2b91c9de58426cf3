"""Whether two layer classes compute the same thing: copies of a class, such as the RMSNorm that Hugging Face
copies verbatim into each model's file (``LlamaRMSNorm``, ``GlmRMSNorm``, ``HeliumRMSNorm``, ... : 140 classes
in transformers 5.x with one forward) or the scaled word embeddings of Gemma, BART and M2M100.

Rules are registered by exact type (a subclass that changes ``forward`` must never inherit its parent's rule).
A class that is a *copy* of a registered one takes its rule: the same base classes (so ``super()`` and every
inherited method resolve to the same code) and, member by member, the same class body except ``__init__``:

* every function defined in the class has the same bytecode, constants (nested code objects compared the
  same way), names, arguments and defaults, every global it reads is the same object in both modules
  (``torch`` is; two module-level helpers of the same name are not, whatever their source), and every
  variable it closes over is the same member (a decorator's wrapper, such as the ``forward`` that
  transformers' ``use_experts_implementation`` puts on every experts class, is one code object whose
  closure holds each class's own original ``forward``);
* every other class attribute is equal.

``__init__`` may differ (the attributes it sets are read by the same code, under the same names, in both
classes; a parameter of another shape still fails the engine's checks of the per-example gradients against
autograd). Nothing is compared by size, and nothing but code and values decides. For the same reason a
subclass that defines nothing but ``__init__`` (:func:`configures`) takes its parent's rule.
"""

from __future__ import annotations

import builtins
import types
from typing import Any

_METADATA = {
    "__init__",
    "__module__",
    "__qualname__",
    "__doc__",
    "__dict__",
    "__weakref__",
    "__annotations__",
    "__annotate__",
    "__firstlineno__",
    "__static_attributes__",
    "__orig_bases__",
    "__parameters__",
}


_EMPTY = object()


def _same_code(a: types.CodeType, b: types.CodeType) -> bool:
    if (a.co_code, a.co_names, a.co_varnames, a.co_freevars, a.co_cellvars) != (
        b.co_code,
        b.co_names,
        b.co_varnames,
        b.co_freevars,
        b.co_cellvars,
    ):
        return False
    if (a.co_argcount, a.co_posonlyargcount, a.co_kwonlyargcount, a.co_flags) != (
        b.co_argcount,
        b.co_posonlyargcount,
        b.co_kwonlyargcount,
        b.co_flags,
    ):
        return False
    if len(a.co_consts) != len(b.co_consts):
        return False
    for x, y in zip(a.co_consts, b.co_consts, strict=True):
        if isinstance(x, types.CodeType) or isinstance(y, types.CodeType):
            if not (isinstance(x, types.CodeType) and isinstance(y, types.CodeType) and _same_code(x, y)):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def _globals_read(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _globals_read(const)
    return names


Owners = tuple[type, type]  # the two classes compared: a ``__class__`` cell of each must hold its own


def _same_function(f: types.FunctionType, g: types.FunctionType, owners: Owners) -> bool:
    if not _same_code(f.__code__, g.__code__):
        return False
    if f.__defaults__ != g.__defaults__ or f.__kwdefaults__ != g.__kwdefaults__:
        return False
    missing = object()
    for name in _globals_read(f.__code__):  # attribute names too: they resolve to nothing in either module
        x = f.__globals__.get(name, getattr(builtins, name, missing))
        y = g.__globals__.get(name, getattr(builtins, name, missing))
        if x is not y:
            return False
    cells = zip(f.__code__.co_freevars, f.__closure__ or (), g.__closure__ or (), strict=True)
    return all(_same_cell(name, a, b, owners) for name, a, b in cells)


def _same_cell(name: str, a: types.CellType, b: types.CellType, owners: Owners) -> bool:
    """Two closure cells hold the same member (an empty cell only matches an empty one); the ``__class__``
    cell of zero-argument ``super()`` holds each function's own class (their bases are the same)."""
    try:
        x = a.cell_contents
    except ValueError:  # empty cell
        x = _EMPTY
    try:
        y = b.cell_contents
    except ValueError:
        y = _EMPTY
    if name == "__class__":
        return x is owners[0] and y is owners[1]
    return x is y or (x is not _EMPTY and y is not _EMPTY and _same_member(x, y, owners))


def _same_member(x: Any, y: Any, owners: Owners) -> bool:
    if isinstance(x, (staticmethod, classmethod)) and type(x) is type(y):
        x, y = x.__func__, y.__func__
    if isinstance(x, property) and isinstance(y, property):
        pairs = [(x.fget, y.fget), (x.fset, y.fset), (x.fdel, y.fdel)]
        return all(a is b or _same_member(a, b, owners) for a, b in pairs)
    if isinstance(x, types.FunctionType) or isinstance(y, types.FunctionType):
        return (
            isinstance(x, types.FunctionType)
            and isinstance(y, types.FunctionType)
            and _same_function(x, y, owners)
        )
    try:
        return type(x) is type(y) and bool(x == y)
    except Exception:  # a value without a truthful ==: not provably the same
        return False


def is_copy(cls: type, reference: type) -> bool:
    """``cls`` has ``reference``'s bases and, but for ``__init__``, the same class body (module docstring)."""
    if cls is reference:
        return True
    if cls.__bases__ != reference.__bases__:
        return False
    own = {k: v for k, v in vars(cls).items() if k not in _METADATA}
    theirs = {k: v for k, v in vars(reference).items() if k not in _METADATA}
    owners = (cls, reference)
    return own.keys() == theirs.keys() and all(_same_member(own[k], theirs[k], owners) for k in own)


def configures(cls: type, parent: type) -> bool:
    """``cls`` subclasses ``parent`` alone and defines nothing but ``__init__`` (PoolFormer's
    ``PoolFormerGroupNorm(nn.GroupNorm)`` fixes the number of groups): every call runs ``parent``'s code on
    the attributes it reads, which ``__init__`` only sets."""
    own = {k for k in vars(cls) if k not in _METADATA}
    return cls.__bases__ == (parent,) and own <= {"__init__"}
