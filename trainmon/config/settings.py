"""The monitor's JSON config: msprobe's "monitor" keys, meanings and defaults, plus a few of trainmon's.

`load_config(path_or_dict)` returns a validated `MonitorConfig` or raises `ConfigError` before training
starts. A misspelled key or a mistyped value is an error that names the dotted key, the value, what is
allowed and the closest valid choice; msprobe keys trainmon does not act on yet are accepted with one
`ConfigNotHonouredWarning` each (the list is `config_keys.NOT_HONOURED`).

Where trainmon differs from msprobe 26.x (which mostly logs a warning and carries on):
- unknown keys, unknown ops, unknown formats, non-integral step numbers are errors, not warnings;
- `ops` and `format` may each be one string or a list; `shape`/`dtype` in `ops` are accepted and dropped
  (every CSV row carries them), `infs` is an extra op; an `ops` that lists no statistic is an error
  (msprobe monitors `norm` then);
- `ndigits` counts significant digits (msprobe: decimal places), so small values are not printed as 0;
  its default stays msprobe's 6;
- `forward_only` and `backward_only` both true is an error (msprobe warns and records neither);
- `cc_distribution.cc_pre_hook` defaults to true, so turning on `cc_distribution` is enough to trace a
  NaN across ranks;
- integer keys take integral floats (`1e8`), never bools; `eps` may be an int.

Two environment variables complete the config file: `MONITOR_OUTPUT_DIR` (the output root, default
`./monitor_output`) and `DYNAMIC_MONITOR` (`true`: re-read the file when it changes, and start monitoring when
`dynamic_on` is true).
"""
from __future__ import annotations

import copy
import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, ClassVar

from trainmon.core.defaults import (DUMP_MB_PER_STEP, SPIKE_WINDOW, STATS_BATCH_MB, WATCH, WRITER_POLICIES, WRITER_POLICY,
                                     WRITER_QUEUE_SIZE)
from trainmon.config.keys import (
    ACCEPTED_ONLY, ALERT_ACTIONS, COLUMN_OPS, MAX_NDIGITS, NOT_HONOURED, RULE_ARGS, RULE_NAMES,
    OUTPUT_FILESYSTEMS, REMOVED, SAT_DTYPES, STAT_OPS,
    Check, ConfigError, ConfigNotHonouredWarning, TargetSpec, check_append_output, check_bool, check_choice,
    check_formats, check_int, check_l2_targets, check_list, check_number, check_optional, check_regex,
    check_rule_args, check_sa_order, check_str, check_targets,
    closest, join_key, parse_target_spec, reject_duplicates, warn_not_honoured,
)

__all__ = [
    "NOT_HONOURED", "AlertConfig", "CCConfig", "ConfigCheckConfig", "ConfigError",
    "ConfigNotHonouredWarning", "MonitorConfig", "RuleConfig", "TargetSpec", "WatchConfig", "load_config",
    "parse_target_spec",
]


def _field(check: Check, default: Any = MISSING, factory: Any = MISSING, **meta: Any) -> Any:
    return field(default=default, default_factory=factory, metadata={"check": check, **meta})


def _section(cls: type) -> Check:
    """A nested config object: given as the dataclass itself or as its JSON object."""
    def check(value: Any, key: str) -> Any:
        return value if isinstance(value, cls) else _from_mapping(cls, value, key)
    return check


def _validate_fields(obj: Any) -> None:
    # Runs for JSON and for direct construction alike, so a MonitorConfig is always valid.
    for f in fields(obj):
        try:
            setattr(obj, f.name, f.metadata["check"](getattr(obj, f.name), f.name))
        except ConfigError as err:
            default = _default_of(type(obj), f.name)
            if err.key == f.name and err.closest is ConfigError._NO_VALUE and default is not MISSING:
                err.closest = _as_written(default, err.value)  # no better fix than the default
                err.args = (str(err),)
            raise


def _as_written(default: Any, given: Any) -> Any:
    """A default as the user writes it in JSON: a section as an object, with its `enable` set to a boolean given
    in its place (`"watch": true` means `{"enable": true}`), else empty (every default)."""
    if not is_dataclass(default):
        return default
    if isinstance(given, bool) and "enable" in {f.name for f in fields(default)}:
        return {"enable": given}
    return {}


@dataclass(kw_only=True, slots=True)
class RuleConfig:
    """One alert rule, e.g. `{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}`."""

    _PATH: ClassVar[str] = "alert.rules[]"
    rule_name: str = _field(check_choice(RULE_NAMES), allowed=RULE_NAMES)
    """AnomalyTurbulence (value beyond (1 + threshold) x running mean; needs `threshold`), AnomalyNan
    (NaN, or |value| > threshold when given), AnomalySpike or AnomalyPrecursor (trainmon's)."""
    args: dict = _field(check_rule_args, factory=dict)
    """Rule arguments (RULE_ARGS lists each rule's): `threshold` a number >= 0, `window`/`warmup` ints >= 1,
    `min_relative` a number >= 0, `noise` a number from 0 to below 1, `ops` a list of op names; AnomalyPrecursor's
    `signals` (precursor names), `factor`, `z`, `min_rate` numbers >= 0, `persist` an int >= 1."""

    def __post_init__(self) -> None:
        _validate_fields(self)
        allowed = RULE_ARGS[self.rule_name]
        for name in self.args:
            if name not in allowed:
                raise ConfigError(f"is not an argument of {self.rule_name}", key=f"args.{name}",
                                  value=self.args[name], allowed=list(allowed), closest=closest(name, allowed))
        if self.rule_name == "AnomalyPrecursor" and self.args.get("window", 10) < 4:
            raise ConfigError("must be at least 4 (a slope joins the medians of the window's halves)",
                              key="args.window", value=self.args["window"], allowed="an int >= 4", closest=10)
        if self.rule_name == "AnomalySpike" and self.args.get("warmup", 0) > self.args.get("window", SPIKE_WINDOW):
            raise ConfigError(f"must not exceed the window ({SPIKE_WINDOW} unless given)", key="args.warmup",
                              value=self.args["warmup"], allowed="an int from 1 to the window",
                              closest=self.args.get("window", SPIKE_WINDOW))
        if self.rule_name == "AnomalyTurbulence" and "threshold" not in self.args:
            raise ConfigError("AnomalyTurbulence needs a threshold (allowed relative deviation from the "
                              "running mean)", key="args", value=self.args, allowed='{"threshold": <number >= 0>}',
                              closest={**self.args, "threshold": 0.5})


@dataclass(kw_only=True, slots=True)
class CCConfig:
    """msprobe's `cc_distribution`: statistics of collective-communication inputs/outputs."""

    _PATH: ClassVar[str] = "cc_distribution"
    enable: bool = _field(check_bool, default=False)
    """Record statistics of torch.distributed collectives and p2p ops (docs/guides/distributed.md says what cannot be
    seen)."""
    cc_codeline: list[str] = _field(check_list(check_str, "code-line patterns"), factory=list)
    """Only collectives called from these code lines, e.g. "train.py\\\\[23\\\\]"; empty means all."""
    cc_pre_hook: bool = _field(check_bool, default=True)
    """Also record the inputs of collectives (before the call). On by default (msprobe: off): without
    them nan-analyze cannot tell which rank fed a collective its non-finite values."""
    cc_log_only: bool = _field(check_bool, default=False)
    """Only log the collectives used (stack, dtype, group) and stop after the first step."""

    def __post_init__(self) -> None:
        _validate_fields(self)


@dataclass(kw_only=True, slots=True)
class AlertConfig:
    """msprobe's `alert`: online anomaly rules, plus trainmon's `action`."""

    _PATH: ClassVar[str] = "alert"
    rules: list[RuleConfig] = _field(check_list(_section(RuleConfig), "rule objects"), factory=list)
    """Rules checked at every recorded step; the first rule that fires is reported."""
    dump: bool = _field(check_bool, default=False)
    """Save the inputs and outputs of a rank's first anomalous module (needs `sentinel`; msprobe: writes
    `anomaly_detected/`). Anomalies always go to `anomalies.jsonl` when rules or the sentinel are on."""
    action: str = _field(check_choice(ALERT_ACTIONS), default="warn")
    """trainmon: what an anomaly does to training: "warn", "skip_step" or "stop"."""

    def __post_init__(self) -> None:
        _validate_fields(self)


@dataclass(kw_only=True, slots=True)
class WatchConfig:
    """trainmon: `trainmon watch` beside the job, spawned by global rank 0 at `set_monitor` as a detached
    process (never a thread in training); it exits when every rank has finished or the job has ended."""

    _PATH: ClassVar[str] = "watch"
    enable: bool = _field(check_bool, default=False)
    """Spawn the daemon."""
    interval: float = _field(check_number(0.01), default=WATCH.interval)
    """Seconds between the daemon's rounds."""
    logdir: str = _field(check_str, default="")
    """Its output directory; empty: `<run>/watch/`."""
    stall_after: float = _field(check_number(0.01), default=WATCH.stall_after)
    """Seconds without a committed step after which a rank is reported as stalled."""
    heatmap_every: int = _field(check_int(1), default=WATCH.heatmap_every)
    """Redraw the heatmaps every this many steps."""
    ranks: list[int] = _field(check_list(check_int(0), "rank numbers"), factory=list)
    """Ranks whose every figure is also written as its own series."""
    detail: list[str] = _field(check_list(check_regex, "regular expressions"), factory=list)
    """Tensors (regular expressions over their names) whose every op gets charts of its own; the view
    otherwise has one chart per layer and family."""
    on_anomaly: str = _field(check_str, default="")
    """A shell command run with each alert as JSON on stdin; empty: none."""

    def __post_init__(self) -> None:
        _validate_fields(self)


def _check_modules(value: Any, key: str) -> Any:
    if value == "all":
        return value
    return check_list(check_str, "module names")(value, key)


@dataclass(kw_only=True, slots=True)
class DumpConfig:
    """trainmon's `dump`: module inputs, outputs and grads of chosen steps and ranks, saved with safetensors
    (`rank_<R>/dumps/step<S>/`), with an index of call order, shapes, dtypes, statistic records and stacks."""

    _PATH: ClassVar[str] = "dump"
    steps: list[int] = _field(check_list(check_int(0), "step numbers"), factory=list)
    """The steps to dump (at least one)."""
    ranks: list[int] = _field(check_list(check_int(0), "rank numbers"), factory=list)
    """Ranks that dump; empty means all."""
    modules: Any = _field(_check_modules, default="all")
    """"all", or module names: each named module and the modules inside it."""
    max_mb_per_step: int = _field(check_int(1, 1_000_000), default=DUMP_MB_PER_STEP)
    """Cap per rank and step; tensors beyond it are not stored, and the index lists them."""
    backward: bool = _field(check_bool, default=True)
    """Also the grads of module outputs and inputs, in backward."""

    def __post_init__(self) -> None:
        _validate_fields(self)
        if not self.steps:
            raise ConfigError("must list at least one step to dump", key="steps", value=self.steps,
                              allowed="a list of step numbers", closest=[0])


@dataclass(kw_only=True, slots=True)
class ConfigCheckConfig:
    """trainmon: a config-check pack of this job (docs/guides/config-check.md)."""

    _PATH: ClassVar[str] = "config_check"
    enable: bool = _field(check_bool, default=False)
    """At set_monitor, record the weights, random generators, environment and packages, then the inputs of
    the first `batches` micro-steps, into `<output>/rank_<R>.zip`."""
    output: str | None = _field(check_optional(check_str), default=None)
    """Directory of the packs; None: `config_check/` in the run directory."""
    batches: int = _field(check_int(0, 1_000_000), default=1)
    """Training micro-steps whose root-module inputs are recorded."""
    scripts: list[str] = _field(check_list(check_str, "paths of shell scripts"), factory=list)
    """Launch scripts whose hyperparameters (`--lr 1e-4`, `LR=1e-4`) go into the pack."""
    yamls: list[str] = _field(check_list(check_str, "paths of YAML files"), factory=list)
    """YAML configs whose hyperparameters go into the pack."""

    def __post_init__(self) -> None:
        _validate_fields(self)
        for key in ("scripts", "yamls"):  # a missing file is the user's error: say so before training
            for i, path in enumerate(getattr(self, key)):
                if not os.path.isfile(path):
                    raise ConfigError("is not a file", key=f"{key}[{i}]", value=path, allowed="an existing file")


def _check_ops(value: Any, key: str) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ConfigError("must be a list of op names (or one name)", key=key, value=value, allowed=STAT_OPS,
                          closest=["norm"])
    ops: list[str] = []
    for i, op in enumerate(items):
        k = key if isinstance(value, str) else f"{key}[{i}]"
        if op in STAT_OPS:
            if op not in ops:
                ops.append(op)
        elif op in COLUMN_OPS:
            continue  # always written: msprobe appends shape and dtype to every op list
        elif isinstance(op, str) and f"ops:{op}" in NOT_HONOURED:
            if items.index(op) == i:
                warn_not_honoured(f"ops:{op}")
        else:
            raise ConfigError("is not a known op", key=k, value=op, allowed=STAT_OPS, closest=closest(op, STAT_OPS))
    if not ops:
        # msprobe falls back to norm; silently computing a figure nobody asked for hides a typo or a slip
        raise ConfigError('lists no statistic to compute: write the figures you want, e.g. "ops": ["norm"], '
                          'or ["min", "max", "norm", "nans", "infs"]; leave "ops" out for the default ["norm"]',
                          key=key, value=value, allowed=STAT_OPS)
    return ops


@dataclass(kw_only=True, slots=True)
class MonitorConfig:
    """The whole monitor config. Defaults are msprobe 26.x's (`TrainerMon.set_config`)."""

    _PATH: ClassVar[str] = ""
    targets: dict[str, dict[str, str]] = _field(check_targets, factory=dict)
    """Module or parameter name -> selectors {"input"|"output"|"input_grad"|"output_grad": "tensor" |
    "tuple[N]:I"}. Module names match exactly; parameters match by dotted-name prefix. Empty: every
    parameter, and (msprobe) every module when `xy_distribution` is on."""
    all_xy: bool = _field(check_bool, default=False)
    """Record activations of every module, not only `targets` (set automatically when `targets` is empty
    and `xy_distribution` is on, as msprobe does)."""
    xy_distribution: bool = _field(check_bool, default=False)
    """Record module inputs/outputs (forward) and their gradients (backward)."""
    forward_only: bool = _field(check_bool, default=False)
    """With `xy_distribution`: forward only (no `input_grad`/`output_grad`)."""
    backward_only: bool = _field(check_bool, default=False)
    """With `xy_distribution`: backward only (no `input`/`output`)."""
    eval_xy_distribution: bool = _field(check_bool, default=False)
    """trainmon: with `xy_distribution`, also record module inputs/outputs of evaluation forwards (under
    `no_grad`/`inference_mode` or with the model in `eval()`) in the `actv_eval` family, at the last optimizer
    step applied before them where that step was collected, numbered by evaluation pass. Off: evaluation forwards
    are not recorded."""
    wg_distribution: bool = _field(check_bool, default=False)
    """Record weight gradients before (`grad_unreduced`) and after (`grad_reduced`) the DP reduction; `grad_reduced`
    is what the update consumes, after loss-scale unscaling and clipping."""
    monitor_mbs_grad: bool = _field(check_bool, default=False)
    """Record unreduced weight gradients per micro-batch instead of per step."""
    mv_distribution: bool = _field(check_bool, default=False)
    """Record the optimizer's first and second moments (`exp_avg`, `exp_avg_sq`)."""
    param_distribution: bool = _field(check_bool, default=False)
    """Record weights before (`param_origin`) and after (`param_updated`) the optimizer step."""
    mg_direction: bool = _field(check_bool, default=False)
    """Record the fraction of gradient elements whose sign matches the first moment's."""
    ur_distribution: bool = _field(check_bool, default=False)
    """Record Adam's bias-corrected update m̂/(√v̂+ε) (`adam_update`) and ratio m̂/√v̂ (`adam_ratio`)."""
    cc_distribution: CCConfig = _field(_section(CCConfig), factory=CCConfig)
    """Collective-communication statistics (see CCConfig)."""
    recording_l2_features: bool = _field(check_bool, default=False)
    """msprobe's L2 features of the modules `l2_targets` names (families `attention_hook`, `linear_hook`,
    `moe_router_weight_hook`, `moe_router_logit_hook`; trainmon.hooks.features)."""
    l2_targets: dict[str, list[str]] = _field(check_l2_targets, factory=dict)
    """Hook name -> module names (as `targets` names modules, with or without the `<vpp>:` prefix): `attention_hook`
    (modules whose first two inputs are q and k), `linear_hook` (2-D weights; an empty list: every such module),
    `moe_router_weight_hook` (router weights), `moe_router_logit_hook` (modules whose output is router logits)."""
    sa_order: str = _field(check_sa_order, default="s,b,h,d")
    """Layout of the q and k an `attention_hook` module takes: "s,b,h,d" (Megatron-Core) or "b,s,h,d"."""
    moe_load: bool = _field(check_bool, default=False)
    """trainmon: per mixture-of-experts layer and step, from the router's own routing decision (Megatron-Core's
    TopKRouter, DeepSpeed's TopKGate), merged over the expert-parallel group: tokens per expert, load imbalance
    (max over mean), experts without a token, tokens dropped by capacity, router entropy (family `moe_load`)."""
    ops: list[str] = _field(_check_ops, factory=lambda: ["norm"])
    """Statistics per tensor, from min, max, norm, mean, zeros (fraction with |x| < eps), nans, infs, sat
    (elements at or beyond the saturation limit, see `sat_threshold`).
    One string is taken as a one-item list."""
    eps: float = _field(check_number(0.0), default=1e-8)
    """Threshold of the `zeros` op: |x| < eps counts as zero."""
    sat_threshold: float | None = _field(check_optional(check_number(0.0)), default=None)
    """trainmon: the `sat` op counts finite |x| >= this; null: the largest finite value of each tensor's dtype
    (65504 for fp16)."""
    sat_dtype: str | None = _field(check_optional(check_choice(SAT_DTYPES)), default=None)
    """trainmon: without `sat_threshold`, count wider tensors (fp32) against this dtype's largest finite value
    ("float16" or "bfloat16"): would they overflow in half precision?"""
    ndigits: int = _field(check_int(1, MAX_NDIGITS), default=6)
    """Significant digits written to CSV (msprobe: decimal places; same default, 6)."""
    start_step: int = _field(check_int(0), default=0)
    """First step recorded (ignored in DYNAMIC_MONITOR mode, which starts at the next step)."""
    collect_times: int = _field(check_int(0), default=100_000_000)
    """Stop after this many recorded steps (the default means "never")."""
    step_interval: int = _field(check_int(1), default=1)
    """Record every step_interval-th step from start_step."""
    step_count_per_record: int = _field(check_int(1, 1_000_000), default=1)
    """Steps per CSV file (`actv_0-4.csv` holds steps 0..4 when 5)."""
    module_ranks: list[int] = _field(check_list(check_int(0), "rank numbers"), factory=list)
    """Ranks that record; empty means all ranks."""
    print_struct: bool = _field(check_bool, default=False)
    """Save the module tree to `module_struct.json`; unlike msprobe, training continues."""
    stack_info: bool = _field(check_bool, default=False)
    """Save each module's call stack once, at the first recorded step."""
    format: list[str] = _field(check_formats, factory=lambda: ["csv"])
    """Output sinks; one string or a list: the names of the sink table (`trainmon.core.sinks`)."""
    squash_name: bool = _field(check_bool, default=False)
    """Shorten module and parameter names (msprobe's squash_param_name)."""
    alert: AlertConfig = _field(_section(AlertConfig), factory=AlertConfig)
    """Online anomaly rules (see AlertConfig)."""
    watch: WatchConfig = _field(_section(WatchConfig), factory=WatchConfig)
    """trainmon: the monitor daemon started beside the job (see WatchConfig)."""
    config_check: ConfigCheckConfig = _field(_section(ConfigCheckConfig), factory=ConfigCheckConfig)
    """trainmon: record a config-check pack at set-up (see ConfigCheckConfig)."""
    append_output: list[str] = _field(check_append_output, factory=list)
    """Resume: [start, end] bounds of earlier run names (`run-YYYYmmdd-HHMMSS`); the latest existing run whose
    name sorts between them is appended to. [] starts a new run."""
    dynamic_on: bool = _field(check_bool, default=False)
    """Under DYNAMIC_MONITOR=true: start monitoring (reset to false after collect_times steps)."""
    sentinel: bool = _field(check_bool, default=False)
    """trainmon: the NaN sentinel, a probe of every training forward's module outputs, activation grads, weight
    grads and updated weights at every step, naming the first NaN/Inf (docs/guides/anomalies.md)."""
    strict: bool = _field(check_bool, default=False)
    """trainmon: re-raise exceptions inside hooks and writers instead of logging them (for tests)."""
    writer_policy: str = _field(check_choice(WRITER_POLICIES), default=WRITER_POLICY)
    """trainmon: when the writer's queue of steps is full, "block" makes the training thread wait (the
    wait is recorded) and "drop" skips the step's output (counted); both are reported in run.json."""
    writer_queue_size: int = _field(check_int(1, 100_000), default=WRITER_QUEUE_SIZE)
    """trainmon: step batches the writer queues before `writer_policy` applies."""
    output_filesystem: str = _field(check_choice(OUTPUT_FILESYSTEMS), default="auto")
    """trainmon: how the `db` format writes: "auto" from the filesystem of the output directory, "local"
    (monitor.db, SQLite in WAL mode) or "network" (records.stream, which other hosts can read live)."""
    dump: DumpConfig | None = _field(check_optional(_section(DumpConfig)), default=None)
    """trainmon: tensor dumps of chosen steps (see DumpConfig); null: none."""
    stats_batch_mb: int = _field(check_int(0, 1_000_000), default=STATS_BATCH_MB)
    """trainmon: activations are held until this many MB are pending, then reduced in one batch
    (far cheaper than one reduction per hook); 0 reduces each hook's tensors at once."""

    def __post_init__(self) -> None:
        _validate_fields(self)
        if self.forward_only and self.backward_only:
            raise ConfigError("forward_only and backward_only are both true, which records no activation "
                              "(msprobe warns and collects neither)", key="backward_only", value=True,
                              allowed="at most one of forward_only, backward_only set to true", closest=False)
        if not self.targets and self.xy_distribution:
            self.all_xy = True  # msprobe's validate_config does the same
        if self.l2_targets and not self.recording_l2_features:
            warnings.warn("monitor config 'l2_targets' has no effect without \"recording_l2_features\": true (as in "
                          "msprobe): no L2 feature is recorded", UserWarning, stacklevel=2)
        if (self.recording_l2_features or self.moe_load) and not {"min", "max", "mean"} & set(self.ops):
            warnings.warn("monitor config: an L2 feature or MoE load figure is written as the record of one value, "
                          f"whose min, max and mean are the value; with 'ops' {self.ops} only its norm, |value|, is "
                          "written (a negative value loses its sign): add \"max\" to 'ops'", UserWarning, stacklevel=2)
        if self.collect_times == 0:
            warnings.warn("monitor config 'collect_times' = 0: no step will be collected (only logged scalars are "
                          "written); give the number of steps to record, or leave the key out for all",
                          UserWarning, stacklevel=2)
        for key in NOT_HONOURED:
            if _attribute(self, key):
                warn_not_honoured(key)


def _attribute(obj: Any, dotted: str) -> Any:
    """The value at a dotted attribute path, or None when the path is not a config field."""
    for name in dotted.split("."):
        if not is_dataclass(obj) or name not in {f.name for f in fields(obj)}:
            return None
        obj = getattr(obj, name)
    return obj


def _default_of(cls: type, name: str) -> Any:
    f = next(f for f in fields(cls) if f.name == name)
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _build(cls: type, raw: Any) -> Any:
    """Builds `cls` from its JSON object; errors carry keys relative to this object."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"must be a JSON object, not {type(raw).__name__}", value=raw, allowed="an object {...}")
    names = [f.name for f in fields(cls)]
    extra = {k: k.rpartition(".")[2] for k in ACCEPTED_ONLY if k.rpartition(".")[0] == cls._PATH}
    known = names + sorted(extra.values())
    kwargs = {}
    for key, value in raw.items():
        full = join_key(cls._PATH, key) if isinstance(key, str) else ""
        if key in names:
            kwargs[key] = value
        elif full in extra:
            inert, check = ACCEPTED_ONLY[full]
            if check(value, key) != inert and full in NOT_HONOURED:
                warn_not_honoured(full)
        elif full in REMOVED:
            raise ConfigError(f"is no longer a key: {REMOVED[full]}", key=str(key))
        else:
            raise ConfigError("is not a known key", key=str(key), allowed=known, closest=closest(key, known))
    for f in fields(cls):
        if f.name not in kwargs and f.default is MISSING and f.default_factory is MISSING:
            raise ConfigError("is required", key=f.name, allowed=f.metadata.get("allowed", "a value"))
    return cls(**kwargs)


def _from_mapping(cls: type, raw: Any, key: str) -> Any:
    try:
        return _build(cls, raw)
    except ConfigError as err:
        err.add_prefix(key)
        raise


def _read_json(path: str) -> Any:
    # The path leads the message (ConfigError.source); a relative one is resolved too, since ranks of
    # a distributed job need not share a working directory.
    where = "" if os.path.isabs(path) else f" (resolved to {os.path.abspath(path)})"
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"config file not found{where}", source=path) from None
    except IsADirectoryError:
        raise ConfigError(f"is a directory, not a JSON config file{where}", source=path) from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file is not UTF-8 text ({err.reason} at byte {err.start})", source=path) from None
    except OSError as err:
        raise ConfigError(f"cannot read config file{where}: {err.strerror or err}", source=path) from None
    try:
        return json.loads(text, object_pairs_hook=reject_duplicates)
    except json.JSONDecodeError as err:
        hint = " (JSON does not allow comments)" if text.startswith(("//", "/*"), err.pos) else ""
        raise ConfigError(f"invalid JSON at line {err.lineno}, column {err.colno}: {err.msg}{hint}",
                          source=path) from None
    except ConfigError as err:
        err.add_source(path)
        raise


def load_config(path_or_dict: str | os.PathLike | Mapping[str, Any] | MonitorConfig) -> MonitorConfig:
    """Reads and validates a monitor config.

    Args:
        path_or_dict: Path to a JSON file, or the parsed JSON as a dict (not modified), or a
            MonitorConfig (returned as is).

    Returns:
        The validated config. msprobe keys that are accepted but not honoured each emit one
        ConfigNotHonouredWarning.

    Raises:
        ConfigError: Missing or unreadable file, invalid JSON (with line and column), unknown key or
            bad value (with the dotted key, the value, what is allowed and the closest valid choice).
    """
    if isinstance(path_or_dict, MonitorConfig):
        return path_or_dict
    source = None
    if isinstance(path_or_dict, (str, os.PathLike)):
        source = os.fspath(path_or_dict)
        raw = _read_json(source)
    elif isinstance(path_or_dict, Mapping):
        raw = copy.deepcopy(dict(path_or_dict))
    else:
        raise ConfigError(f"load_config takes a path to a JSON file or a dict, not {type(path_or_dict).__name__}")
    if not isinstance(raw, Mapping):
        raise ConfigError(f"the config must be a JSON object {{...}}, not {type(raw).__name__}", source=source)
    try:
        return _from_mapping(MonitorConfig, raw, "")
    except ConfigError as err:
        if source is not None:
            err.add_source(source)
        raise
