"""Training hyperparameters from launch scripts, YAML files and argparse/Megatron `args`, under one name each.

Frameworks name the same setting differently; ALIASES maps every known spelling to one canonical name,
so `--lr 1e-4` in a Megatron script and `learning_rate: 1e-4` in a transformers YAML compare as equal.
Names that differ between two launches of one job without changing it (paths, ports, ranks) are kept
apart in `ignored` and not compared (IGNORED_PATTERNS).
"""
from __future__ import annotations

import argparse
import fnmatch
import math
import re
import shlex
from pathlib import Path
from typing import Any, Iterable, Mapping

from trainmon.config_check.environment import is_secret
from trainmon.read.errors import InputError

# canonical name -> other spellings (Megatron, DeepSpeed, transformers, Lightning, plain scripts).
ALIASES: dict[str, tuple[str, ...]] = {
    "lr": ("learning_rate", "max_lr", "base_lr"),
    "min_lr": ("min_learning_rate", "lr_min"),
    "micro_batch_size": ("per_device_train_batch_size", "train_micro_batch_size_per_gpu", "mbs", "batch_size"),
    "global_batch_size": ("train_batch_size", "gbs"),
    "gradient_accumulation_steps": ("grad_acc_steps", "gas", "accumulate_grad_batches"),
    "weight_decay": ("wd",),
    "train_iters": ("max_steps", "num_train_steps", "steps", "train_steps"),
    "epochs": ("num_train_epochs", "max_epochs"),
    "lr_warmup_iters": ("warmup_steps", "num_warmup_steps", "lr_warmup_steps"),
    "lr_decay_style": ("lr_scheduler_type", "lr_schedule"),
    "clip_grad": ("max_grad_norm", "gradient_clipping", "grad_clip"),
    "adam_beta1": ("beta1",),
    "adam_beta2": ("beta2",),
    "adam_eps": ("adam_epsilon", "eps"),
    "seed": ("random_seed",),
    "seq_length": ("max_seq_length", "max_position_embeddings", "seq_len", "seq", "block_size"),
    "tensor_model_parallel_size": ("tp", "tensor_parallel_size", "tp_size"),
    "pipeline_model_parallel_size": ("pp", "pipeline_parallel_size", "pp_size"),
    "virtual_pipeline_model_parallel_size": ("vpp",),
    "num_layers": ("n_layer", "num_hidden_layers", "layers"),
    "hidden_size": ("n_embd", "d_model", "hidden"),
    "num_attention_heads": ("n_head", "num_heads"),
    "vocab_size": ("vocab", "padded_vocab_size"),
    "zero_stage": ("stage", "zero_optimization_stage"),
    "bf16": ("bf16_enabled",),
    "fp16": ("fp16_enabled",),
}
_CANONICAL = {alias: name for name, aliases in ALIASES.items() for alias in aliases}
# Recorded, not compared: they name where a run writes or how it was launched, not what it trains.
IGNORED_PATTERNS: tuple[str, ...] = ("*dir", "*_dir_*", "*path", "*file", "out", "output*", "save", "load",
                                     "*log*", "local_rank", "rank", "*port", "*addr*", "config", "timings")

# `NAME=value` assignments of shell scripts (`export NAME=value` too).
_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_VARIABLE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


def canonical(name: str) -> str:
    key = name.strip().lstrip("-").replace("-", "_").lower()
    return _CANONICAL.get(key, key)


def is_ignored(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in IGNORED_PATTERNS)


def _value(text: str) -> Any:
    """A script's text as the number or bool it spells, else the text."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            number = kind(text)
        except ValueError:
            continue
        return number if math.isfinite(number) else text  # "nan" never equals itself: keep the text
    return text


def _substitute(text: str, variables: Mapping[str, str]) -> str:
    """`$LR` / `${LR}` replaced by the script's own assignment, where it has one."""
    return _VARIABLE.sub(lambda m: variables.get(m.group(1), m.group(0)), text)


def _plain(value: Any) -> Any:
    """A JSON-writable form of an args value (dtypes, enums, paths become their text)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)


def normalise(raw: Mapping[str, Any]) -> dict[str, Any]:
    """{canonical name: value}; where two spellings of one setting are given, the first wins. Names that
    look like secrets (a token in a launch script) are left out."""
    out: dict[str, Any] = {}
    for name, value in raw.items():
        if not is_secret(str(name)):
            out.setdefault(canonical(str(name)), _plain(value))
    return out


def _logical_lines(text: str) -> Iterable[tuple[int, str]]:
    """(first line number, text) of each command, continuation lines (`\\` at the end) joined, comments cut."""
    start, parts = 1, []
    for number, line in enumerate(text.splitlines(), 1):
        if not parts:
            start = number
        line = line.split("#", 1)[0]
        if line.rstrip().endswith("\\"):
            parts.append(line.rstrip()[:-1])
            continue
        yield start, " ".join(parts + [line]).strip()
        parts = []
    if parts:
        yield start, " ".join(parts).strip()


def from_script(path: str | Path) -> dict[str, Any]:
    """Hyperparameters of a shell launch script: `--lr 1e-4`, `--lr=1e-4`, `--fp16`, `LR=1e-4`."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise InputError.at(path, f"cannot read the script ({err})") from None
    raw: dict[str, Any] = {}
    variables: dict[str, str] = {}
    for number, line in _logical_lines(text):
        try:
            words = shlex.split(line)
        except ValueError as err:
            raise InputError.at(path, f"cannot split the line ({err})", number) from None
        words = words[1:] if words[:1] == ["export"] else words
        while words and _ASSIGN.match(words[0]):  # `LR=1e-4`, also before a command: `LR=1e-4 python ...`
            name, value = _ASSIGN.match(words.pop(0)).groups()
            variables[name] = value
            raw.setdefault(name, _value(value))
        for i, word in enumerate(words):
            if not word.startswith("--") or len(word) < 3:
                continue
            name, eq, value = word[2:].partition("=")
            if not eq:
                given = i + 1 < len(words) and not words[i + 1].startswith("--")
                value = words[i + 1] if given else "true"  # a bare `--flag` is true
            raw.setdefault(name, _value(_substitute(value, variables)))
    return normalise(raw)


def _flatten(tree: Any, prefix: str = "") -> Iterable[tuple[str, Any]]:
    """Leaves of nested YAML mappings; a leaf is named by its own key (`optimizer.lr` -> `lr`)."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _flatten(value, str(key))
    else:
        yield prefix, tree


def from_yaml(path: str | Path) -> dict[str, Any]:
    """Hyperparameters of a YAML config, nested sections flattened to their leaf names."""
    path = Path(path)
    try:
        import yaml
    except ImportError:
        raise InputError.at(path, "reading YAML needs PyYAML (pip install pyyaml)") from None
    try:
        tree = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise InputError.at(path, f"not a readable YAML file ({err})") from None
    if not isinstance(tree, Mapping):
        raise InputError.at(path, "a YAML config must be a mapping of names to values")
    # YAML 1.1 reads `1e-4` (no dot) as text; a script's `--lr 1e-4` is a number: read both as numbers
    return normalise({name: _value(v) if isinstance(v, str) else v for name, v in _flatten(tree)})


def from_args(args: Any) -> dict[str, Any]:
    """Hyperparameters of an argparse Namespace, Megatron's `args`, or a mapping."""
    if args is None:
        return {}
    if isinstance(args, Mapping):
        return normalise(args)
    if isinstance(args, argparse.Namespace) or hasattr(args, "__dict__"):
        return normalise({k: v for k, v in vars(args).items() if not k.startswith("_")})
    raise TypeError(f"args must be an argparse Namespace, Megatron args or a mapping, not {type(args).__name__}")


def split_ignored(values: Mapping[str, Any]) -> tuple[dict, dict]:
    """(compared, ignored) parts of canonical hyperparameters."""
    compared = {k: v for k, v in values.items() if not is_ignored(k)}
    return compared, {k: v for k, v in values.items() if is_ignored(k)}
