"""The daemon's settings have one shape: every key of the config's `watch` section reaches the spawned daemon as
the flag of its name, and every flag the daemon's options need is one `trainmon watch` parses."""
from dataclasses import fields
from pathlib import Path

from trainmon.cli import build_parser
from trainmon.commands.watch import watch_options
from trainmon.config.settings import WatchConfig
from trainmon.watch.spawn import watch_flags

# A value other than the default for every key of the section, as a user would write it in the config
CHOSEN = {"enable": True, "interval": 0.25, "logdir": "/tmp/view", "stall_after": 42.0, "heatmap_every": 7,
          "ranks": [1, 3], "detail": [r"layers\.3\."], "on_anomaly": "cat > /dev/null"}


def test_every_watch_key_is_chosen_here():
    assert {key.name for key in fields(WatchConfig)} == set(CHOSEN)


def test_every_watch_key_reaches_the_daemon_as_its_flag():
    config = WatchConfig(**CHOSEN)
    args = build_parser().parse_args(["watch", "RUN", "--logdir", config.logdir, *watch_flags(config)])
    options = watch_options(args)
    assert options.logdir == Path(CHOSEN["logdir"])
    assert options.ranks == frozenset(CHOSEN["ranks"]) and options.detail == tuple(CHOSEN["detail"])
    for key in ("interval", "stall_after", "heatmap_every", "on_anomaly"):
        assert getattr(options, key) == CHOSEN[key], key


def test_the_defaults_give_no_flag_the_daemon_lacks():
    args = build_parser().parse_args(["watch", "RUN", *watch_flags(WatchConfig())])
    options = watch_options(args)
    assert options.ranks == frozenset() and options.detail == () and options.on_anomaly is None
