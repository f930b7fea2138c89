"""docs/reference/ is what the code gives (docs/generate_reference.py writes it), and the design page holds every
section the code's "design §N" comments cite."""
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _generator():
    spec = importlib.util.spec_from_file_location("generate_reference", DOCS / "generate_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate_reference = _generator()


def test_every_reference_page_is_what_the_code_gives():
    stale = generate_reference.stale()
    assert not stale, f"docs/reference/{', '.join(stale)} differ from the code: run python docs/generate_reference.py"


def test_the_check_names_a_page_that_drifted(tmp_path):
    for path, text in generate_reference.pages().items():
        (tmp_path / path.name).write_text(text)
    assert generate_reference.stale(tmp_path) == []
    config = tmp_path / "config.md"
    config.write_text(config.read_text().replace("| `eps` | `float` | `1e-08` |", "| `eps` | `float` | `1e-06` |"))
    (tmp_path / "cli.md").unlink()
    assert generate_reference.stale(tmp_path) == ["config.md", "cli.md"]


def test_the_config_page_holds_every_key_with_its_default():
    import dataclasses
    import json

    from trainmon.config.settings import MonitorConfig
    page = generate_reference.config_page()
    defaults = MonitorConfig()
    for f in dataclasses.fields(MonitorConfig):
        value = getattr(defaults, f.name)
        shown = "see below" if dataclasses.is_dataclass(value) else f"`{json.dumps(value)}`"
        assert f"| `{f.name}` | `{f.type}` | {shown} |" in page, f.name
    for key in ("cc_distribution.cc_pre_hook", "alert.action", "alert.rules[].rule_name", "watch.stall_after",
                "config_check.batches", "dump.max_mb_per_step"):
        assert f"| `{key}` |" in page, key


def test_the_cli_page_holds_every_command_and_option():
    from trainmon.cli import build_parser
    page = generate_reference.cli_page()
    commands = list(generate_reference._subcommands(build_parser(), "trainmon"))
    assert len(commands) > 10
    for name, parser, _ in commands:
        assert f"\n## {name}\n" in page, name
        for action in parser._actions:
            for flag in action.option_strings:
                assert flag in ("-h", "--help") or f"`{flag}" in page, (name, flag)


def test_the_database_page_holds_every_table_and_index_of_a_new_database(tmp_path):
    from trainmon.writers import db_schema
    page = generate_reference.database_page()
    conn = db_schema.connect(str(tmp_path / "monitor.db"))
    conn.executescript(db_schema.ANOMALY_SCHEMA)
    names = [name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'")]
    conn.close()
    assert {"records", "tags", "anomalies", "record_blocks", "first_nonfinite"} <= set(names)
    for name in names:
        assert re.search(rf"CREATE (TABLE|INDEX) IF NOT EXISTS {name}\b", page), name


def test_the_layout_and_exit_status_pages_hold_the_codes_names():
    from trainmon.commands.arguments import EXIT_BAD_INPUT, EXIT_CLEAN, EXIT_FOUND
    from trainmon.core import layout
    page = generate_reference.layout_page()
    for name in ("RUN_JSON", "DB_NAME", "STREAM_NAME", "ANOMALIES_FILE"):
        assert f"| `{name}` | `{getattr(layout, name)}` |" in page
    codes = generate_reference.exit_codes_page()
    for status in (EXIT_CLEAN, EXIT_FOUND, EXIT_BAD_INPUT, 3, 141):
        assert f"| `{status}` |" in codes


def test_every_design_section_the_code_cites_is_a_section_of_the_design_page():
    cited = {match for path in (ROOT / "trainmon").rglob("*.py")
             for match in re.findall(r"design §(\w+)", path.read_text())}
    sections = set(re.findall(r"^## (\w+)\. ", (DOCS / "design.md").read_text(), re.M))
    assert cited and cited <= sections, f"cited but missing from docs/design.md: {sorted(cited - sections)}"


def test_every_docs_page_the_code_names_exists():
    named = {match for path in (ROOT / "trainmon").rglob("*.py")
             for match in re.findall(r"docs/[\w/.-]+\.md", path.read_text())}
    assert "docs/guides/anomalies.md" in named
    assert [page for page in sorted(named) if not (ROOT / page).is_file()] == []
