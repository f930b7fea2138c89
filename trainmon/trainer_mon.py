"""TrainerMon: the public entry point that wires config, hooks, the collector and the writer."""
from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import warnings
from typing import Optional, Sequence

import torch

from trainmon.anomaly.processor import AnomalyProcessor, processor_for
from trainmon.core.layout import DYNAMIC_STATE_FILE, MODULE_STRUCT_FILE, RUN_JSON, WRITER_REPORT
from trainmon.core.records import (ACTIVATION_FAMILIES, ADAM_RATIO, ADAM_UPDATE, EXP_AVG, EXP_AVG_SQ, GRAD_REDUCED,
                                   GRAD_UNREDUCED, MG_DIRECTION, PARAM_ORIGIN, PARAM_UPDATED,
                                   PER_MICRO_FEATURE_FAMILIES, SAVED_FAMILIES, StepBatch)
from trainmon.core.derive import derive_rows
from trainmon.hook_table import SetUp, build_groups, config_warnings, unreduced_mode
from trainmon.engine import stats
from trainmon.adapters import ADAPTER_PER_MICRO_BATCH, PER_MICRO_BATCH, TrainingAdapter, select_adapter
from trainmon.adapters.base import group_coordinates
from trainmon.hooks.collector import StepCollector
from trainmon.config.settings import MonitorConfig, load_config
from trainmon.config.dynamic import DynamicConfigWatcher, dynamic_enabled
from trainmon.hooks.hook_group import HookGroup
from trainmon.config.output import agree_on_run_name, distributed_rank, rank_dir, run_metadata, write_json
from trainmon.config.schedule import CollectionSchedule
from trainmon.hooks.selection import watched_params
from trainmon.hooks.state import HookState, without_torch_function
from trainmon.hooks.structure import module_structure
from trainmon.watch.spawn import spawn_watch
from trainmon.writers import filesystem
from trainmon.writers.api_sink import ApiSink
from trainmon.writers.async_writer import AsyncWriter
from trainmon.writers.base import SinkContainer, SinkContext
from trainmon.writers.registry import build_sinks
from trainmon.writers.shutdown import SigtermDrain
from trainmon.writers.tensor_dump_sink import TensorDumpSink

logger = logging.getLogger("trainmon")
_NOT_GIVEN = object()  # an msprobe argument left out of the call


class TrainerMon:
    """Monitors a model and its optimizer according to a JSON config.

    Example:
        monitor = TrainerMon("monitor_config.json")
        monitor.set_monitor(model, optimizer=optimizer, grad_acc_steps=ga)

    Every `optimizer.step()` is then one monitor step. `stop()` (or leaving a `with` block) removes
    every hook and writes everything queued.

    Args:
        config_file_path: the JSON config (msprobe monitor keys); validated here, before training.
        process_group, params_have_main_grad, opt_ty: msprobe's arguments (its defaults: None, True, None),
            accepted so that msprobe's calls run unchanged; trainmon needs none of them, and one given warns
            once saying why (`UNUSED_MSPROBE_ARGUMENTS`).
    """

    def __init__(self, config_file_path: str, process_group=_NOT_GIVEN, params_have_main_grad=_NOT_GIVEN,
                 opt_ty=_NOT_GIVEN):
        _warn_unused_msprobe_arguments(process_group=process_group, params_have_main_grad=params_have_main_grad,
                                       opt_ty=opt_ty)
        self.config_path = config_file_path
        self.config: MonitorConfig = load_config(config_file_path)
        self.step = 0
        self.rank, self.world_size = distributed_rank()
        self.output_dir = None
        self._api = ApiSink()
        self._writer: Optional[AsyncWriter] = None
        self._hooks: list[HookGroup] = []
        self._schedule: Optional[CollectionSchedule] = None
        self._state: Optional[HookState] = None
        self._dynamic: Optional[DynamicConfigWatcher] = None
        self._chunks: list[torch.nn.Module] = []
        self._optimizer = None
        self._adapter: Optional[TrainingAdapter] = None
        self._grad_acc_steps = 1
        self._anomalies: Optional[AnomalyProcessor] = None
        self._dump_sink: Optional[TensorDumpSink] = None
        self._eval_collector: Optional[StepCollector] = None
        self._metadata: dict = {}
        self._sigterm: Optional[SigtermDrain] = None
        self.watch_process = None  # `trainmon watch`, when the `watch` key has global rank 0 start it
        self._config_capture = None
        self._said_at_set_up: set[str] = set()  # messages said when the hooks were installed (`_say_at_set_up`)

    # ----------------------------------------------------------------------------------- set-up
    def set_monitor(self, model, optimizer, grad_acc_steps: int = 1, tp_group=None, dp_group=None,
                    start_iteration: int = 0) -> "TrainerMon":
        """Installs the hooks on `model` (a module, or a list of virtual-pipeline chunks) and `optimizer`.

        Monitoring never takes training down: a failure here that is not the caller's error (an optimizer
        or model of a kind nobody foresaw) is logged once, saying what is not collected, and training goes
        on with less monitoring or none (`strict` re-raises it).

        Args:
            model: the module, or a list of modules for virtual pipeline chunks (names get `<i>:`).
            optimizer: the optimizer whose `step()` ends a monitor step; wrappers of accelerate and
                Lightning are taken off (see `adapters.unwrap`).
            grad_acc_steps: micro-batches per optimizer step.
            tp_group, dp_group: tensor- and data-parallel groups (used by distributed adapters).
            start_iteration: the step number of the first step (a resumed job).

        Raises:
            ValueError: no optimizer was given.
        """
        if optimizer is None:
            raise ValueError("set_monitor needs the optimizer: every optimizer.step() is one monitor step")
        if self._state is not None:
            raise RuntimeError("set_monitor was already called on this TrainerMon; call stop() first")
        try:
            self._set_up(model, optimizer, grad_acc_steps, start_iteration, tp_group=tp_group, dp_group=dp_group)
        except Exception as err:
            if self.config.strict:
                raise
            logger.error("trainmon: set-up failed on %s / %s (%s: %s); monitoring is off, training continues",
                         type(model).__name__, type(optimizer).__name__, type(err).__name__, err, exc_info=True)
            self.stop()
        return self

    def _set_up(self, model, optimizer, grad_acc_steps: int, start_iteration: int, **groups) -> None:
        self._chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        self._optimizer = optimizer
        self._adapter = select_adapter(self._chunks, optimizer)
        self._grad_acc_steps = max(1, int(grad_acc_steps))
        self.step = start_iteration
        run = agree_on_run_name(self.config.append_output)
        self.output_dir = rank_dir(run, self.rank)
        self._metadata = run_metadata(
            dataclasses.asdict(self.config), self.rank, self.world_size,
            {"run": run, "grad_acc_steps": self._grad_acc_steps, "start_iteration": start_iteration,
             "adapter": self._adapter.name, "parallel": _parallel_metadata(self._adapter, **groups),
             "pp_stage": self._adapter.pp_stage()})
        # SQLite's WAL works on one host's disk only: on a network filesystem the db format writes a stream
        self._filesystem = filesystem.choose(self.output_dir, self.config.output_filesystem)
        self._metadata["output_filesystem"] = self._filesystem.as_dict()
        if self.rank == 0 and "db" in self.config.format:
            filesystem.log_choice(self._filesystem, self.output_dir.parent)
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            write_json(self.output_dir / RUN_JSON, self._metadata)
        except OSError as err:
            # Monitoring never takes training down: the file sinks report their own failure at start.
            logger.error("trainmon: cannot write to the output directory %s (%s); training continues, file "
                         "outputs are disabled", self.output_dir, err)

        if self.config.config_check.enable:
            self._config_capture = _start_config_capture(self.config, self._chunks, self.output_dir.parent)
        self._state = HookState(self._new_collector(), self._grad_acc_steps, self.config.strict)
        self._writer = self._start_writer()
        if dynamic_enabled():
            self._dynamic = DynamicConfigWatcher(self.config_path, str(self.output_dir / DYNAMIC_STATE_FILE))
        self._said_at_set_up.clear()
        self._install(self.config)
        atexit.register(self._close_at_exit)
        self._sigterm = SigtermDrain(drain=self._writer.drain, close=self._close_at_exit)
        self._sigterm.install()
        if self.config.watch.enable and distributed_rank()[0] == 0:
            self.watch_process = spawn_watch(self.output_dir.parent, self.config.watch)

    def _start_writer(self) -> AsyncWriter:
        cfg = self.config
        per_micro_grads = unreduced_mode(cfg, self._adapter) in (PER_MICRO_BATCH, ADAPTER_PER_MICRO_BATCH)
        per_micro = set(ACTIVATION_FAMILIES | SAVED_FAMILIES | PER_MICRO_FEATURE_FAMILIES) | \
            ({GRAD_UNREDUCED} if per_micro_grads else set())
        stream = self._filesystem.write_path == filesystem.STREAM_PATH
        context = SinkContext(rank_dir=self.output_dir, rank=self.rank, ops=tuple(cfg.ops), ndigits=cfg.ndigits,
                              step_count_per_record=cfg.step_count_per_record,
                              per_micro_families=frozenset(per_micro), metadata=self._metadata, stream=stream)
        self._anomalies = processor_for(cfg, database=not stream)
        self._dump_sink = TensorDumpSink() if cfg.dump is not None else None
        sinks = SinkContainer([self._api] + build_sinks(cfg.format) +
                              ([self._anomalies] if self._anomalies else []) +
                              ([self._dump_sink] if self._dump_sink else []))
        sinks.start(context)
        writer = AsyncWriter(sinks, functools.partial(derive_rows, ops=tuple(cfg.ops)),
                             max_queue=cfg.writer_queue_size, policy=cfg.writer_policy)
        writer.start()
        return writer

    def _install(self, config: MonitorConfig) -> None:
        """Builds and installs the hook groups `config` asks for (trainmon.hook_table); `_remove` undoes it."""
        state = self._state
        writes = self._writes_records(config)
        params = self._adapter.prepare([dataclasses.replace(w, name=self._adapter.rename(w.vpp_stage, w.name))
                                        for w in watched_params(self._chunks, config)])
        self._schedule = CollectionSchedule(config.start_step, config.step_interval, config.collect_times,
                                            rank_enabled=writes or config.moe_load or
                                            self._merges_across_ranks(params))
        if self._dynamic is not None and not config.dynamic_on:
            self._schedule.rank_enabled = False
        self._say_at_set_up(config)
        self._eval_collector = state.eval_collector = None  # armed when a step has been applied (_end_step)
        if config.eval_xy_distribution and config.xy_distribution and writes:
            self._eval_collector = self._new_collector()
        self._hooks = build_groups(SetUp(
            config=config, state=state, chunks=self._chunks, optimizer=self._optimizer, adapter=self._adapter,
            params=params, rank=self.rank, output_dir=self.output_dir, writes=writes, anomalies=self._anomalies,
            dump_sink=self._dump_sink, drain=self._writer.drain, step_of=lambda: self.step,
            end_step=self._end_step, log_scalar=self.log_scalar))
        self._install_each()
        if config.print_struct:
            self.save_structure()
        state.start_step(self.step, self._schedule.wants(self.step))

    def _install_each(self) -> None:
        """Installs every group of hooks; a group that fails is logged, removed and left out, except the
        ones that define steps and micro-steps, without which nothing can be recorded (set_monitor then
        turns monitoring off)."""
        installed = []
        for hooks in self._hooks:
            try:
                hooks.install()
            except Exception as err:
                if self.config.strict or hooks.required:
                    raise
                logger.error("trainmon: %s could not be installed (%s: %s) and is not collected; training "
                             "continues", hooks.collects, type(err).__name__, err)
                try:
                    hooks.remove()
                except Exception:
                    logger.debug("trainmon: removing the partly installed %s failed", type(hooks).__name__,
                                 exc_info=True)
                continue
            installed.append(hooks)
        self._hooks = installed

    def _new_collector(self) -> StepCollector:
        config = self.config
        # the sentinel and the activation hooks both report each module output and its grad
        shared_events = config.sentinel and config.xy_distribution
        return StepCollector(config.eps, record_fields(config), self.rank, self._adapter.pp_stage(),
                             batch_bytes=config.stats_batch_mb << 20, shared_events=shared_events)

    def _writes_records(self, config: MonitorConfig) -> bool:
        """Whether this rank writes statistics (`module_ranks` lists it, or is empty)."""
        return not config.module_ranks or self.rank in config.module_ranks

    def _say_at_set_up(self, config: MonitorConfig) -> None:
        """Says which keys ask for something another key must turn on, and that `module_ranks` leaves this rank out: a
        warning where the job is one process (nothing at all is written, most likely a config made for another
        job), else a line in the log. Once each: a dynamic config installs the hooks again, and says only what
        changed."""
        said = [(logging.WARNING, message) for message in config_warnings(config)]
        if not self._writes_records(config) and self.world_size == 1:
            said.append((logging.WARNING, f"trainmon: module_ranks {config.module_ranks} does not list rank 0, this "
                                          "job's only process: no statistics are written"))
        elif not self._writes_records(config):
            said.append((logging.INFO, f"trainmon: rank {self.rank} is not in module_ranks {config.module_ranks}: it "
                                       "writes no statistics"))
        for level, message in said:
            if message not in self._said_at_set_up:
                self._said_at_set_up.add(message)
                logger.log(level, "%s", message)

    def _merges_across_ranks(self, params: list) -> bool:
        """Sharded tensors merge their records in a collective: every rank of the group must collect."""
        groups = {g for w in params for g in w.merge_over if g is not None}
        if all(torch.distributed.get_world_size(g) == 1 for g in groups):
            return False
        logger.warning("trainmon: with the %s adapter sharded tensors are merged across ranks, so ranks outside "
                       "module_ranks collect the weight, grad and optimizer families too but write nothing",
                       self._adapter.name)
        return True

    def _remove(self) -> None:
        for hooks in self._hooks:
            hooks.remove()
        self._hooks = []

    # ------------------------------------------------------------------------------ step cycle
    @without_torch_function
    def _end_step(self) -> None:
        """Closes the step (called after every optimizer.step()) and decides about the next one."""
        state = self._state
        collected = state.collecting
        if collected:
            self._schedule.mark_collected()
        for hooks in self._hooks:
            hooks.step_finished(collected)
        self._ship_evaluation()
        if not state.collector.empty:
            batch = state.collector.finish_step()
            if self._writes_records(self.config):
                self._writer.put(batch)
        if self._eval_collector is not None:
            # Evaluation forwards from now on see the weights this step produced: they carry its number, and are
            # recorded where it was collected (beside its training records).
            self._eval_collector.step = self.step
            state.eval_collector = self._eval_collector if collected else None
        self.step += 1
        if self._dynamic is not None:
            new_config = self._dynamic.poll(self.step)
            if new_config is not None:
                self._apply_dynamic(new_config)
                return
        state.start_step(self.step, self._schedule.wants(self.step))

    def _ship_evaluation(self) -> None:
        """Writes the records of the evaluation forwards since the last optimizer step."""
        if self._eval_collector is not None and not self._eval_collector.empty:
            self._writer.put(self._eval_collector.finish_step())

    def _apply_dynamic(self, config: MonitorConfig) -> None:
        logger.info("trainmon: config changed; monitoring is %s from step %s",
                    "on" if config.dynamic_on else "off", self.step)
        self._remove()
        self.config = config
        self._install(config)

    @property
    def active(self) -> bool:
        """Whether monitoring is installed (set_monitor succeeded and stop() was not called)."""
        return self._state is not None

    def save_structure(self) -> None:
        """Writes the module tree, `module_struct.json` (every module in model order with its class; what
        `print_struct` asks for), from which TensorBoard's structure view draws the tree. Integrations call it
        whatever the config. A file that cannot be written is logged; training goes on."""
        if self._state is None:
            raise RuntimeError("call set_monitor before save_structure")
        try:
            write_json(self.output_dir / MODULE_STRUCT_FILE, module_structure(self._chunks))
        except OSError as err:
            logger.error("trainmon: cannot write %s (%s); the structure view orders the tree by name",
                         self.output_dir / MODULE_STRUCT_FILE, err)

    def log_scalar(self, name: str, value, step: Optional[int] = None) -> None:
        """Records a training scalar (loss, lr, grad norm) with the current (or given) step.

        A tensor value stays on its device until the step's single transfer.
        """
        if self._state is None:
            raise RuntimeError("call set_monitor before log_scalar")
        if step is None or step == self.step:
            self._state.collector.add_scalar(name, value)
        else:
            value = float(value.detach().float().cpu()) if isinstance(value, torch.Tensor) else float(value)
            self._writer.put(StepBatch(step=step, rank=self.rank, pp_stage=0, keys=[], scalars={name: value}))

    # ---------------------------------------------------------------------------------- results
    def _latest(self, families: Sequence[str]) -> dict:
        if self._writer is not None:
            self._writer.drain()
        return self._api.latest(families)

    def generate_wgrad_metrics(self) -> dict:
        """{tag: {op: value}} of the weight grads (pre_grad and post_grad) of the last collected step."""
        return self._latest([GRAD_UNREDUCED, GRAD_REDUCED])

    def generate_xy_metrics(self) -> dict:
        """{tag: {op: value}} of the activations and their grads of the last collected step."""
        return self._latest(sorted(ACTIVATION_FAMILIES))

    def generate_param_metrics(self) -> dict:
        """{tag: {op: value}} of the weights before and after the last collected update."""
        return self._latest([PARAM_ORIGIN, PARAM_UPDATED])

    def generate_mv_metrics(self) -> dict:
        """{tag: {op: value}} of the Adam moments (and update/ratio, sign agreement) of the last collected step."""
        return self._latest([EXP_AVG, EXP_AVG_SQ, ADAM_UPDATE, ADAM_RATIO, MG_DIRECTION])

    # ---------------------------------------------------------------------------------- teardown
    def stop(self) -> None:
        """Removes every hook and writes every queued step. Safe to call twice."""
        for hooks in self._hooks:
            hooks.finish()
        self._remove()
        if self._config_capture is not None:
            self._config_capture.close()  # a job with fewer micro-steps than `batches` still gets its pack
            self._config_capture = None
        if self._writer is not None and not self._writer.closed:
            self._ship_evaluation()
        if self._state is not None and not self._state.collector.empty:
            self._writer.put(self._state.collector.finish_step())
        if self._sigterm is not None:
            self._sigterm.remove()
            self._sigterm = None
        if self._writer is not None and not self._writer.closed:
            self._writer.close()
            collector = self._state.collector if self._state is not None else None
            self._save_writer_report({} if collector is None else {
                "records_dropped_in_place": dict(collector.dropped_in_place),
                "input_grads_not_recorded": dict(collector.input_grads_not_recorded)})
        atexit.unregister(self._close_at_exit)
        self._state = None

    def _save_writer_report(self, unrecorded: dict) -> None:
        """Adds the writer's counts (written, dropped, failed steps, time waited, disabled sinks) and the records the
        hooks could not make (per reason, then per name: `StepCollector.dropped_in_place`,
        `input_grads_not_recorded`) to run.json."""
        report = self._writer.report()
        path = self.output_dir / RUN_JSON
        try:
            write_json(path, {**self._metadata, WRITER_REPORT: report, **unrecorded})
            details = f"details in {path}"
        except OSError as err:
            logger.error("trainmon: cannot write %s (%s); writer report: %s", path, err, report)
            details = "details in the writer report above"
        lost = {name: info["lost_steps"] for name, info in report["disabled_sinks"].items()}
        if report["dropped_steps"] or report["failed_steps"] or lost:
            logger.warning("trainmon: output is incomplete: %s steps dropped (queue full), %s failed, steps lost "
                           "per disabled sink %s; %s", report["dropped_steps"], report["failed_steps"], lost, details)

    def _close_at_exit(self) -> None:
        try:
            self.stop()
        except Exception:
            logger.exception("trainmon: stopping at interpreter exit failed")

    def __enter__(self) -> "TrainerMon":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class UnusedArgumentWarning(UserWarning):
    """An argument of msprobe's TrainerMon that trainmon accepts and does not need."""


# msprobe's TrainerMon arguments, with why trainmon needs none of them.
UNUSED_MSPROBE_ARGUMENTS = {
    "process_group": "every rank writes rank_<global rank>/ and sharded tensors merge over the groups the "
                     "framework's adapter reads; the config's module_ranks chooses the ranks that write",
    "params_have_main_grad": "grads are read where the framework keeps them (Megatron's main_grad, DeepSpeed's "
                             "partitions, param.grad elsewhere), as its adapter finds them",
    "opt_ty": "the optimizer's adapter is chosen from the optimizer object given to set_monitor",
}


def _warn_unused_msprobe_arguments(**given) -> None:
    for name, value in given.items():
        if value is not _NOT_GIVEN:
            warnings.warn(f"TrainerMon({name}=...) is accepted for msprobe compatibility and not needed: "
                          f"{UNUSED_MSPROBE_ARGUMENTS[name]}", UnusedArgumentWarning, stacklevel=3)


def _start_config_capture(config: MonitorConfig, chunks: list, run_dir):
    """The config-check capture of `config_check` (imported only when it is on), or None when it failed:
    a pack that cannot be made never stops training or monitoring."""
    from trainmon.config_check import capture

    cc = config.config_check
    try:
        return capture(chunks, scripts=cc.scripts, yamls=cc.yamls, output=cc.output or run_dir / "config_check",
                       batches=cc.batches)
    except Exception as err:
        logger.error("trainmon: config_check capture failed (%s: %s); no pack is written, training continues",
                     type(err).__name__, err)
        return None


def _parallel_metadata(adapter: TrainingAdapter, **groups) -> dict:
    """This rank's parallel coordinates from the adapter, plus {rank, size, ranks} of groups given to set_monitor."""
    out = adapter.describe()
    running = torch.distributed.is_available() and torch.distributed.is_initialized()
    for name, group in groups.items():
        if running and group is not None:
            out[name] = group_coordinates(group)
    return out


def record_fields(config: MonitorConfig) -> stats.FieldSet:
    """The record fields `config.ops` need, with the saturation limit of the `sat` op."""
    sat_dtype = getattr(torch, config.sat_dtype) if config.sat_dtype else None
    return stats.fields_for_ops(config.ops, config.sat_threshold, sat_dtype)
