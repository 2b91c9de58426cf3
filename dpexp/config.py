"""The schema of ``conf/``: every group and key the entry points accept, and the check that refuses anything
else, appended keys (``+clip.engine.foo=1``) included, naming the valid keys.

The structured top-level schema (:class:`Schema`, registered as ``dpexp_schema``) types the keys of
``conf/config.yaml``; Hydra refuses an unknown top-level key or a wrong type while composing. Groups are
checked after composition by :func:`check_config`: ``clip``, ``accountant``, ``noise`` and ``optim``
against the dataclasses below (the values and their documentation live in the YAML files), ``task`` and
``model`` against the constructor of their ``_target_`` (the constructor is their schema).
:func:`composition_refusals` turns Hydra's own refusals of a command line into the same one-line errors.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import secrets
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from pathlib import PurePath
from typing import Any, get_args, get_origin, get_type_hints

import hydra
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from dpexp.runtime import debug_requested, one_line

# conf/config.yaml's run directories: a fresh one per run (or the run's own, resumed), Hydra's files in it.
# The token is random per run (cached in the run's config; Hydra copies the cache to the jobs of a sweep),
# so runs started in the same second never share a directory.
OmegaConf.register_new_resolver("dpexp.token", lambda: secrets.token_hex(3), use_cache=True)


def _run_dir(resume: str | None, fresh: str) -> str:
    """The run directory: ``resume``'s, else ``fresh``; under torchrun (``distributed=ddp``) every rank's
    process composes its own config, so the fresh name is torchrun's run id, the same on every rank."""
    if resume is not None:
        return resume
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return fresh
    if run_id == "none":
        raise ConfigError(
            "under torchrun every rank needs the same run directory: start it with --standalone or "
            "--rdzv-id=<name> (or set hydra.run.dir)"
        )
    return str(PurePath(fresh).parent / f"ddp_{run_id}")


def _hydra_subdir(resume: str | None) -> str | None:
    """Hydra's .hydra directory: written by a fresh run's rank 0 only."""
    return ".hydra" if resume is None and int(os.environ.get("RANK", "0")) == 0 else None


OmegaConf.register_new_resolver("dpexp.run_dir", _run_dir)
OmegaConf.register_new_resolver("dpexp.hydra_subdir", _hydra_subdir)


class ConfigError(ValueError):
    """A configuration the entry points refuse; its message names the key and the fix."""


# ---------------------------------------------------------------------------------------------- top level
class Sampling(str, Enum):
    poisson = "poisson"
    shuffle = "shuffle"


class Logger(str, Enum):
    none = "none"
    wandb = "wandb"


class WandbMode(str, Enum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


@dataclass
class IndividualSchema:
    variant: str = "none"  # none | sampling | scaling (dpexp.training.individual checks the values)
    epsilons: list[float] | None = None
    fractions: list[float] | None = None
    column: str | None = None


@dataclass
class PrivacySchema:
    epsilon: float = MISSING
    noise_multiplier: float | None = MISSING
    delta: float | None = MISSING
    delta_rule: str = MISSING  # a key of dpexp.privacy.accounting.DELTA_RULES
    accounting_memory_gib: float = MISSING
    accounting_timeout_s: float = MISSING
    individual: IndividualSchema = field(default_factory=IndividualSchema)


@dataclass
class WandbSchema:
    project: str = MISSING
    entity: str | None = MISSING
    mode: WandbMode = MISSING
    group: str | None = MISSING


@dataclass
class DataSchema:
    root: str | None = MISSING


@dataclass
class OutputSchema:
    root: str = MISSING


@dataclass
class CheckpointSchema:
    every: int | None = MISSING
    every_minutes: float | None = MISSING
    keep: int = MISSING
    at_epochs: list[float] | None = MISSING


@dataclass
class ParametersSchema:
    train: list[str] | None = MISSING
    freeze: list[str] = MISSING


@dataclass
class Schema:
    """Types of ``conf/config.yaml``; the values and their documentation live in the YAML."""

    task: Any = MISSING
    model: Any = MISSING
    clip: Any = MISSING
    accountant: Any = MISSING
    noise: Any = MISSING
    optim: Any = MISSING
    distributed: Any = MISSING
    seed: int = MISSING
    privacy: PrivacySchema = field(default_factory=PrivacySchema)
    epochs: float | None = MISSING
    steps: int | None = MISSING
    batch_size: int = MISSING
    physical_batch_size: int = MISSING
    group_by_length: bool = MISSING
    sampling: Sampling = MISSING
    eval_every: int | None = MISSING
    eval_batch_size: int = MISSING
    device: str = MISSING
    progress: bool = MISSING
    log_every: int = MISSING
    logger: Logger = MISSING
    wandb: WandbSchema = field(default_factory=WandbSchema)
    data: DataSchema = field(default_factory=DataSchema)
    output: OutputSchema = field(default_factory=OutputSchema)
    checkpoint: CheckpointSchema = field(default_factory=CheckpointSchema)
    parameters: ParametersSchema = field(default_factory=ParametersSchema)
    resume: str | None = MISSING
    debug: bool = MISSING
    audit: Any = None  # set by python -m dpexp.audit (conf/audit/*.yaml); refused by python -m dpexp.train


ConfigStore.instance().store(name="dpexp_schema", node=Schema)


# ---------------------------------------------------------------------------------------------- groups
@dataclass
class AdaptiveSchema:
    target_quantile: float
    quantile_lr: float
    budget_fraction: float
    rescale_to_global: bool
    method: str
    norm_factor: float
    bound_factor: float


@dataclass
class CoordinateSchema:
    beta1: float
    beta2: float
    variance_floor: float
    variance_ceiling: float
    initial_variance: float


@dataclass
class EngineSchema:
    clipping: str
    strategy: str
    norm_mode: str
    thresholds: list[float] | None
    adaptive: AdaptiveSchema | None
    noise_allocation: str
    groups: Any
    secure_mode: bool
    verify_every_step: bool
    clip_function: str
    automatic_stability: float
    coordinate: CoordinateSchema | None


@dataclass
class OpacusSchema:
    grad_sample_mode: str
    clipping: str


@dataclass
class ClipSchema:
    name: str
    method: str
    max_grad_norm: float | None
    engine: EngineSchema | None = None
    opacus: OpacusSchema | None = None


@dataclass
class AccountantSchema:
    name: str
    approximate_calibration: bool = False


@dataclass
class NoiseSchema:
    name: str
    initial: float | None
    rate: float | None
    period: float | None
    end_fraction: float | None


@dataclass
class ScheduleSchema:
    name: str
    warmup_fraction: float = 0.0


@dataclass
class OptimSchema:
    name: str
    lr: float
    schedule: ScheduleSchema
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: list[float] | None = None
    eps: float | None = None
    tolerance: float | None = None  # ADADP
    alpha_min: float | None = None  # ADADP
    alpha_max: float | None = None  # ADADP


@dataclass
class DistributedSchema:
    name: str
    backend: str
    timeout_s: float
    world_size: int | None
    split_at: list[int] | None = None  # distributed=pipeline only (conf/distributed/pipeline.yaml)


@dataclass
class AuditSchema:
    variant: str
    canaries: int
    guesses: int
    abstain_low: int
    confidence: float
    magnitude: float
    seed: int
    save_to: str | None


GROUP_SCHEMAS: dict[str, type] = {
    "clip": ClipSchema,
    "accountant": AccountantSchema,
    "noise": NoiseSchema,
    "optim": OptimSchema,
    "distributed": DistributedSchema,
    "audit": AuditSchema,
}
INSTANTIATED_GROUPS = ("task", "model")


def check_config(cfg: DictConfig) -> None:
    """Refuse every key the entry points would not read: top-level keys outside :class:`Schema`, group keys
    outside their schemas, task and model keys their ``_target_`` does not take."""
    known = [f.name for f in fields(Schema)]
    unknown = sorted(set(cfg) - set(known))
    if unknown:
        raise ConfigError(unknown_keys(unknown, "", known))
    for group, schema in GROUP_SCHEMAS.items():
        _check_node(cfg[group], schema, group)
    for group in INSTANTIATED_GROUPS:
        _check_target_keys(cfg[group], group)


def _check_node(node: Any, schema: type, path: str) -> None:
    if not isinstance(node, DictConfig):
        return
    hints = get_type_hints(schema)
    valid = [f.name for f in fields(schema)]
    unknown = sorted(set(node) - set(valid))
    if unknown:
        raise ConfigError(unknown_keys([f"{path}.{key}" for key in unknown], path, valid))
    for key in node:
        nested = _dataclass_in(hints[key])
        if nested is not None:
            _check_node(node[key], nested, f"{path}.{key}")


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass a field holds (also ``X | None``), or None."""
    if is_dataclass(hint):
        return hint
    return next((arg for arg in get_args(hint) if is_dataclass(arg)), None) if get_origin(hint) else None


def accepted_keys(cls: type) -> set[str] | None:
    """Keyword arguments ``cls(...)`` accepts, following ``**kwargs`` up the class hierarchy; None if any."""
    keys: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        parameters = list(inspect.signature(klass.__init__).parameters.values())[1:]
        keys |= {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if not any(p.kind == p.VAR_KEYWORD for p in parameters):
            return keys
    return None


def _check_target_keys(node: DictConfig, group: str) -> None:
    target = hydra.utils.get_class(node._target_)
    accepted = accepted_keys(target)
    if accepted is None:
        return
    unknown = sorted(set(node) - accepted - {"_target_"})
    if unknown:
        keys = [f"{group}.{key}" for key in unknown]
        raise ConfigError(unknown_keys(keys, group, sorted(accepted), owner=target.__name__))


def _valid_keys(path: str, node: DictConfig) -> tuple[list[str], str | None, bool]:
    """The keys :func:`check_config` accepts at ``path`` (``node`` is the config there), the class whose
    constructor decides them, and whether they are decided at all: a schema's fields, or the keyword
    arguments of a task's or model's ``_target_``; the node's own keys where neither says (free-form, as a
    benchmark suite's model entries, where Hydra adds a key only when given as ``+key=value``)."""
    group, *rest = path.split(".") if path else [""]
    schema: type | None = Schema if not path else GROUP_SCHEMAS.get(group)
    for key in rest:
        schema = _dataclass_in(get_type_hints(schema).get(key)) if schema is not None else None
    if schema is not None:
        return [f.name for f in fields(schema)], None, True
    if group in INSTANTIATED_GROUPS and not rest and "_target_" in node:
        target = hydra.utils.get_class(node._target_)
        accepted = accepted_keys(target)
        if accepted is not None:
            return sorted(accepted), target.__name__, True
    return [str(key) for key in node if key not in ("hydra", "_target_")], None, False


def unknown_keys(keys: list[str], path: str, valid: list[str], owner: str | None = None) -> str:
    """The one wording of every refusal of a key dpexp would not read (given with or without ``+``): the
    full keys, and the valid keys of their parent ``path`` ("" for the top level) or of ``owner``'s
    constructor."""
    where = f"valid keys of {path}" if path else "valid top-level keys"
    noun = "key" if len(keys) == 1 else "keys"
    of = f" for {owner}" if owner else ""
    return f"Unknown config {noun} {', '.join(keys)}{of}; {where}: {', '.join(valid)}."


# ---------------------------------------------------------------------------- Hydra's refusals, in one line
COMPOSITION_ERRORS = (ConfigCompositionException, MissingConfigException, OverrideParseException)


def composition_message(error: Exception) -> str:
    """One line for Hydra's refusal of a command line while composing the config, naming the key and the
    valid choices: an unknown key given without ``+`` (Hydra would suggest ``+key``, which
    :func:`check_config` refuses in turn), an option a config group lacks, an override it cannot parse."""
    cause = error.__cause__
    unknown_key = isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and bool(cause.full_key)
    if unknown_key and isinstance(cause.parent_node, DictConfig):
        path, _, _ = cause.full_key.rpartition(".")
        valid, owner, decided = _valid_keys(path, cause.parent_node)
        message = unknown_keys([cause.full_key], path, valid, owner)
        if not decided:
            message += f" To add a key this entry does not have yet: +{cause.full_key}=..."
        return message
    if isinstance(error, MissingConfigException) and error.options:
        group, _, option = (error.missing_cfg_file or "").rpartition("/")
        return f"{group}={option}: no such option; the options of {group}: {', '.join(error.options)}."
    message = " ".join(str(error).split())
    if isinstance(error, OverrideParseException):
        message = f"cannot parse the override {error.override!r}: {message}"
    if cause is not None and str(cause).strip():  # e.g. a wrong type: what the value should be
        message += f": {str(cause).strip().splitlines()[0]}"
    return message


@contextlib.contextmanager
def composition_refusals(exit_code: int) -> Iterator[None]:
    """Run a ``@hydra.main`` entry point inside: a command line Hydra refuses while composing
    (:data:`COMPOSITION_ERRORS`) exits with ``exit_code`` and :func:`composition_message`'s line, before any
    run starts, where Hydra would print several lines; ``debug=true`` or DPEXP_DEBUG=1 shows Hydra's own
    error and traceback. Other errors propagate with their traceback."""
    previous = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises its errors instead of printing them and exiting
    try:
        yield
    except COMPOSITION_ERRORS as error:
        if debug_requested(any(arg.lower() == "debug=true" for arg in sys.argv[1:])):
            raise
        print(one_line(ConfigError(composition_message(error))), file=sys.stderr)
        sys.exit(exit_code)
    finally:
        if previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous
