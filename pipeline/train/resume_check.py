"""What a resume may change: this run's config against the one its checkpoint recorded, key by key.

Every resume compares the two (`check_resume`, called after the checkpoint is verified and before any tensor is
loaded) and logs one block with each changed key, its old and new value and its class from `RULES`:

- ``refused``: the checkpoint cannot continue under the new value (the architecture, the checkpoint format, the
  data order). The run stops before any step with `ResumeRefusedError`, one line naming each such key and the way
  out: set it back, or start a new run in another ``run_dir`` from the checkpoint's weights
  (``checkpoint.init_from``).
- ``warned``: the run continues, but trains differently from the resume step on (optimizer, schedule, the
  training mix). The block is a warning; when the schedule's inputs changed it states the learning rate of the
  resume step under both configs, since the closed-form schedule (``pipeline.train.optim.lr_at``) jumps to the
  new curve at once.
- ``silent``: logging, evaluation cadence, checkpoint cadence, paths and backends: listed, nothing else.

The recorded config comes from a file that may have been edited (and its checkpoint's manifest resealed): its
text must parse to the shape `config_record` writes, or `check_resume` raises ``JsonFileError`` naming the field,
which the checkpoint code takes as a damaged checkpoint.

Both configs are compared as checkpoints record them (`config_record`: YAML with values from the environment kept
as their ``${oc.env:...}`` text and secret shapes redacted), so the block shows no value a log may not show.
A key the checkpoint does not record (added to the schema since) counts as its schema default. The table in
docs/training.md ("Resuming with a changed config") mirrors `RULES` row for row (tested).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Literal, cast

import yaml
from omegaconf import OmegaConf

from data_prep.json_file import JsonFileError
from data_prep.redaction import redact
from model.config import BACKEND_FIELDS
from pipeline.data.mixture import MIXTURE_STATE_KEY
from pipeline.train.checkpoint import TRAINER_STATE
from pipeline.train.config import ConfigError, TrainConfig, to_yaml
from pipeline.train.optim import lr_at

log = logging.getLogger(__name__)

Kind = Literal["refused", "warned", "silent"]


@dataclass(frozen=True)
class Rule:
    """The class of every dotted config key matching one of ``keys`` (``fnmatch`` patterns; ``*`` spans dots)."""

    keys: tuple[str, ...]
    kind: Kind
    why: str
    """What a change of these keys changes (refused, warned) or why it is harmless (silent)."""


_MIX = "the training mix"

RULES: tuple[Rule, ...] = (
    Rule((*(f"model.{name}" for name in BACKEND_FIELDS), "train.compile"), "silent", "how the same model is computed"),
    Rule(("model.*",), "refused", "the architecture"),
    Rule(("parallel.engine", "parallel.zero_stage"), "refused", "the checkpoint format"),
    Rule(("seed",), "refused", "the data order, the needles and the Gumbel noise"),
    Rule(("train.seq_len",), "refused", "the data order (documents are packed into sequences of this length)"),
    Rule(("train.global_batch",), "refused", "which sequences make up each step"),
    Rule(
        ("data.shuffle", "data.shuffle_scope", "data.shuffle_block_mib", "data.shuffle_window"),
        "refused",
        "the data order",
    ),
    Rule(("train.max_steps", "schedule.*"), "warned", "the learning-rate schedule"),
    Rule(
        ("optim.trainable", "optim.lr_scale"),
        "refused",
        "the optimizer's parameter groups, which the checkpoint's optimizer state must fit (start the next stage "
        "from an export: checkpoint.init_from)",
    ),
    Rule(("optim.*", "train.grad_clip"), "warned", "the optimizer update"),
    Rule(("precision.*", "parallel.grad_reduce_dtype"), "warned", "the numerics of every step"),
    Rule(
        ("data.needle_mix", "data.needle_variant", "data.hop_chains", "data.needle_answer_weight"),
        "warned",
        _MIX,
    ),
    Rule(("data.retrieval_mix*",), "warned", _MIX),
    Rule(
        ("data.sources", "data.phases"),
        "silent",
        "compared source by source and phase by phase with the checkpoint's mixture: a past or current phase, or a "
        "source it drew from, refused; a later phase allowed",
    ),
    Rule(("train.micro_batch",), "silent", "the same sequences per step, cut into other micro-batches"),
    Rule(
        ("train.eval_every", "train.eval_batches", "train.requeue_exit_code", "train.retain_freed_memory"),
        "silent",
        "evaluation cadence and process settings",
    ),
    Rule(
        ("run_dir", "data.path", "data.train_split", "data.val_split", "data.cache_dir", "data.validate_hash"),
        "silent",
        "paths and checks; the dataset fingerprint refuses other training data",
    ),
    Rule(("parallel.*",), "silent", "how the same steps are spread over the ranks"),
    Rule(("checkpoint.*", "logging.*", "eval.*"), "silent", "checkpoint cadence, logging and probes"),
    Rule(("train.*",), "warned", "a training key without a rule of its own"),
    Rule(("data.*",), "refused", "a data key without a rule of its own (it may change the data order)"),
    Rule(("*",), "refused", "a key without a rule of its own"),
)
"""First match wins: exceptions before their section's default, the catch-all ``*`` last."""


def classify(key: str) -> Rule:
    """The first rule of `RULES` with a pattern matching the dotted ``key``."""
    return next(rule for rule in RULES if any(fnmatchcase(key, pattern) for pattern in rule.keys))


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any
    rule: Rule

    def describe(self) -> str:
        return f"{self.key}: {_show(self.old)} -> {_show(self.new)}"


class ResumeRefusedError(ConfigError):
    """The config changed a key the checkpoint cannot continue under; the message names each key and the way out."""


def config_record(cfg: TrainConfig) -> str:
    """The config text a checkpoint records (``config_yaml``) and a resume compares."""
    return redact(to_yaml(cfg))


def _tree(config: Any) -> dict[str, Any]:
    """A recorded config (its text) or the schema as plain data; ``${oc.env:...}`` texts stay strings, nothing is
    resolved."""
    node = OmegaConf.create(config) if isinstance(config, str) else OmegaConf.structured(config)
    return cast(dict[str, Any], OmegaConf.to_container(node, resolve=False))


def _recorded_tree(saved: str, where: str) -> dict[str, Any]:
    """The config text ``saved`` (``where`` names it) as plain data, refused unless it is what `config_record`
    writes: YAML without aliases (OmegaConf copies an alias at each use, so nested ones grow exponentially; its
    own YAML never has them) holding a mapping of plain values.

    Raises:
        JsonFileError: naming ``where`` and the reason.
    """
    try:
        if any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(saved, Loader=yaml.SafeLoader)):
            raise ValueError("it uses YAML aliases")
        tree = _tree(saved)
        json.dumps(tree)  # plain values only: a YAML !!binary survives OmegaConf as bytes
    # Hostile YAML fails in many ways (parser and constructor errors, OmegaConf's value-type and assertion
    # errors, TypeError from the dump): each one means the same here.
    except Exception as err:
        reason = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise JsonFileError(f"{where} is not a recorded config ({reason})") from None
    if not isinstance(tree, dict):
        raise JsonFileError(f"{where} is not a recorded config (not a mapping)")
    return tree


def _sections(node: Any, prefix: str = "") -> set[str]:
    """Dotted paths of the schema's sections (nested dataclasses): a change is reported per key inside them, while
    a dict-valued key (a mapping the user fills) is one value, so that removing an entry is a change too."""
    paths: set[str] = set()
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            paths |= {prefix + f.name} | _sections(value, f"{prefix}{f.name}.")
    return paths


def _flatten(node: dict[str, Any], sections: set[str], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every key of a recorded config; lists and dict-valued keys are one value each."""
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and dotted in sections:
            yield from _flatten(value, sections, dotted + ".")
        else:
            yield dotted, value


def _show(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def config_changes(saved: str, current: str, where: str = "the recorded config") -> list[Change]:
    """Every key whose value differs between two recorded configs, sorted by key. A key missing from ``saved``
    compares as its schema default; a key the schema no longer has is ignored (nothing can set it).

    Raises:
        JsonFileError: ``saved`` (named by ``where``) is not a recorded config, or holds a section of the schema
            that is not a mapping.
    """
    schema = TrainConfig()
    sections = _sections(schema)
    defaults = dict(_flatten(_tree(schema), sections))
    old = dict(_flatten(_recorded_tree(saved, where), sections))
    flat = sorted(set(old) & sections)  # _flatten descends into a section only when it is a mapping
    if flat:
        raise JsonFileError(f"{where} is not a recorded config (section {flat[0]} is not a mapping)")
    changes = []
    for key, new in sorted(_flatten(_tree(current), sections)):
        before = old.get(key, defaults.get(key))
        if before != new:
            changes.append(Change(key, before, new, classify(key)))
    return changes


_SCHEDULE_KEYS = ("train.max_steps", "optim.*", "schedule.*")
"""The inputs of ``lr_at``: a change of one of them moves the learning rate of the resume step."""


def _lr_at_resume(step: int, saved: str, cfg: TrainConfig) -> float | None:
    """The learning rate of 0-based step ``step`` under the checkpoint's config; None when a value it needs came
    from the environment (recorded as its ``${oc.env:...}`` text, so unknown here) or is not a number."""
    tree = _tree(saved)

    def section(current: Any, name: str) -> Any:
        recorded = tree.get(name, {})
        fields = {f.name: recorded[f.name] for f in dataclasses.fields(current) if f.name in recorded}
        return dataclasses.replace(current, **fields)

    try:
        max_steps = int(tree.get("train", {}).get("max_steps", cfg.train.max_steps))
        lr = lr_at(step, max_steps, section(cfg.optim, "optim"), section(cfg.schedule, "schedule"))
    except (TypeError, ValueError, ArithmeticError):  # recorded values of other types, or out of range
        return None
    return float(lr) if isinstance(lr, int | float) else None


def _way_out(path: Path, refused: list[Change]) -> str:
    export = path / "export"
    weights = (
        f"checkpoint.init_from={export}"
        if export.is_dir()
        else f"checkpoint.init_from=<dir> after launch/export.py --checkpoint {path} --out <dir>"
    )
    shapes = " if every tensor shape still fits" if any(c.key.startswith("model.") for c in refused) else ""
    return (
        f"set {'it' if len(refused) == 1 else 'them'} back to resume this run, or start a new run in another "
        f"run_dir ({weights} starts it from these weights{shapes})"
    )


def check_data_settings(path: Path, data: dict[str, Any], cfg: TrainConfig) -> None:
    """The settings the checkpoint's data position records (its ``data`` state, types checked by
    ``pipeline.train.checkpoint``) equal this run's. Called after `check_resume`, which refuses a change of them
    with the way out; what it cannot see is a checkpoint from before ``data.shuffle_scope`` existed, whose config
    reads as today's default order while its position is one of the window order.

    Raises:
        ResumeRefusedError: the position belongs to another data order (one line with the keys that read it).
        JsonFileError: another recorded setting differs (an edited trainer state), naming the field and both values.
    """
    d = cfg.data
    mixture = data.get(MIXTURE_STATE_KEY)
    if mixture is not None and mixture["streams"]:
        data = next(iter(mixture["streams"].values()))  # each source's order; its seed is derived from the run's
    saved = data.get("order", "window")  # a window-order state records no order
    order = "blocks" if d.order() == "blocks" else "window"
    if saved != order:
        keys = f"data.shuffle_scope={saved} data.shuffle={json.dumps(data['shuffle'])}"
        raise ResumeRefusedError(
            f"{path} holds a position in the {saved} data order, which means nothing in the {order} order: add "
            f"{keys} to resume it, or start a new run in another run_dir"
        )
    now = {"seq_len": cfg.train.seq_len, "shuffle": d.shuffle, **({} if mixture is not None else {"seed": cfg.seed})}
    now.update({"block_mib": d.shuffle_block_mib} if order == "blocks" else {"window": d.shuffle_window})
    for key, value in now.items():
        if data[key] != value:
            raise JsonFileError(
                f"{path / TRAINER_STATE}: field 'data.{key}' is {json.dumps(data[key])}, but the config it was saved "
                f"with gives {json.dumps(value)}"
            )


def check_resume(path: Path, saved: str, cfg: TrainConfig, step: int) -> None:
    """Compare ``cfg`` with the config ``saved`` that the checkpoint at ``path`` (of ``step``) recorded, and log
    the changes as one block (a warning when any key is refused or warned).

    Raises:
        ResumeRefusedError: a refused key changed; one line naming each such key, its values and the way out.
        JsonFileError: ``saved`` is not a recorded config (`config_changes`).
    """
    changes = config_changes(saved, config_record(cfg), f"{path / TRAINER_STATE}: field 'config_yaml'")
    if not changes:
        log.info("resuming %s with the config it was saved with", path)
        return
    lines = [f"resuming {path} (step {step}) with {len(changes)} changed config key(s):"]
    for change in changes:
        rule = change.rule
        effect = {
            "refused": f"refused: changes {rule.why}",
            "warned": f"warned: changes {rule.why} from step {step + 1} on",
            "silent": f"allowed: {rule.why}",
        }[rule.kind]
        lines.append(f"  {change.describe()}  [{effect}]")
    if any(fnmatchcase(c.key, p) for c in changes for p in _SCHEDULE_KEYS):
        old_lr, new_lr = _lr_at_resume(step, saved, cfg), lr_at(step, cfg.train.max_steps, cfg.optim, cfg.schedule)
        before = (
            f"{old_lr:.2e}"
            if old_lr is not None
            else "unknown (a value it needs came from the environment or is not a number)"
        )
        lines.append(
            f"  learning rate at step {step + 1}: {before} under the checkpoint's config -> {new_lr:.2e} under this one"
        )
    kinds = {c.rule.kind for c in changes}
    log.log(logging.INFO if kinds == {"silent"} else logging.WARNING, "%s", "\n".join(lines))
    refused = [c for c in changes if c.rule.kind == "refused"]
    if refused:
        what = "; ".join(f"{c.describe()} changes {c.rule.why}" for c in refused)
        raise ResumeRefusedError(f"cannot resume {path}: {what}; {_way_out(path, refused)}")
