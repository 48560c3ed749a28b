"""The docs site: `mkdocs build --strict` passes, the generated references cover every engine argument and CLI flag,
and the benchmark numbers page is what `pagemill bench report` renders from benchmarks/results/*.json."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagemill.benchmarks.results_page import build_page, load_results
from pagemill.engine.arg_utils import EngineArgs
from pagemill.entrypoints.cli_docs import _subcommands, api_markdown, cli_markdown, engine_args_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings_handlers.python")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for page in ("reference/engine_args", "reference/cli", "reference/api", "benchmarks"):
        assert (tmp_path / "site" / page / "index.html").exists(), page


def test_engine_args_reference_lists_every_field():
    rows = re.findall(r"^\| `(\w+)` \|", engine_args_markdown(), flags=re.M)
    assert rows == EngineArgs.field_names()
    helps = EngineArgs.arg_help()
    missing = [name for name in EngineArgs.field_names() if not helps.get(name, "").strip()]
    assert not missing, f"EngineArgs fields without metadata help (engine/arg_utils.py): {missing}"
    assert not [name for name, text in helps.items() if "%" in text], "argparse %-formats help: no '%' in it"
    page = engine_args_markdown()
    for name, text in helps.items():  # the reference shows each help text, Markdown-escaped
        assert text.replace("|", "\\|") in page, name


def test_cli_help_comes_from_the_one_source():
    from pagemill.entrypoints.cli import build_parser

    serve = dict(_subcommands(build_parser(), "pagemill"))["pagemill serve"]
    helps = {a.dest: a.help for a in serve._actions}
    dataclasses_help = {f.name: f.metadata.get("help") for f in dataclasses.fields(EngineArgs)}
    for name in EngineArgs.field_names():
        if name != "served_model_name":  # `pagemill serve` declares it itself (several names)
            assert helps[name] == dataclasses_help[name], name


def test_cli_reference_lists_every_command_and_flag():
    from pagemill.entrypoints.cli import build_parser

    text = cli_markdown()
    engine_flags = {s for a in EngineArgs.add_cli_args(argparse.ArgumentParser())._actions for s in a.option_strings}
    for command, parser in _subcommands(build_parser(), "pagemill"):
        if command == "pagemill":
            continue
        assert f"## `{command}`" in text, command
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in engine_flags and flag not in ("-h", "--help"):
                    assert f"`{flag}`" in text, (command, flag)


def test_api_reference_covers_the_package_exports():
    import pagemill

    text = api_markdown()
    for name in pagemill.__all__:
        if name != "__version__":
            assert re.search(rf"^(::: [\w.]+\.{name}|- `pagemill\.{name}` is `[\w.]+`\.)$", text, flags=re.M), name


def test_benchmark_page_is_rendered_from_the_results():
    page = ROOT / "docs" / "benchmarks" / "index.md"
    expected = build_page(str(ROOT / "benchmarks" / "results"), str(page.parent))
    assert page.read_text(encoding="utf-8") == expected, "run `pagemill bench report` and commit docs/benchmarks/index.md"


def test_results_are_consistent():
    results = load_results(str(ROOT / "benchmarks" / "results"))
    assert results
    for r in results:
        assert (ROOT / r["source"]).exists(), r["_file"]
        assert re.fullmatch(r"[0-9a-f]{7,40}", r["commit"]) and re.fullmatch(r"\d{4}-\d{2}-\d{2}", r["date"])
        pm, base = r["pagemill"], r["baseline"]["value"]
        ratio = pm / base if r["higher_is_better"] else base / pm
        assert abs(ratio - r["ratio"]) <= 0.02 * r["ratio"] + 0.01, (r["_file"], ratio, r["ratio"])


def test_bench_report_command(tmp_path):
    from pagemill.benchmarks.results_page import run_report

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "2026-01-01-a-study.md").write_text("# A study\n")
    out = docs / "index.md"
    args = argparse.Namespace(results_dir=str(ROOT / "benchmarks" / "results"), output=str(out), check=False)
    run_report(args)
    assert "[A study](2026-01-01-a-study.md)" in out.read_text()
    run_report(argparse.Namespace(**{**vars(args), "check": True}))
    out.write_text("stale\n")
    with pytest.raises(SystemExit):
        run_report(argparse.Namespace(**{**vars(args), "check": True}))


def test_readme_fits_on_a_screen():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, len(lines)
    for target in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)", "\n".join(lines)):
        assert (ROOT / target).exists(), target


def test_readme_numbers_come_from_the_results():
    """Every ratio in the README's Numbers table is a ratio of a saved headline run."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("## Numbers", 1)[1].split("\n## ", 1)[0]
    quoted = re.findall(r"(\d+\.\d\d)x", table)
    assert quoted
    saved = {f"{r['ratio']:.2f}" for r in load_results(str(ROOT / "benchmarks" / "results"))}
    assert set(quoted) <= saved, sorted(set(quoted) - saved)


def test_engine_arg_help_refuses_percent_and_empty():
    """argparse %-formats help text, so the one source refuses a '%' (and an empty help) when the class is built."""
    from pagemill.engine.arg_utils import _arg

    with pytest.raises(ValueError, match="%"):
        _arg(0.9, "90% of memory")
    with pytest.raises(ValueError, match="non-empty"):
        _arg(1, " ")
    assert _arg(1, "One.").metadata == {"help": "One."}
