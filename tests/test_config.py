"""Contracts of trainmon.config.settings: msprobe configs load, defaults are msprobe's, errors say how to fix."""
import copy
import dataclasses
import json
import pickle
import warnings
from pathlib import Path

import pytest

from trainmon.core import sinks
from trainmon.config import keys as config_keys
from trainmon.config.settings import (
    NOT_HONOURED, AlertConfig, CCConfig, ConfigError, ConfigNotHonouredWarning, MonitorConfig,
    RuleConfig, TargetSpec, load_config, parse_target_spec,
)

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"
ignore_not_honoured = pytest.mark.filterwarnings("ignore::trainmon.config.keys.ConfigNotHonouredWarning")

# Configs msprobe users already have (shared/msprobe-format.md), copied so a clone needs nothing else.
MSPROBE_EXAMPLES = [
    {"targets": {}, "wg_distribution": True, "format": "csv", "ops": ["norm", "min", "max", "nans"]},
    {"targets": {"module.language_model.encoder.layers.0.mlp": {}}, "xy_distribution": True,
     "forward_only": False, "backward_only": False, "all_xy": False, "format": "csv",
     "ops": ["norm", "min", "max", "mean", "nans", "zeros"], "eps": 1e-8, "ndigits": 12},
    {"targets": {}, "mv_distribution": True, "param_distribution": True, "format": "csv",
     "ops": ["norm"], "step_count_per_record": 5},
    {"targets": {"": {}}, "param_distribution": True, "xy_distribution": True, "mv_distribution": True,
     "wg_distribution": True, "all_xy": True, "format": "csv", "ops": ["norm", "nans"], "step_count_per_record": 3},
    {"targets": {"language_model.encoder.layers.0": {"input": "tuple[2]:0", "output": "tensor",
                                                     "input_grad": "tuple[2]:0", "output_grad": "tuple[1]:0"}},
     "dynamic_on": False, "start_step": 0, "collect_times": 100000000, "step_interval": 1,
     "print_struct": False, "module_ranks": [0, 1, 2, 3], "ur_distribution": True, "xy_distribution": True,
     "all_xy": True, "forward_only": False, "backward_only": False, "mv_distribution": True,
     "param_distribution": True, "wg_distribution": True, "monitor_mbs_grad": True,
     "cc_distribution": {"enable": True, "cc_codeline": []},
     "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": False},
     "format": "csv", "ops": ["min", "max", "norm", "zeros", "nans", "mean"], "eps": 1e-8, "ndigits": 12,
     "step_count_per_record": 1, "append_output": [], "squash_name": True},
]
MSPROBE_FULL = MSPROBE_EXAMPLES[-1]

# msprobe 26.x defaults: python/msprobe/pytorch/monitor/module_hook.py TrainerMon.set_config and
# python/msprobe/core/monitor/utils.py validate_config (empty ops -> ["norm"]; format "csv").
MSPROBE_DEFAULTS = {
    "targets": {}, "all_xy": False, "xy_distribution": False, "forward_only": False, "backward_only": False,
    "wg_distribution": False, "monitor_mbs_grad": False, "mv_distribution": False, "param_distribution": False,
    "mg_direction": False, "ur_distribution": False, "ops": ["norm"], "eps": 1e-8, "ndigits": 6,
    "start_step": 0, "collect_times": 100000000, "step_interval": 1, "step_count_per_record": 1,
    "module_ranks": [], "print_struct": False, "stack_info": False, "format": ["csv"], "squash_name": False,
    "append_output": [], "dynamic_on": False,
}


def not_honoured_warnings(cfg):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = load_config(cfg)
    return result, [str(w.message) for w in caught if issubclass(w.category, ConfigNotHonouredWarning)]


def error_of(cfg) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigNotHonouredWarning)
        with pytest.raises(ConfigError) as info:
            load_config(cfg)
    return str(info.value)


# ---- msprobe compatibility ---------------------------------------------------------------------------

@ignore_not_honoured
@pytest.mark.parametrize("raw", MSPROBE_EXAMPLES, ids=lambda raw: ",".join(sorted(raw))[:40])
def test_msprobe_examples_load(raw):
    before = copy.deepcopy(raw)
    cfg = load_config(raw)
    assert raw == before, "load_config must not modify the caller's dict"
    assert cfg.format == ["csv"]
    assert set(cfg.ops) == set(raw["ops"])
    for key in ("xy_distribution", "wg_distribution", "mv_distribution", "param_distribution", "eps", "ndigits",
                "step_count_per_record", "module_ranks", "squash_name", "monitor_mbs_grad"):
        if key in raw:
            assert getattr(cfg, key) == raw[key], key


@ignore_not_honoured
def test_msprobe_full_example_values():
    cfg = load_config(MSPROBE_FULL)
    assert cfg.targets == {"language_model.encoder.layers.0": {
        "input": "tuple[2]:0", "output": "tensor", "input_grad": "tuple[2]:0", "output_grad": "tuple[1]:0"}}
    assert cfg.alert == AlertConfig(rules=[RuleConfig(rule_name="AnomalyTurbulence", args={"threshold": 0.5})])
    assert cfg.cc_distribution == CCConfig(enable=True)
    assert cfg.module_ranks == [0, 1, 2, 3] and cfg.collect_times == 100000000


def test_defaults_equal_msprobe():
    cfg = load_config({})
    for key, value in MSPROBE_DEFAULTS.items():
        assert getattr(cfg, key) == value, key
    # deliberate difference: collectives' inputs are recorded by default (msprobe: cc_pre_hook false)
    assert cfg.cc_distribution == CCConfig(enable=False, cc_codeline=[], cc_pre_hook=True, cc_log_only=False)
    assert cfg.alert.rules == [] and cfg.alert.dump is False and cfg.alert.action == "warn"
    assert (cfg.sentinel, cfg.strict) == (False, False)
    assert MonitorConfig() == cfg


def test_every_config_key_of_msprobe_is_accepted():
    msprobe_keys = set(MSPROBE_DEFAULTS) | {"cc_distribution", "alert", "recording_l2_features", "l2_targets",
                                            "sa_order", "mg_distribution"}
    fields = {f.name for f in dataclasses.fields(MonitorConfig)}
    assert msprobe_keys - fields <= {k for k in config_keys.ACCEPTED_ONLY}


def test_empty_targets_with_xy_means_all_modules_as_in_msprobe():
    assert load_config({"targets": {}, "xy_distribution": True}).all_xy is True
    assert load_config({"targets": {"layer": {}}, "xy_distribution": True}).all_xy is False


def test_ops_forms():
    assert load_config({"ops": "norm"}).ops == ["norm"]
    # msprobe monitors norm when no valid op is listed; here a list without a statistic is an error that
    # says what to write
    for empty in ([], ["shape", "dtype"]):
        with pytest.raises(ConfigError, match=r'key \'ops\'.*lists no statistic.*"ops": \["norm"\]'):
            load_config({"ops": empty})
    assert load_config({"ops": ["max", "shape", "dtype", "max", "infs"]}).ops == ["max", "infs"]


def test_integral_floats_are_ints_and_eps_may_be_int():
    cfg = load_config({"collect_times": 1e8, "eps": 0})
    assert cfg.collect_times == 100000000 and isinstance(cfg.collect_times, int)
    assert cfg.eps == 0.0


@ignore_not_honoured
def test_asdict_round_trip():
    for raw in MSPROBE_EXAMPLES:
        cfg = load_config(raw)
        assert load_config(dataclasses.asdict(cfg)) == cfg


def test_direct_construction_is_validated():
    assert MonitorConfig(format="api").format == ["api"]
    assert MonitorConfig(alert={"rules": [{"rule_name": "AnomalyNan"}]}).alert.rules[0].args == {}
    with pytest.raises(ConfigError, match="'eps'"):
        MonitorConfig(eps="x")
    assert load_config(cfg := MonitorConfig()) is cfg


# ---- format ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, expected", [("csv", ["csv"]), (["csv"], ["csv"]), (["csv", "api"], ["csv", "api"]),
                                             (["api", "csv", "api"], ["api", "csv"])])
def test_format_string_or_list(value, expected):
    assert load_config({"format": value}).format == expected


def test_the_formats_are_the_sink_tables():
    assert sinks.formats() == ("csv", "api", "tensorboard", "db")
    assert load_config({"format": ["db", "tensorboard", "csv"]}).format == ["db", "tensorboard", "csv"]


def test_a_registered_sink_is_a_format(monkeypatch):
    msg = error_of({"format": ["csv", "jsonl"]})
    assert "'format[1]'" in msg and "register_sink" in msg and '"csv", "api", "tensorboard", "db"' in msg
    sinks.register_sink("jsonl", object)
    try:
        assert load_config({"format": ["csv", "jsonl"]}).format == ["csv", "jsonl"]
    finally:
        sinks.unregister_sink("jsonl")
    with pytest.raises(ValueError, match="built-in"):
        sinks.register_sink("csv", object)


# ---- writer ------------------------------------------------------------------------------------------

def test_writer_defaults_and_values():
    cfg = load_config({})
    assert (cfg.writer_policy, cfg.writer_queue_size) == ("block", 64)
    cfg = load_config({"writer_policy": "drop", "writer_queue_size": 2})
    assert (cfg.writer_policy, cfg.writer_queue_size) == ("drop", 2)


@pytest.mark.parametrize("raw, parts", [
    ({"writer_policy": "dorp"}, ["'writer_policy' = \"dorp\"", '"block", "drop"', 'did you mean "drop"']),
    ({"writer_queue_size": 0}, ["'writer_queue_size' = 0", "did you mean 1"]),
    ({"writer_queue_size": "8"}, ["'writer_queue_size' = \"8\"", "integer"]),
    ({"writer_polcy": "drop"}, ["'writer_polcy'", 'did you mean "writer_policy"']),
])
def test_writer_key_errors(raw, parts):
    msg = error_of(raw)
    for part in parts:
        assert part in msg, msg


# ---- errors: each names the dotted key, the value, what is allowed, and the fix ---------------------------

@pytest.mark.parametrize("raw, parts", [
    ({"xy_distrbution": True}, ["'xy_distrbution'", "not a known key", '"wg_distribution"',
                                'did you mean "xy_distribution"']),
    ({"eps": "x"}, ["'eps' = \"x\"", "finite number >= 0", "did you mean 1e-08"]),
    ({"eps": "1e-6"}, ["'eps'", "did you mean 1e-06"]),
    ({"eps": -1}, ["'eps' = -1", "finite number >= 0"]),
    ({"step_interval": 0}, ["'step_interval' = 0", "an integer >= 1", "did you mean 1"]),
    ({"start_step": 1.5}, ["'start_step' = 1.5", "integer"]),
    ({"collect_times": True}, ["'collect_times' = true", "must be an integer"]),
    ({"ndigits": 21}, ["'ndigits' = 21", "from 1 to 20", "did you mean 20"]),
    ({"step_count_per_record": 0}, ["'step_count_per_record' = 0", "did you mean 1"]),
    ({"wg_distribution": "true"}, ["'wg_distribution' = \"true\"", "true, false", "did you mean true"]),
    ({"print_struct": 0}, ["'print_struct' = 0", "JSON boolean", "did you mean false"]),
    ({"ops": ["norma"]}, ["'ops[0]' = \"norma\"", '"min", "max", "norm"', 'did you mean "norm"']),
    ({"ops": "Norm"}, ["'ops' = \"Norm\"", 'did you mean "norm"']),
    ({"ops": {"norm": 1}}, ["'ops'", "list of op names"]),
    ({"format": "parquet"}, ["'format' = \"parquet\"", '"csv", "api"', 'did you mean "csv"']),
    ({"format": []}, ["'format' = []", 'did you mean ["csv"]']),
    ({"module_ranks": [0, "1"]}, ["'module_ranks[1]' = \"1\"", "did you mean 1"]),
    ({"module_ranks": 3}, ["'module_ranks' = 3", "did you mean [3]"]),
    ({"module_ranks": "0"}, ["'module_ranks' = \"0\"", "did you mean [0]?"]),  # a valid list, not ["0"]
    ({"watch": True}, ["'watch' = true", 'did you mean {"enable": true}?']),  # JSON, not a Python repr
    ({"alert": True}, ["'alert' = true", "did you mean {}?"]),
    ({"append_output": ["Dec03_21-34-40"]}, ["'append_output'", "exactly 2 timestamps"]),
    ({"targets": []}, ["'targets' = []", "JSON object", "did you mean {}"]),
    ({"targets": {"layers.0": {"inptu": "tensor"}}}, ["'targets[\"layers.0\"].inptu'", '"input_grad"',
                                                      'did you mean "input"']),
    ({"targets": {"layers.0": {"input": "tuple[2]:2"}}}, ["'targets[\"layers.0\"].input' = \"tuple[2]:2\"",
                                                          "0 <= I < N", 'did you mean "tuple[2]:1"']),
    ({"targets": {"layers.0": "tensor"}}, ["'targets[\"layers.0\"]' = \"tensor\"", "JSON object"]),
    ({"cc_distribution": {"enabled": True}}, ["'cc_distribution.enabled'", 'did you mean "enable"']),
    ({"cc_distribution": {"cc_codeline": "train.py"}}, ["'cc_distribution.cc_codeline'", 'did you mean ["train.py"]']),
    ({"alert": {"rulez": []}}, ["'alert.rulez'", '"rules", "dump", "action"', 'did you mean "rules"']),
    ({"alert": {"rules": [{"rule_name": "AnomalyNann"}]}},
     ["'alert.rules[0].rule_name' = \"AnomalyNann\"", '"AnomalyTurbulence", "AnomalyNan", "AnomalySpike"',
      'did you mean "AnomalyNan"']),
    ({"alert": {"rules": [{"rule_name": "AnomalyNan"}, {"args": {}}]}},
     ["'alert.rules[1].rule_name'", "is required", '"AnomalySpike"']),
    ({"alert": {"rules": [{"rule_name": "AnomalyTurbulence"}]}},
     ["'alert.rules[0].args'", "needs a threshold", 'did you mean {"threshold": 0.5}']),
    ({"alert": {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": -1}}]}},
     ["'alert.rules[0].args.threshold' = -1", ">= 0"]),
    ({"alert": {"rules": [{"rule_name": "AnomalySpike", "args": {"threshold": 3, "window": 0}}]}},
     ["'alert.rules[0].args.window' = 0", "did you mean 1"]),
    ({"alert": {"dump": "yes"}}, ["'alert.dump' = \"yes\"", "did you mean true"]),
    ({"alert": {"action": "halt"}}, ["'alert.action' = \"halt\"", '"warn", "skip_step", "stop"', "did you mean"]),
    ({"alert": []}, ["'alert' = []", "JSON object"]),
    ({"forward_only": True, "backward_only": True}, ["'backward_only'", "forward_only and backward_only",
                                                     "did you mean false"]),
    ({"sa_order": "b s h d"}, ["'sa_order'", '"s,b,h,d", "b,s,h,d"']),
    ({"params_have_main_grad": True}, ["'params_have_main_grad'", "no longer a key", "adapter", "delete the key"]),
])
def test_error_names_key_value_allowed_and_fix(raw, parts):
    msg = error_of(raw)
    for part in parts:
        assert part in msg, f"{part!r} not in {msg!r}"


def test_config_error_is_value_error_and_picklable():
    err = ConfigError("is out of range", key="a.b", value=3, allowed="x", closest=1)
    assert isinstance(err, ValueError)
    assert str(pickle.loads(pickle.dumps(err))) == str(err)


def test_top_level_must_be_an_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    msg = error_of(path)
    assert str(path) in msg and "JSON object" in msg
    assert "path to a JSON file or a dict" in error_of(42)


# ---- files -------------------------------------------------------------------------------------------

def test_missing_file_names_path(tmp_path):
    path = tmp_path / "nope" / "monitor_config.json"
    msg = error_of(str(path))
    assert "not found" in msg and str(path) in msg


def test_directory_is_not_a_config(tmp_path):
    assert "directory" in error_of(tmp_path)


def test_json_syntax_error_names_file_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "ops": ["norm"]\n  "eps": 1e-8\n}\n')
    msg = error_of(path)
    assert str(path) in msg and "line 3, column 3" in msg


def test_json_comment_gets_a_hint(tmp_path):
    path = tmp_path / "commented.json"
    path.write_text('{\n  "ops": ["norm"], // statistics\n  "eps": 1e-8\n}\n')
    msg = error_of(path)
    assert "line 2" in msg and "comments" in msg


def test_duplicate_key_is_an_error(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"ops": ["norm"], "ops": ["max"]}')
    msg = error_of(path)
    assert str(path) in msg and "'ops'" in msg and "twice" in msg


def test_value_error_from_file_names_file_and_key(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"alert": {"rules": [{"rule_name": "Nan"}]}}))
    msg = error_of(path)
    assert msg.startswith(f"{path}: config key 'alert.rules[0].rule_name'")


@ignore_not_honoured
@pytest.mark.parametrize("path", sorted(CONFIGS_DIR.glob("*.json")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    assert isinstance(load_config(path), MonitorConfig)


def test_shipped_configs_exist_and_demo_is_as_documented():
    assert {"demo.json", "full.json", "msprobe_example.json"} <= {p.name for p in CONFIGS_DIR.glob("*.json")}
    cfg, warned = not_honoured_warnings(CONFIGS_DIR / "demo.json")
    assert warned == []
    assert cfg.ops == ["min", "max", "norm", "mean", "zeros", "nans", "infs"] and cfg.format == ["db"]
    assert cfg.sentinel and [r.rule_name for r in cfg.alert.rules] == ["AnomalyNan", "AnomalySpike",
                                                                       "AnomalyPrecursor"]
    assert cfg.watch.enable and cfg.watch.interval == 1
    assert cfg.targets == {} and cfg.all_xy and cfg.xy_distribution and cfg.wg_distribution
    assert cfg.param_distribution and cfg.mv_distribution and cfg.step_interval == 1
    assert json.loads((CONFIGS_DIR / "msprobe_example.json").read_text()) == MSPROBE_FULL


# ---- accepted but not honoured: exactly one warning per key ------------------------------------------

def test_full_msprobe_example_warns_once_per_unhonoured_key():
    _, warned = not_honoured_warnings(MSPROBE_FULL)
    # the example turns on ur_distribution and cc_distribution; only keys still on the list warn
    expected = [key for key in ("ur_distribution", "cc_distribution.enable") if key in NOT_HONOURED]
    assert len(warned) == len(expected)
    for key in expected:
        assert sum(f"'{key}'" in w for w in warned) == 1
    assert all("accepted" in w and "not honoured" in w for w in warned)


@pytest.mark.parametrize("raw, key", [
    ({"mg_distribution": True}, "'mg_distribution'"),
    ({"alert": {"inform": {"recipient": "database"}}}, "'alert.inform'"),
    ({"ops": ["id", "norm", "id"]}, "op 'id'"),
])
def test_each_unhonoured_key_warns_exactly_once(raw, key):
    cfg, warned = not_honoured_warnings(raw)
    assert len(warned) == 1 and key in warned[0], warned
    assert "id" not in cfg.ops


def test_unhonoured_keys_at_their_inert_values_do_not_warn():
    raw = {"mg_distribution": False, "recording_l2_features": False, "l2_targets": {}, "sa_order": "s,b,h,d",
           "ur_distribution": False, "cc_distribution": {"enable": False}}
    assert not_honoured_warnings(raw)[1] == []


def test_the_l2_feature_keys_are_honoured_and_checked():
    cfg, warned = not_honoured_warnings({"recording_l2_features": True, "sa_order": "b, s, h, d",
                                         "l2_targets": {"moe_router_logit_hook": ["0:layers.0.router"]}})
    assert warned == [] and cfg.sa_order == "b,s,h,d"
    assert cfg.l2_targets == {"moe_router_logit_hook": ["0:layers.0.router"]}
    with pytest.raises(ConfigError, match=r"l2_targets\.atention_hook.*did you mean \"attention_hook\""):
        load_config({"l2_targets": {"atention_hook": []}})
    with pytest.warns(UserWarning, match="no effect without"):
        load_config({"l2_targets": {"linear_hook": []}})
    with pytest.warns(UserWarning, match="add \"max\" to 'ops'"):
        load_config({"moe_load": True, "ops": ["norm"]})


def test_not_honoured_list_is_one_constant():
    assert set(NOT_HONOURED) >= {"mg_distribution", "ops:id"}
    assert set(config_keys.ACCEPTED_ONLY) <= set(NOT_HONOURED)


def test_removing_an_entry_stops_its_warning(monkeypatch):
    monkeypatch.delitem(config_keys.NOT_HONOURED, "mg_distribution")
    _, warned = not_honoured_warnings({"mg_distribution": True})
    assert warned == []


# ---- parse_target_spec -------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, expected", [
    ("tensor", TargetSpec(None, None)), (" tensor ", TargetSpec(None, None)),
    ("tuple[2]:0", TargetSpec(2, 0)), ("tuple[2]:1", TargetSpec(2, 1)), ("tuple[1]:0", TargetSpec(1, 0)),
    ("tuple[3]", TargetSpec(3, 0)), ("list[2]:1", TargetSpec(2, 1)),
])
def test_parse_target_spec(spec, expected):
    assert parse_target_spec(spec) == expected
    assert parse_target_spec(spec).length == expected.length


@pytest.mark.parametrize("spec, fix", [
    ("", "tensor"), ("tensr", "tensor"), ("Tensor", "tensor"), ("tensor[0]", None), ("tuple[2]:2", "tuple[2]:1"),
    ("tuple[0]", "tuple[1]:0"), ("tuple[2]:-1", None), ("Tuple[2] : 0", "tuple[2]:0"), ("tuple(2):0", "tuple[2]:0"),
    (5, "tensor"), (None, "tensor"), ("tuple[2]:0:1", None),
])
def test_parse_target_spec_rejects_garbage(spec, fix):
    with pytest.raises(ConfigError) as info:
        parse_target_spec(spec, key="targets[\"m\"].input")
    msg = str(info.value)
    assert "targets[\"m\"].input" in msg and "tuple[N]:I" in msg
    if fix is not None:
        assert f'did you mean "{fix}"' in msg


def test_watch_section_is_validated_with_its_dotted_key():
    assert load_config({"watch": {"enable": True}}).watch.logdir == ""
    with pytest.raises(ConfigError, match="'watch.intervall'") as info:
        load_config({"watch": {"intervall": 2}})
    assert "interval" in str(info.value)
    with pytest.raises(ConfigError, match="'watch.stall_after'"):
        load_config({"watch": {"stall_after": -1}})
    assert load_config({"watch": {"detail": [r"layers\.3\."]}}).watch.detail == [r"layers\.3\."]
    with pytest.raises(ConfigError, match=r"'watch.detail\[0\]'.*not a regular expression"):
        load_config({"watch": {"detail": ["(("]}})


@pytest.mark.parametrize("section", ["alert", "watch", "config_check", "cc_distribution", "dump"])
def test_a_section_given_a_bool_is_answered_with_json_that_loads(section):
    message = error_of({section: True})
    suggestion = json.loads(message.rsplit("did you mean ", 1)[1].removesuffix("?"))
    load_config({section: suggestion})


def test_collect_times_0_warns_that_nothing_will_be_collected():
    with pytest.warns(UserWarning, match="'collect_times' = 0: no step will be collected") as caught:
        load_config({"collect_times": 0})
    assert len(caught) == 1
