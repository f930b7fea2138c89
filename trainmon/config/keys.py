"""Key tables, the error type and the value checkers behind `trainmon.config.settings`.

Kept apart from the dataclasses so that the lists later work edits (formats that become available,
msprobe keys that become honoured) sit in one short file. A checker takes `(value, dotted_key)` and
returns the normalised value or raises ConfigError. msprobe facts below were read from
msprobe 26.x (`Ascend/msprobe`: `python/msprobe/core/common/const.py` `MonitorConst`,
`python/msprobe/core/monitor/utils.py` `validate_config`, `python/msprobe/pytorch/monitor/module_hook.py`
`TrainerMon.set_config`).
"""
from __future__ import annotations

import difflib
import json
import math
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from trainmon.core import sinks
from trainmon.core.schema import OPS

# How the `db` format writes (config key `output_filesystem`): from the output's filesystem, or forced.
OUTPUT_FILESYSTEMS: tuple[str, ...] = ("auto", "local", "network")

# Statistics trainmon computes (the schema's op table). msprobe's MonitorConst.OP_LIST is
# ["norm", "min", "max", "zeros", "nans", "id", "mean", "shape", "dtype"]; "infs" and "sat" are trainmon's own.
STAT_OPS: tuple[str, ...] = OPS
# Narrower dtypes whose largest finite value `sat` can count wider tensors against (`sat_dtype`).
SAT_DTYPES: tuple[str, ...] = ("float16", "bfloat16")
# msprobe lists these as ops, but they are not statistics: every CSV row carries them anyway.
COLUMN_OPS: tuple[str, ...] = ("shape", "dtype")

# msprobe's MonitorConst.RULE_NAME is ["AnomalyTurbulence", "AnomalyNan"]; AnomalySpike and AnomalyPrecursor are
# trainmon's own.
RULE_NAMES: tuple[str, ...] = ("AnomalyTurbulence", "AnomalyNan", "AnomalySpike", "AnomalyPrecursor")
# The precursors AnomalyPrecursor watches (`signals`; trainmon.anomaly.rules.PRECURSORS says what each is).
PRECURSOR_SIGNALS: tuple[str, ...] = ("max_logit", "router_entropy", "update_ratio", "weight_norm")
# The `args` each rule takes (trainmon.anomaly.rules documents their meaning).
RULE_ARGS: dict[str, tuple[str, ...]] = {
    "AnomalyNan": ("threshold",),
    "AnomalyTurbulence": ("threshold", "ops"),
    "AnomalySpike": ("threshold", "window", "warmup", "min_relative", "noise", "ops"),
    "AnomalyPrecursor": ("signals", "window", "warmup", "factor", "z", "min_rate", "persist"),
}
ALERT_ACTIONS: tuple[str, ...] = ("warn", "skip_step", "stop")
# The keys of one `targets` entry (msprobe: forward input/output, backward grads of both).
TARGET_FIELDS: tuple[str, ...] = ("input", "output", "input_grad", "output_grad")
MAX_NDIGITS = 20  # msprobe's MonitorConst.MAX_NDIGITS
# msprobe's MonitorConst.L2_HOOKS (the keys of `l2_targets`) and SA_ORDERS (the values of `sa_order`).
L2_HOOKS: tuple[str, ...] = ("linear_hook", "attention_hook", "moe_router_weight_hook", "moe_router_logit_hook")
SA_ORDERS: tuple[str, ...] = ("s,b,h,d", "b,s,h,d")

# msprobe keys (and values) that are accepted but have no effect yet, with the reason shown to the
# user. Each produces exactly one ConfigNotHonouredWarning per load when set to anything but its
# inert value. Entries are dotted config keys; "ops:<name>" stands for an op name inside `ops`.
# Remove an entry once the feature is honoured.
NOT_HONOURED: dict[str, str] = {
    "mg_distribution": "msprobe validates this key but never reads it; use mg_direction",
    "alert.inform": "email/database notifications of the kj600-era alert are not sent",
    "ops:id": "the 'id' op is not computed",
}


class ConfigError(ValueError):
    """A bad monitor config. The message names the dotted key, the value, what is allowed and a fix.

    Args:
        message: What is wrong.
        key: Dotted config key, e.g. ``alert.rules[0].rule_name``.
        value: The offending value (omit when there is none).
        allowed: What would be accepted (a sentence or a list of choices).
        closest: The closest valid choice, shown as "did you mean ...?".
        source: The config file, when the config came from one.
    """

    _NO_VALUE = object()

    def __init__(self, message: str, *, key: str | None = None, value: Any = _NO_VALUE,
                 allowed: str | Iterable[Any] | None = None, closest: Any = _NO_VALUE,
                 source: str | None = None) -> None:
        self.message, self.key, self.value, self.closest, self.source = message, key, value, closest, source
        self.allowed = allowed if allowed is None or isinstance(allowed, str) else list(allowed)
        ValueError.__init__(self, str(self))

    def add_prefix(self, prefix: str) -> None:
        """Makes the key absolute when the error came from a nested section (e.g. `alert`)."""
        self.key = join_key(prefix, self.key) if self.key is not None else (prefix or None)
        self.args = (str(self),)

    def add_source(self, source: str) -> None:
        self.source = source
        self.args = (str(self),)

    def __str__(self) -> str:
        head = f"{self.source}: " if self.source else ""
        if self.key is not None:
            head += f"config key '{self.key}'"
            if self.value is not self._NO_VALUE:
                head += f" = {show(self.value)}"
            head += ": "
        text = head + self.message
        if self.allowed is not None:
            allowed = self.allowed if isinstance(self.allowed, str) else ", ".join(map(show, self.allowed))
            text += f"; allowed: {allowed}"
        if self.closest is not self._NO_VALUE:
            text += f"; did you mean {show(self.closest)}?"
        return text


class ConfigNotHonouredWarning(UserWarning):
    """An msprobe config key that trainmon accepts but does not act on yet."""


def warn_not_honoured(key: str) -> None:
    """Emits the one warning for an accepted-but-not-honoured key (see NOT_HONOURED)."""
    what = f"op {key[4:]!r} in 'ops'" if key.startswith("ops:") else f"key '{key}'"
    warnings.warn(f"monitor config {what} is accepted for msprobe compatibility but not honoured in this "
                  f"version: {NOT_HONOURED[key]}", ConfigNotHonouredWarning, stacklevel=2)


def join_key(prefix: str, key: str) -> str:
    if not prefix:
        return key
    return prefix + key if key.startswith("[") else f"{prefix}.{key}"


def show(value: Any) -> str:
    """Renders a value as the user wrote it in JSON (true, "x", [1, 2]), shortened if long."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def closest(word: Any, choices: Iterable[Any], fallback: Any = None) -> Any:
    """The choice most like `word` (difflib, ignoring case) if it is close; else `fallback`;
    else, with no fallback, the most similar choice however far."""
    by_text = {str(c).lower(): c for c in choices}
    word = str(word).lower()
    found = difflib.get_close_matches(word, list(by_text), n=1, cutoff=0.6)
    if found:
        return by_text[found[0]]
    if fallback is not None:
        return fallback
    return by_text[max(by_text, key=lambda c: difflib.SequenceMatcher(None, word, c).ratio())]


Check = Callable[[Any, str], Any]


def check_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    guess = str(value).strip().lower() in ("1", "true", "yes", "on")
    raise ConfigError("must be a JSON boolean", key=key, value=value, allowed="true, false", closest=guess)


def _as_number(value: Any) -> float | None:
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def check_int(low: int, high: int | None = None) -> Check:
    """An integer in [low, high]. Integral floats such as 1e8 are taken as ints; bools are not."""
    allowed = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"

    def check(value: Any, key: str) -> int:
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            guess = _as_number(value)
            fix = int(guess) if guess is not None and math.isfinite(guess) else ConfigError._NO_VALUE
            raise ConfigError("must be an integer", key=key, value=value, allowed=allowed, closest=fix)
        if value < low or (high is not None and value > high):
            fix = low if value < low else high
            raise ConfigError("is out of range", key=key, value=value, allowed=allowed, closest=fix)
        return value
    return check


def check_number(low: float, below: float | None = None) -> Check:
    """A finite number >= low, and < below when given (int or float, not bool)."""
    allowed = f"a finite number >= {low:g}" + ("" if below is None else f" and < {below:g}")

    def check(value: Any, key: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            guess = _as_number(value)
            fix = guess if guess is not None else ConfigError._NO_VALUE
            raise ConfigError("must be a number", key=key, value=value, allowed=allowed, closest=fix)
        if not math.isfinite(value) or value < low or (below is not None and value >= below):
            raise ConfigError("is out of range", key=key, value=value, allowed=allowed)
        return float(value)
    return check


def check_optional(check: Check) -> Check:
    """None, or a value `check` accepts."""
    def optional(value: Any, key: str) -> Any:
        return None if value is None else check(value, key)
    return optional


def check_choice(choices: tuple[str, ...]) -> Check:
    def check(value: Any, key: str) -> str:
        if value not in choices:
            raise ConfigError("is not a valid choice", key=key, value=value, allowed=choices,
                              closest=closest(value, choices))
        return value
    return check


def check_list(item: Check, what: str) -> Check:
    """A JSON list whose items pass `item` (errors name `key[i]`)."""
    def check(value: Any, key: str) -> list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"must be a list of {what}", key=key, value=value, allowed=f"a list of {what}",
                              closest=_listed_fix(item, value, key))
        return [item(v, f"{key}[{i}]") for i, v in enumerate(value)]
    return check


def _listed_fix(item: Check, value: Any, key: str) -> Any:
    """A list of `value` as an item, or of the item's own fix ("0" where rank numbers go: [0]); none when that is
    not a valid item either."""
    try:
        return [item(value, key)]
    except ConfigError as err:
        fix = err.closest
    if fix is ConfigError._NO_VALUE:
        return fix
    try:
        return [item(fix, key)]
    except ConfigError:
        return ConfigError._NO_VALUE


def check_str(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise ConfigError("must be a string", key=key, value=value, allowed="a string", closest=str(value))
    return value


def check_regex(value: Any, key: str) -> str:
    value = check_str(value, key)
    try:
        re.compile(value)
    except re.error as err:
        raise ConfigError(f"is not a regular expression ({err})", key=key, value=value,
                          allowed="a Python regular expression, e.g. 'layers\\.3\\.'") from None
    return value


def check_mapping(value: Any, key: str) -> dict:
    if not isinstance(value, Mapping):
        raise ConfigError("must be a JSON object", key=key, value=value, allowed="an object {...}")
    return dict(value)


class TargetSpec(NamedTuple):
    """Which part of a module's input/output/grad a `targets` entry selects.

    `TargetSpec(None, None)` is the whole value ("tensor"); `TargetSpec(2, 0)` is element 0 of a
    tuple of length 2 ("tuple[2]:0").
    """

    length: int | None
    index: int | None


_SPEC = re.compile(r"(tensor)|(?:tuple|list)\[(\d+)\](?::(\d+))?")
_SPEC_ALLOWED = '"tensor", or "tuple[N]:I" with 0 <= I < N ("tuple[N]" alone means element 0)'


def parse_target_spec(spec: str, *, key: str = "target spec") -> TargetSpec:
    """Parses an msprobe tensor selector such as "tensor" or "tuple[2]:0".

    Args:
        spec: The selector. msprobe's grammar, plus "list[N]:I" (as `print_struct` names lists).
        key: The dotted config key, for the error message.

    Returns:
        The selected tuple length and element index, or `(None, None)` for the whole value.

    Raises:
        ConfigError: `spec` is not a selector, or the index is outside the tuple.
    """
    if not isinstance(spec, str):
        raise ConfigError("must be a string", key=key, value=spec, allowed=_SPEC_ALLOWED, closest="tensor")
    m = _SPEC.fullmatch(spec.strip())
    if m is None:
        raise ConfigError("is not a tensor selector", key=key, value=spec, allowed=_SPEC_ALLOWED,
                          closest=_guess_spec(spec))
    if m.group(1):
        return TargetSpec(None, None)
    length, index = int(m.group(2)), int(m.group(3) or 0)
    if length < 1:
        raise ConfigError("a tuple selector needs a length >= 1", key=key, value=spec, allowed=_SPEC_ALLOWED,
                          closest="tuple[1]:0")
    if index >= length:
        raise ConfigError(f"element {index} is outside a tuple of length {length}", key=key, value=spec,
                          allowed=_SPEC_ALLOWED, closest=f"tuple[{length}]:{length - 1}")
    return TargetSpec(length, index)


def _guess_spec(spec: str) -> str:
    squeezed = re.sub(r"\s+", "", spec).lower().replace("(", "[").replace(")", "]")
    if _SPEC.fullmatch(squeezed):
        return squeezed
    nums = [int(n) for n in re.findall(r"\d+", spec)]
    if not nums and "tuple" not in squeezed:
        return "tensor"
    length = max(nums[0], 1) if nums else 1
    index = nums[1] if len(nums) > 1 and nums[1] < length else 0
    return f"tuple[{length}]:{index}"


def check_targets(value: Any, key: str) -> dict[str, dict[str, str]]:
    targets: dict[str, dict[str, str]] = {}
    for name, entry in check_mapping(value, key).items():
        k = f"{key}[{json.dumps(name)}]"
        if not isinstance(name, str):
            raise ConfigError("module names must be strings", key=k, value=name, allowed="a module or parameter name")
        selectors: dict[str, str] = {}
        for what, spec in check_mapping(entry, k).items():
            if what not in TARGET_FIELDS:
                raise ConfigError("is not a known target field", key=f"{k}.{what}", allowed=TARGET_FIELDS,
                                  closest=closest(what, TARGET_FIELDS))
            parse_target_spec(spec, key=f"{k}.{what}")
            selectors[what] = spec.strip()
        targets[name] = selectors
    return targets


def check_formats(value: Any, key: str) -> list[str]:
    """The formats of the sink table (`trainmon.core.sinks`: built-in and registered), each once."""
    known = sinks.formats()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise ConfigError("must be a format name or a non-empty list of them", key=key, value=value,
                          allowed=known, closest=[known[0]])
    formats: list[str] = []
    for i, fmt in enumerate(items):
        k = key if isinstance(value, str) else f"{key}[{i}]"
        if fmt not in known:
            raise ConfigError("is not a known output format (trainmon.register_sink adds one)", key=k, value=fmt,
                              allowed=known, closest=closest(fmt, known, fallback=known[0]))
        if fmt not in formats:
            formats.append(fmt)
    return formats


def check_append_output(value: Any, key: str) -> list[str]:
    tags = check_list(check_str, "timestamps")(value, key)
    if len(tags) not in (0, 2):
        raise ConfigError("must be empty or hold exactly 2 timestamps (start, end)", key=key, value=value,
                          allowed='[] or ["Dec03_21-34-40", "Dec03_21-34-41"]', closest=(tags * 2)[:2])
    return tags


def check_rule_args(value: Any, key: str) -> dict:
    args = check_mapping({} if value is None else value, key)  # msprobe: `args` may be absent
    if "threshold" in args:
        args["threshold"] = check_number(0.0)(args["threshold"], f"{key}.threshold")
    for name in ("window", "warmup"):
        if name in args:
            args[name] = check_int(1)(args[name], f"{key}.{name}")
    if "min_relative" in args:
        args["min_relative"] = check_number(0.0)(args["min_relative"], f"{key}.min_relative")
    if "noise" in args:
        args["noise"] = check_number(0.0, below=1.0)(args["noise"], f"{key}.noise")
    if "ops" in args:
        args["ops"] = check_list(check_choice(STAT_OPS), "op names")(args["ops"], f"{key}.ops")
    if "signals" in args:
        args["signals"] = check_list(check_choice(PRECURSOR_SIGNALS), "precursor names")(args["signals"],
                                                                                         f"{key}.signals")
    for name in ("factor", "z", "min_rate"):
        if name in args:
            args[name] = check_number(0.0)(args[name], f"{key}.{name}")
    if "persist" in args:
        args["persist"] = check_int(1)(args["persist"], f"{key}.persist")
    return args


def reject_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError("appears twice in one JSON object (msprobe would silently keep the last one); "
                              "keep one of them", key=key, value=value)
        out[key] = value
    return out


def check_sa_order(value: Any, key: str) -> str:
    """msprobe's `sa_order`, the layout of an attention module's q and k (spaces dropped, as msprobe does)."""
    return check_choice(SA_ORDERS)(value.replace(" ", "") if isinstance(value, str) else value, key)


def check_l2_targets(value: Any, key: str) -> dict[str, list[str]]:
    """msprobe's `l2_targets`: {hook name: [module names]}, hook names from L2_HOOKS."""
    targets = {}
    for hook, names in check_mapping(value, key).items():
        if hook not in L2_HOOKS:
            raise ConfigError("is not an L2 feature hook", key=f"{key}.{hook}", allowed=L2_HOOKS,
                              closest=closest(hook, L2_HOOKS))
        targets[hook] = check_list(check_str, "module names")(names, f"{key}.{hook}")
    return targets


# Keys earlier versions took, with why they are gone: a config that has one gets an error saying so.
REMOVED: dict[str, str] = {
    "params_have_main_grad": "grads are read where the framework keeps them (Megatron's main_grad, DeepSpeed's "
                             "partitions, param.grad elsewhere), as the adapter finds them; delete the key",
}

# msprobe keys that have no MonitorConfig field: dotted key -> (inert value, checker). They are validated as msprobe
# validates them, then dropped; a non-inert value warns (NOT_HONOURED).
ACCEPTED_ONLY: dict[str, tuple[Any, Check]] = {
    "mg_distribution": (False, check_bool),
    "alert.inform": (None, check_mapping),
}
