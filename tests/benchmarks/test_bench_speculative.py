"""`bench speculative`: flags, per-method configs, request waves, the table, and one tiny real run."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from pagemill.benchmarks.cli import build_parser
from pagemill.benchmarks.report import format_table
from pagemill.benchmarks.server_metrics import parse_spec_counters
from pagemill.benchmarks.spec_report import spec_rows
from pagemill.benchmarks.speculative import cell_prompts, format_cells, method_config, run_speculative
from pagemill.metrics.prometheus import PrometheusStatLogger
from pagemill.metrics.spec_decode import spec_summary
from pagemill.metrics.stats import IterationStats, SchedulerStats, SpecDecodingStats


def _parse(*argv: str):
    return build_parser().parse_args(["bench", "speculative", *argv])


def test_flags_and_defaults():
    args = _parse()
    assert (args.methods, args.workloads, args.batch_sizes) == (["ngram", "suffix"], ["edit", "sharegpt", "code"],
                                                                [1, 8, 32])
    assert (args.model, args.num_speculative_tokens, args.num_prompts, args.output_len) == (None, None, 8, 128)
    args = _parse("--methods", "suffix,draft_model", "--batch-sizes", "1,4", "--workloads", "code",
                  "--num-speculative-tokens", "6", "--draft-num-layers", "2")
    assert (args.methods, args.batch_sizes, args.workloads) == (["suffix", "draft_model"], [1, 4], ["code"])
    for bad in (["--methods", "medusa"], ["--batch-sizes", "0,8"], ["--workloads", "poetry"]):
        with pytest.raises(SystemExit):
            _parse(*bad)


def test_method_config_merges_extra_keys_and_flags():
    args = _parse("--num-speculative-tokens", "6", "--draft-num-layers", "2", "--speculative-config",
                  '{"method": "suffix", "prompt_lookup_max": 3}')
    assert method_config(args, "ngram") == {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 3}
    assert method_config(args, "draft_model") == {"method": "draft_model", "num_speculative_tokens": 6,
                                                  "prompt_lookup_max": 3, "draft_num_layers": 2}
    assert method_config(_parse(), "suffix") == {"method": "suffix"}  # k: the method's default


def test_cell_prompts_are_full_waves():
    prompts = [[1], [2], [3]]
    assert cell_prompts(prompts, 3, 1) == [[1], [2], [3]]
    assert cell_prompts(prompts, 3, 2) == [[1], [2]]  # one full wave of 2
    assert cell_prompts(prompts, 3, 4) == [[1], [2], [3], [1]]  # fewer prompts than the batch: they repeat


def test_table_lines():
    cell = {"workload": "edit", "batch_size": 8, "method": "ngram", "base": {"decode_tokens_per_s": 50.0},
            "spec": {"decode_tokens_per_s": 110.0}, "decode_ratio": 2.2, "identical": True,
            "spec_decoding": {"mean_acceptance_length": 3.25, "draft_acceptance_rate": 0.5625,
                              "per_position_acceptance_rate": [0.9, 0.7, 0.4, 0.25]}}
    header, _, line = format_cells([cell]).splitlines()
    assert header.split()[:5] == ["workload", "batch", "method", "base", "tok/s"]
    assert line.split() == ["edit", "8", "ngram", "50.0", "110.0", "2.20x", "3.25", "56.2%", "True",
                            "0.90,", "0.70,", "0.40,", "0.25"]


def test_tiny_run_reports_identical_greedy_outputs(capsys, tmp_path):
    """Real engines, default model: one prompt per workload, a few tokens, batch 1 and 2 (ngram)."""
    out = tmp_path / "spec.json"
    args = _parse("--methods", "ngram", "--batch-sizes", "1,2", "--num-prompts", "1", "--output-len", "12",
                  "--workloads", "edit,code", "--code-prompt-len", "128", "--kv-cache-memory", "128MiB",
                  "--max-model-len", "1024", "--engine-arg", "num_threads=1", "--save-result", str(out))
    payload = run_speculative(args)
    assert [(c["workload"], c["batch_size"], c["method"]) for c in payload["cells"]] == \
        [("edit", 1, "ngram"), ("edit", 2, "ngram"), ("code", 1, "ngram"), ("code", 2, "ngram")]
    assert payload["all_identical"] is True
    assert sum(c["spec_decoding"]["num_drafts"] for c in payload["cells"]) > 0  # the engine did speculate
    for cell in payload["cells"]:
        assert cell["identical_requests"] == cell["num_requests"] == cell["batch_size"]
        assert cell["base"]["decode_tokens_per_s"] > 0 and cell["spec"]["decode_tokens_per_s"] > 0
        assert cell["speculative_config"] == {"method": "ngram"}
    printed = capsys.readouterr().out
    assert "greedy outputs identical with and without speculation: True (4/4 cells)" in printed
    assert out.exists()


def test_tiny_sampled_run_times_both_engines_without_comparing_outputs(capsys):
    """--temperature: seeded sampled requests (lower acceptance, the back-off's case); outputs are not compared."""
    args = _parse("--methods", "ngram", "--batch-sizes", "2", "--num-prompts", "2", "--output-len", "12",
                  "--workloads", "edit", "--kv-cache-memory", "128MiB", "--max-model-len", "1024",
                  "--engine-arg", "num_threads=1", "--temperature", "1.0")
    assert args.temperature == 1.0 and _parse().temperature == 0.0
    payload = run_speculative(args)
    (cell,) = payload["cells"]
    assert payload["all_identical"] is None and cell["identical"] is None
    assert cell["base"]["decode_tokens_per_s"] > 0 and cell["spec"]["decode_tokens_per_s"] > 0
    assert "sampled at temperature 1.0" in capsys.readouterr().out


def test_bench_tables_report_acceptance():
    summary = spec_summary(SpecDecodingStats(num_spec_tokens=2, num_drafts=10, num_draft_tokens=20,
                                             num_accepted_tokens=15, num_accepted_tokens_per_pos=[9, 6]))
    assert summary["mean_acceptance_length"] == 2.5 and summary["draft_acceptance_rate"] == 0.75
    assert summary["per_position_acceptance_rate"] == [0.9, 0.6]
    table = format_table("Throughput: pagemill", spec_rows({"spec_decoding": summary}))
    assert "Mean acceptance length:" in table and "2.50" in table
    assert "Draft acceptance rate (%):" in table and "75.00" in table and "0.90, 0.60" in table
    assert spec_rows({}) == [] and spec_rows({"spec_decoding": None}) == []


def test_bench_serve_reads_a_servers_spec_counters():
    p = PrometheusStatLogger(CollectorRegistry(), "m")
    assert parse_spec_counters(p.render().decode()) is None  # a server that does not speculate
    spec = SpecDecodingStats(num_spec_tokens=3, num_drafts=10, num_draft_tokens=30, num_accepted_tokens=12,
                             num_accepted_tokens_per_pos=[7, 4, 1])
    p.record(SchedulerStats(spec_decoding=spec), IterationStats(), 1.0)
    assert parse_spec_counters(p.render().decode()) == spec
