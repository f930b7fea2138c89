"""The hook table: which groups a config installs, each behind the HookGroup interface, and msprobe's
TrainerMon arguments that trainmon does not use accepted with one warning each, saying why."""
from __future__ import annotations

import warnings

import pytest
import torch

from training import make_model, run_steps
from trainmon import TrainerMon
from trainmon.trainer_mon import UNUSED_MSPROBE_ARGUMENTS, UnusedArgumentWarning
from trainmon.hook_table import GROUPS
from trainmon.hooks.hook_group import HookGroup


def _groups(write_config, steps=1, **config) -> dict:
    """{table name: group} that a config installs on the test model, after `steps` steps."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMon(write_config(**config)).set_monitor(model, optimizer=optimizer)
    run_steps(model, optimizer, steps)
    installed = list(monitor._hooks)
    monitor.stop()
    assert monitor._hooks == []
    names = {type(group).__name__: group for group in installed}
    assert all(isinstance(group, HookGroup) for group in installed)
    return names


def test_the_table_names_each_group_once():
    names = [group.name for group in GROUPS]
    assert len(names) == len(set(names))


def test_the_steps_are_always_defined_and_nothing_else_unasked(output_dir, write_config):
    assert set(_groups(write_config)) == {"OptimizerHooks", "ForwardPasses", "LossScaleWatch", "SavedVariables"}


def test_each_key_adds_its_group(output_dir, write_config):
    groups = _groups(write_config, xy_distribution=True, wg_distribution=True, sentinel=True, stack_info=True,
                     dump={"steps": [0], "modules": ["layers.0"]}, alert={"rules": [{"rule_name": "AnomalyNan"}],
                                                           "action": "skip_step"})
    assert {"NanSentinel", "StepGate", "ActivationHooks", "StackRecorder", "GradHooks", "TensorDump"} <= set(groups)
    assert all(not group.required for name, group in groups.items() if name not in ("OptimizerHooks",
                                                                                      "ForwardPasses"))


def test_a_rank_outside_module_ranks_installs_no_activation_hooks(output_dir, write_config):
    groups = _groups(write_config, xy_distribution=True, module_ranks=[1])
    assert "ActivationHooks" not in groups and "SavedVariables" not in groups


# msprobe's documented calls: TrainerMon(config_file_path, process_group=None, params_have_main_grad=True, opt_ty=None)
MSPROBE_CALLS = [
    ((), {}),
    ((), {"params_have_main_grad": False}),
    ((), {"params_have_main_grad": True}),
    ((None,), {}),
    ((None, True), {}),
    ((), {"process_group": None, "params_have_main_grad": True, "opt_ty": None}),
    ((None, False, "Megatron_DistributedOptimizer"), {}),
]


@pytest.mark.parametrize("args, kwargs", MSPROBE_CALLS)
def test_every_form_of_msprobes_call_trains_a_step_and_warns_once_per_argument_given(output_dir, write_config,
                                                                                      args, kwargs):
    names = ["process_group", "params_have_main_grad", "opt_ty"][:len(args)] + list(kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = TrainerMon(write_config(wg_distribution=True, format=["db"]), *args, **kwargs)
    said = [str(w.message) for w in caught if w.category is UnusedArgumentWarning]
    assert len(said) == len(names)
    for name, text in zip(names, said):
        assert f"TrainerMon({name}=...)" in text and UNUSED_MSPROBE_ARGUMENTS[name] in text
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor.set_monitor(model, optimizer=optimizer)
    run_steps(model, optimizer, 1)
    monitor.stop()
    assert monitor.step == 1
