"""The benchmark tools: the ``bench`` package's shared helpers and reporter, the end-to-end harness
on a tiny model folder, the step-cost script on a random-weight model, and the torch-free C++
benchmarks of the CPU attention loop (bench/cpu_attend_microbench.cpp,
bench/cpu_microkernel_rates.cpp), which build against the current kernel headers. None of them is
part of the extension, so nothing else would notice when a change breaks them. Timings are not
checked (performance lives in bench/, not in tests); results and recorded fields are."""
import argparse
import ast
import importlib.util
import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from bench import common, e2e, report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
needs_gpp = pytest.mark.skipif(shutil.which("g++") is None or platform.machine() != "x86_64",
                               reason="needs g++ on x86_64")



# ------------------------------------------------------------------ the package and its helpers

def _python_files(*folders):
    for folder in folders:
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            if "results" not in dirpath:
                yield from (os.path.join(dirpath, f) for f in files if f.endswith(".py"))


def test_no_sys_path_edits_in_bench_or_tests():
    """bench/ is one package run as ``python -m bench.<script>`` and tests/ gets its folders from
    pytest's ``pythonpath``: no file edits ``sys.path`` (a renamed folder would break silently)."""
    offenders = []
    for path in _python_files("bench", "tests"):
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                    and node.value.id == "sys"):
                offenders.append(os.path.relpath(path, ROOT))
                break
    assert offenders == []


def test_common_statistics_skip_missing_values():
    assert common.median([3, None, 1, "x", 2.5]) == 2.5
    assert common.median([None, "–"]) is None
    assert common.gmean([1, 4, None, 0, -1]) == pytest.approx(2.0)
    assert common.gmean([]) is None
    assert common.fmt(None) == "–" and common.fmt(1.234) == "1.23" and common.fmt(7.0, "{:.0f}") == "7"


def test_git_commit_names_this_checkout():
    sha, dirty = common.git_commit()
    want = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert sha == want and isinstance(dirty, bool)
    short, _ = common.git_commit(short=True)
    assert want.startswith(short) and common.commit_label().split("-")[0] == short
    assert common.git_commit(tree="/") == (None, None) and common.commit_label("/") == "unknown"


def test_kernel_grid_has_no_second_tree():
    """The two-processes-at-once A/B (``--old-tree``, biased 10-20 % on a 2-core VM) is gone;
    ab_trees_cpu is the A/B."""
    from bench import bench_kernels_cpu

    with pytest.raises(SystemExit):
        bench_kernels_cpu.parse_args(["--grid", "--old-tree", "/tmp"])
    assert bench_kernels_cpu.parse_args(["--grid"]).grid



def test_ab_scripts_pin_to_the_cores_given():
    """--cpus of the A/B scripts: distinct core numbers, normalized, one thread per core; anything
    else exits 2 naming the flag."""
    from bench import ab_step_costs, ab_trees_cpu

    args = ab_trees_cpu.parse_args(["--old-tree", "/tmp", "--cpus", " 0, 1"])
    assert (args.cpus, args.threads) == ("0,1", 2)
    assert ab_trees_cpu.parse_args(["--old-tree", "/tmp"]).threads == 1
    for bad in ("0,,1", "1,1", "0-3", "a"):
        with pytest.raises(SystemExit):
            ab_trees_cpu.parse_args(["--old-tree", "/tmp", "--cpus", bad])
        with pytest.raises(SystemExit):
            ab_step_costs.main(["--old-tree", "/tmp", "--cpus", bad, "--", "--threads", "2"])


def test_bench_functions_stay_short():
    """bench/'s scripts read as named steps (parse args, build the cells, run one cell, report): no
    function of bench/*.py spans more than 60 lines (scripts/longest_functions.py counts them)."""
    spec = importlib.util.spec_from_file_location("longest_functions", os.path.join(ROOT, "scripts",
                                                                                     "longest_functions.py"))
    lf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lf)
    found = [f for path in sorted(pathlib.Path(ROOT, "bench").glob("*.py")) for f in lf.functions(path)]
    assert len(found) > 100  # every script was parsed
    assert [os.path.relpath(where, ROOT) for lines, _code, where in found if lines > 60] == []

# ------------------------------------------------------------------ the reporter, on committed runs

def test_report_gamma_reproduces_the_committed_table(tmp_path, capsys):
    """``report gamma`` over the committed Xeon runs writes exactly the committed summary (the README's
    γ table: 8K batch 4, auto 1.59x full, 1.00 of the best fixed γ)."""
    runs = [os.path.join(RESULTS, "gamma_xeon_avx512", d, "runs.jsonl") for d in ("kjv_256tok_b1", "kjv_256tok_b4")]
    assert report.main(["gamma", *runs, "--out", str(tmp_path)]) == 0
    got = (tmp_path / "summary.md").read_text()
    assert got == open(os.path.join(RESULTS, "gamma_xeon_avx512", "summary.md")).read()
    assert re.search(r"^\| 7927 \| 4 \| \*\*1\.59\*\* \|.* \| 1\.00 \| 1\.01 \|$", got, re.M)


def test_report_held_out_ratio_chooses_gamma_on_the_other_repeats():
    """Per repeat, the fixed γ with the best median tok/s over the other repeats, and its tok/s in
    this repeat; auto's median over the median of those (None below two repeats)."""
    cell = {"auto": {"by_repeat": {0: 11.0, 1: 11.0, 2: 12.0}},
            2: {"by_repeat": {0: 10.0, 1: 10.0, 2: 13.0}},
            4: {"by_repeat": {0: 11.0, 1: 11.0, 2: 10.0}}}
    # repeats 0 and 1: γ 2 leads the others (11.5 vs 10.5) and runs 10 there; repeat 2: γ 4 (11 vs 10), 10
    assert report.held_out_ratio(cell) == pytest.approx(11.0 / 10.0)
    assert report.held_out_ratio({"auto": {"by_repeat": {0: 1.0}}, 2: {"by_repeat": {0: 1.0}}}) is None


def test_report_figure_pools_the_committed_grid(tmp_path, capsys):
    """The acceptance grid pooled per algorithm over every cell: the README's 4.24 / 4.12 / 3.83."""
    runs = sorted(os.path.join(RESULTS, "acceptance_grid_xeon_avx512", d, "runs.jsonl")
                  for d in os.listdir(os.path.join(RESULTS, "acceptance_grid_xeon_avx512")) if d.startswith("part_"))
    acc, blocks = report.pooled_by_budget(runs)
    pooled = {a: 1 + sum(v[0] for k, v in acc.items() if k[0] == a) / sum(v[1] for k, v in acc.items() if k[0] == a)
              for a in report.RIVALS}
    assert {a: round(m, 2) for a, m in pooled.items()} == {"vegas": 4.24, "quest": 4.12, "streamingllm": 3.83}
    assert blocks["vegas"] == {16}
    assert report.main(["figure", *runs, "--out", str(tmp_path / "f.png")]) == 0
    assert (tmp_path / "f.png").stat().st_size > 10000


def test_report_rejects_missing_runs_file(tmp_path, capsys):
    with pytest.raises(SystemExit):
        report.main(["gamma", str(tmp_path / "none.jsonl")])
    assert "runs file not found" in capsys.readouterr().err


# ------------------------------------------------------------------ the end-to-end harness

RUN_FIELDS = [
    "algorithm", "variant", "query_weights", "share_selection_across_heads", "selection_refresh_interval",
    "context", "batch_size", "num_speculative_tokens", "sparse_attn_ratio", "block_size", "dtype", "device",
    "torch", "transformers", "git_commit", "mean_acceptance_length", "draft_acceptance_rate",
    "num_accepted_tokens_per_pos", "tokens_per_s", "decode_tokens_per_s", "speedup_vs_full", "speedup_vs_hf",
    "time_draft_s", "time_verify_s", "time_select_s", "identical_to_plain", "cost_model_speedup_bound",
    "select_overhead_share",
]


@pytest.fixture(scope="module")
def tiny_doc_model_dir(tmp_path_factory):
    """A tiny Llama (2 layers, 512 positions) + a 600-word word-level tokenizer trained on the documents."""
    from tokenizers import Tokenizer, models as tmodels, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from vegas_ext import documents

    folder = str(tmp_path_factory.mktemp("tiny-doc-llama"))
    tk = Tokenizer(tmodels.WordLevel(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    texts = [documents.load_document(d)[:200_000] for d in ("pride_and_prejudice", "kjv")]
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    tk.train_from_iterator(texts, trainers.WordLevelTrainer(vocab_size=600, special_tokens=specials))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>")
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def test_e2e_harness_runs_and_records_every_field(tiny_doc_model_dir, tmp_path, capsys):
    out = tmp_path / "res"
    argv = ["--model", tiny_doc_model_dir, "--docs", "pride_and_prejudice", "--context-lengths", "200,300",
            "--batch-sizes", "1,2",
            "--algorithms", "hf,full,vegas,streamingllm,quest,vegas/first_last/shared/refresh=2/bs=1",
            "--num-speculative-tokens", "3", "--ratios", "0.05,0.1", "--min-tokens", "16", "--max-new-tokens", "6",
            "--repeats", "1", "--out", str(out), "--threads", "1"]
    assert e2e.main(argv) == 0
    recs = [json.loads(line) for line in open(out / "runs.jsonl")]
    labels = {r["label"] for r in recs}
    assert {"hf", "full"} <= labels
    assert {r["algorithm"] for r in recs} == {"hf", "full", "vegas", "streamingllm", "quest"}
    assert any(r["variant"] == "first_last/shared/refresh=2/bs=1" and r["block_size"] == 1
               and r["query_weights"] == "first_last" and r["share_selection_across_heads"]
               and r["selection_refresh_interval"] == 2 for r in recs)
    assert len(recs) == 2 * 2 * (2 + 4 * 2)  # contexts x batches x configurations
    for r in recs:
        for f in RUN_FIELDS:
            assert f in r, f
        assert r["identical_to_plain"] is True, r["label"]
        if r["algorithm"] not in ("hf", "full"):
            assert r["mean_acceptance_length"] >= 1.0 and len(r["num_accepted_tokens_per_pos"]) == 3
            assert r["cost_model_speedup_bound"] is not None and r["select_overhead_share"] is not None
            assert r["speedup_vs_full"] is not None and r["speedup_vs_hf"] is not None
    assert any(r["algorithm"] == "quest" and r["time_select_inline_s"] > 0 for r in recs)
    md = (out / "summary.md").read_text()
    assert "python -m bench.e2e --model" in md and "bound" in md
    for png in ("mal_vs_ratio.png", "tokens_per_s_vs_context.png", "per_position_acceptance.png",
                "selection_overhead.png"):
        assert (out / png).stat().st_size > 1000, png

    # the pooled report over the run (as for a grid split over processes): pooled MAL equals a
    # recomputation from the raw counts, and every cell of the grid gets a row
    rep = tmp_path / "rep"
    assert report.main(["grid", str(out / "runs.jsonl"), "--out", str(rep), "--no-plots"]) == 0
    text = (rep / "summary.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| 200 |") or line.startswith("| 300 |")]
    cell_rows = [line for line in rows if line.count("|") > 12]
    assert len(cell_rows) == 2 * 2 * 2  # contexts x batches x ratios (gamma 3 only)
    sel = [r for r in recs if r["algorithm"] == "vegas" and not r["variant"] and r["context_requested"] == 200
           and r["batch_size"] == 2 and r["sparse_attn_ratio"] == 0.1]
    want = 1 + sum(r["num_accepted_tokens"] for r in sel) / sum(r["num_drafts"] for r in sel)
    assert abs(report.pooled_mal(sel) - want) < 1e-12
    row = next(line for line in cell_rows if line.startswith("| 200 | 2 | 3 | 0.1 |"))
    assert f"{want:.2f}" == row.split("|")[5].strip()
    assert "identical to our plain decoding in" in text and "## Every run" in text


def test_e2e_rerun_into_a_folder_replaces_its_runs(tiny_doc_model_dir, tmp_path):
    """A second invocation with the same --out starts runs.jsonl afresh (it had appended to the
    first's records, and a report over the folder mixed the two)."""
    out = tmp_path / "res"
    argv = ["--model", tiny_doc_model_dir, "--docs", "pride_and_prejudice", "--context-lengths", "200",
            "--batch-sizes", "1", "--algorithms", "full", "--max-new-tokens", "2", "--repeats", "{}",
            "--out", str(out), "--threads", "1", "--no-plots"]
    for repeats in (2, 1):
        assert e2e.main([a.format(repeats) for a in argv]) == 0
    recs = [json.loads(line) for line in open(out / "runs.jsonl")]
    assert [r["repeat"] for r in recs] == [0]


def test_e2e_interrupted_rerun_leaves_no_earlier_summary(tiny_doc_model_dir, tmp_path, monkeypatch):
    """A rerun into a folder that stops before its report (Ctrl-C, a crash) must not leave the
    earlier invocation's summary.md beside its own, restarted runs.jsonl."""
    out = tmp_path / "res"
    argv = ["--model", tiny_doc_model_dir, "--docs", "pride_and_prejudice", "--context-lengths", "200",
            "--batch-sizes", "1", "--algorithms", "full", "--max-new-tokens", "2", "--repeats", "1",
            "--out", str(out), "--threads", "1", "--no-plots"]
    assert e2e.main(argv) == 0
    assert (out / "summary.md").exists()

    def interrupted(h, cfgs):
        open(h.runs_path, "w").close()
        raise KeyboardInterrupt

    monkeypatch.setattr(e2e, "run_cells", interrupted)
    with pytest.raises(KeyboardInterrupt):
        e2e.main(argv)
    assert not (out / "summary.md").exists()


def test_e2e_run_records_compare_each_run_with_the_same_repeats_baselines():
    """run_records (one repeat of a cell) on made-up results: the identity flags and speedups against
    that repeat's ``full`` and ``hf`` runs, the gamma policy's fields (cost_* as fitted_*) only on
    drafting runs, and the record's leading keys in runs.jsonl's order."""
    args = argparse.Namespace(max_new_tokens=4, chat=False, min_tokens=16)
    h = e2e.Harness(args, None, None, torch.device("cpu"), torch.float32, "m", {"torch": "t"}, "/nonexistent")

    def result(tokens, dec, e2e_, **more):
        stats = dict(decode_tokens_per_s=dec, tokens_per_s=e2e_, time_total_s=2.0, time_prefill_s=0.5,
                     num_iterations=3, **more)
        return {"tokens": tokens, "stats": stats}

    base = {"variant": "", "query_weights": None, "share_selection_across_heads": None,
            "selection_refresh_interval": None}
    full = {"algorithm": "full", "num_speculative_tokens": 0, "sparse_attn_ratio": None, "block_size": None, **base}
    veg = {"algorithm": "vegas", "num_speculative_tokens": 3, "sparse_attn_ratio": 0.05, "block_size": 1, **base,
           "draft_weights": None}
    results = {"hf": ({**full, "algorithm": "hf"}, result([[1, 2]], 5.0, 4.0)),
               "full": (full, result([[1, 2]], 10.0, 8.0, gamma_policy="fixed")),
               "vegas g3 r0.05 b1": (veg, result([[1, 3]], 25.0, 16.0, gamma_policy="auto", cost_t_draft_ms=1.5,
                                                 num_accepted_tokens_per_pos=torch.tensor([2, 1, 0])))}
    cell = {"doc": "kjv", "context_requested": 600, "context": 500, "batch_size": 1, "repeat": 1}
    recs = e2e.run_records(h, cell, results, 0.25)
    assert [r["label"] for r in recs] == ["hf", "full", "vegas g3 r0.05 b1"]
    assert list(recs[2])[:8] == ["doc", "context_requested", "context", "batch_size", "repeat", "label",
                                 "algorithm", "num_speculative_tokens"]
    hf_rec, full_rec, veg_rec = recs
    assert [r["identical_to_plain"] for r in recs] == [True, True, False]
    assert [r["identical_to_hf"] for r in recs] == [True, True, False]
    assert veg_rec["plain_reference"] == "full" and veg_rec["cell_prefill_s"] == 0.25
    assert veg_rec["speedup_vs_full"] == 2.5 and veg_rec["speedup_vs_hf"] == 5.0
    assert veg_rec["e2e_speedup_vs_full"] == 2.0 and hf_rec["speedup_vs_full"] == 0.5
    assert veg_rec["ms_per_iteration"] == 500.0 and veg_rec["sparse_attn_min_tokens"] == 16
    assert veg_rec["num_accepted_tokens_per_pos"] == [2, 1, 0]
    assert veg_rec["gamma_policy"] == "auto" and veg_rec["fitted_cost_t_draft_ms"] == 1.5
    assert "gamma_policy" not in full_rec and full_rec["sparse_attn_min_tokens"] is None
    assert all(r["torch"] == "t" and r["model"] == "m" and r["dtype"] == "float32" for r in recs)

def test_e2e_harness_prompt_files(tiny_doc_model_dir, tmp_path):
    """--docs takes paths of text files too (prompt files); a missing file is a clear CLI error."""
    from transformers import AutoTokenizer

    from vegas_ext import documents

    f = tmp_path / "notes.txt"
    f.write_text(documents.load_document("kjv")[:20000], encoding="utf-8")
    text, instr = e2e.document_text(str(f))
    assert text.startswith(documents.load_document("kjv")[:100]) and instr == e2e.FILE_INSTRUCTION
    tok = AutoTokenizer.from_pretrained(tiny_doc_model_dir)
    ids, mask = e2e.build_batch(tok, str(f), 150, 2, chat=False)
    assert ids.shape == (2, 150) and bool(mask.all())
    assert ids[0].tolist() != ids[1].tolist()  # rows start at different places of the file
    with pytest.raises(SystemExit):
        e2e.parse_args(["--docs", str(tmp_path / "missing.txt")])
    with pytest.raises(ValueError, match="neither one of"):
        e2e.document_text(str(tmp_path / "missing.txt"))


def test_decode_step_costs_random_model_smoke(tmp_path):
    """bench/decode_step_costs.py (the GPU check's end-to-end step) runs on a random-weight model
    and writes the iteration costs and the cost-model prediction."""
    out = tmp_path / "costs.jsonl"
    subprocess.run([sys.executable, "-m", "bench.decode_step_costs", "--model-config", "tiny",
                    "--contexts", "300", "--batches", "2", "--gamma", "3", "--tau", "2.5", "--reps", "1",
                    "--min-tokens", "16", "--threads", "1", "--out", str(out)],
                   check=True, capture_output=True, cwd=ROOT)
    rec = json.loads(out.read_text().splitlines()[0])
    assert rec["model"] == "tiny" and rec["context"] == 300 and rec["batch"] == 2 and rec["block_size"] == 1
    for k in ("full_step_ms", "draft_step_ms", "verify_ms", "select_ms", "hf_step_ms"):
        assert rec[k] > 0, k
    it = 3 * rec["draft_step_ms"] + rec["verify_ms"] + rec["select_ms"]
    assert abs(rec["vegas_iteration_ms"] - it) < 0.05
    assert abs(rec["pred_speedup_vs_full"] - 2.5 * rec["full_step_ms"] / it) < 0.02


def test_gamma_policy_sim_replays_drafts_per_row_on_measured_costs(tmp_path):
    """decode_step_costs --verify-tokens times the verification of each q; gamma_policy_sim --costs
    replays our loop's auto and fixed gammas on those times: exact rates where no draft is
    rejected and timings hold still, and a table for every batch size and acceptance."""
    from bench import gamma_policy_sim as sim
    from vegas_ext.speculation import FixedGamma

    out = tmp_path / "costs.jsonl"
    subprocess.run([sys.executable, "-m", "bench.decode_step_costs", "--model-config", "tiny", "--contexts", "300",
                    "--batches", "1,2", "--gamma", "2", "--verify-tokens", "2,3,5", "--reps", "1", "--no-hf",
                    "--min-tokens", "16", "--threads", "1", "--out", str(out)],
                   check=True, capture_output=True, cwd=ROOT)
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert all(r[f"verify_q{q}_ms"] > 0 for r in recs for q in (2, 3, 5))
    for q in ("301", "0", "x"):  # a count past the context, none, not a count: usage errors
        bad = subprocess.run([sys.executable, "-m", "bench.decode_step_costs", "--contexts", "300", "--verify-tokens",
                              f"2,{q}"], capture_output=True, text=True, cwd=ROOT)
        assert bad.returncode == 2 and f"--verify-tokens: '{q}'" in bad.stderr, bad.stderr
    table = sim.CostTable({1: dict(full_step_ms=10.0, select_ms=1.0, draft_step_ms=2.0, verify_q2_ms=12.0,
                                   verify_q4_ms=14.0)}, 1, "draft_step_ms")
    assert (table.verify(1), table.verify(3), table.verify(6)) == (10.0, 13.0, 16.0)
    one = dict(full_step_ms=10.0, select_ms=1.0, draft_step_ms=2.0, verify_q2_ms=12.0, verify_q4_ms=14.0)
    four = sim.CostTable({1: one, 4: dict(full_step_ms=16.0, select_ms=1.0, draft_step_ms=3.0, verify_q2_ms=20.0,
                                          verify_q3_ms=22.0)}, 4, "draft_step_ms")
    # finished rows stay in the batch: the last row alone costs a batch-1 verification; two rows of
    # 4 tokens, a third of the way from batch 1's 14 ms to batch 4's 24 ms (the line past 4 x 3 tokens)
    assert four.verify(1, active=1) == 10.0 and four.verify(4, active=1) == 14.0 and four.verify(4) == 16.0
    assert four.verify(8, active=2) == pytest.approx(14.0 + (24.0 - 14.0) / 3)
    assert four.draft(1) == pytest.approx(2.0) and four.draft(4) == pytest.approx(3.0)
    assert sim.simulate_rows(FixedGamma(0), [1.0], table, 10, 0.0, 0) == pytest.approx(1 / 10.0)
    # gamma 3, every draft accepted: 4 tokens per 3 draft steps + a verification of 4 + a selection
    assert sim.simulate_rows(FixedGamma(3), [1.0], table, 12, 0.0, 0) == pytest.approx(4 / (6.0 + 14.0 + 1.0))
    # a machine whose speed drifts: every timing of a phase scaled alike, the same phases for every policy of a seed
    slow = [sim.simulate_rows(FixedGamma(0), [1.0], table, 200, 0.0, s, drift=0.3, drift_period=50.0) for s in (0, 0)]
    assert slow[0] == slow[1] and slow[0] != pytest.approx(1 / 10.0, rel=1e-3)
    assert 0.5 / 10.0 < slow[0] < 2.0 / 10.0
    r = subprocess.run([sys.executable, "-m", "bench.gamma_policy_sim", "--costs", str(out), "--seeds", "2",
                        "--new-tokens", "12", "--acceptance", "0.5", "0.9", "--fixed", "1", "2",
                        "--draft-key", "draft_step_ms",
                        "--variants", '[{"prior_weight": 4}]'], check=True, capture_output=True, text=True, cwd=ROOT)
    rows = [x for x in r.stdout.splitlines() if re.match(r"\| [12] \| 0\.[59]0 \| gamma [12]", x)]
    assert len(rows) == 4, r.stdout
    bad = subprocess.run([sys.executable, "-m", "bench.gamma_policy_sim", "--costs", str(out), "--draft-key",
                          "draft_step_ms", "--variants", '[{"prior_weight": -1}]'], capture_output=True, text=True,
                         cwd=ROOT)
    assert bad.returncode == 2 and "--variants" in bad.stderr and "prior_weight" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "bench.gamma_policy_sim", "--costs", str(out)],
                         capture_output=True, text=True, cwd=ROOT)  # no int8 draft step in this file
    assert bad.returncode == 2 and "no number 'draft_step_int8_ms'" in bad.stderr


# ------------------------------------------------------------------ the torch-free C++ benchmarks

def _build(src, tmp_path):
    exe = str(tmp_path / os.path.basename(src).replace(".cpp", ""))
    inc = os.path.join(os.path.dirname(torch.__file__), "include")
    cmd = ["g++", "-O2", "-std=c++20", "-ffp-contract=fast", "-Wno-psabi", f"-I{ROOT}/csrc", f"-I{inc}",
           os.path.join(ROOT, "bench", src), "-o", exe]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return exe


@needs_gpp
def test_attend_microbench_matches_softmax_sums(tmp_path):
    exe = _build("cpu_attend_microbench.cpp", tmp_path)
    Q, G, D, S = 3, 2, 37, 203
    r = subprocess.run([exe, str(Q), str(G), str(D), str(S), "5", "2", "2"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    m = re.search(r"median ([0-9.]+) ms, ([0-9.]+) GFLOP/s \(acc0 (\S+), l0 (\S+)\)", r.stdout)
    assert m, r.stdout
    # l0: the softmax denominator of row 0 (query 0, head 0) over the last KV head, relative to its
    # running max; its inputs are the program's own deterministic fill (see the source)
    T = 2
    n = np.arange(T * S * D, dtype=np.uint64)
    k = ((n * np.uint64(2654435761)) % np.uint64(1000)).astype(np.float32) * np.float32(0.001) - np.float32(0.5)
    k = k.reshape(T, S, D)[T - 1]
    nq = np.arange(Q * G * D, dtype=np.uint64)
    q = ((nq * np.uint64(7919)) % np.uint64(1000)).astype(np.float32) * np.float32(0.0005) - np.float32(0.25)
    q0 = q.reshape(Q * G, D)[0].astype(np.float64)
    visible = S - Q + 1  # row 0 is query 0: position S - Q
    s = k[:visible].astype(np.float64) @ q0
    l0 = np.exp(s - s.max()).sum()
    assert float(m.group(4)) == pytest.approx(l0, rel=1e-4)


@needs_gpp
@pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith("AVX512"), reason="AVX-512 only")
def test_microkernel_rates_builds_and_runs(tmp_path):
    exe = _build("cpu_microkernel_rates.cpp", tmp_path)
    r = subprocess.run([exe], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for row in ("fma (registers only)", "fma+bcast", "qk_pair_rows<3>", "pv_rows"):
        assert row in r.stdout


def test_vllm_e2e_reads_the_proposer_counters_and_tables_them():
    from bench import vllm_e2e

    before = {"draft_tokens": 10, "pages_read": 100, "pages_dense": 1000, "gamma_histogram": [3, 1, 0],
              "vetoed_steps": 1, "cost_t_plain_ms": 90.0}
    after = {"draft_tokens": 30, "pages_read": 400, "pages_dense": 3000, "gamma_histogram": [5, 4, 7],
             "vetoed_steps": 2, "cost_t_plain_ms": 100.0, "max_over_budget": 0}
    d = vllm_e2e._draft_reads(before, after, num_layers=5, page_size=32)
    # 300 pages of 32 tokens over 20 draft tokens x 5 layers; 300 of 2000 dense pages
    assert d["draft_tokens"] == 20 and d["tokens_read_per_draft"] == pytest.approx(300 * 32 / 100)
    assert d["read_share"] == pytest.approx(0.15)
    assert d["gamma_histogram"] == [2, 3, 7] and d["vetoed_steps"] == 1 and d["cost_t_plain_ms"] == 100.0
    tok = vllm_e2e._draft_reads({}, {"draft_tokens": 4, "tokens_read": 80, "tokens_dense": 800}, 2, 32)
    assert tok["tokens_read_per_draft"] == 10 and tok["read_share"] == pytest.approx(0.1)
    assert vllm_e2e._proposer_stats(None) == {}

    row = {"context": 2048, "batch": 4, "new_tokens": 8, "mean_acceptance_length": None, "tokens": [[1]]}
    rows = [dict(row, method="none", tokens_per_s=10.0, decode_tokens_per_s=12.0),
            dict(row, method="vegas_auto", tokens_per_s=15.0, decode_tokens_per_s=18.0, drafter=d,
                 mean_acceptance_length=3.5)]
    cfg = dict(vllm="0.32", device="CPU", threads="2 cores", dtype="float32", block_size=32, new_tokens=8,
               gamma=6, ratio=0.05, min_tokens=256, commit="abc")
    text = vllm_e2e.summarize(rows, cfg)
    assert "| 2048 | 4 | 10.0 | 15.0 (1.50x) | 3.50 | vegas_auto: yes |" in text
    assert "| 2048 | 4 | vegas_auto | 18.0 (1.50x) | 96 (15%) | [2, 3, 7] | 1 |" in text


def test_vllm_e2e_prompts(tiny_doc_model_dir, tmp_path):
    """bench/vllm_e2e.py's prompts: text windows or summarize prompts (bench/e2e.py's), exactly
    ``context`` tokens, different per request; a missing --document is a CLI error."""
    from transformers import AutoTokenizer

    from bench import vllm_e2e

    tok = AutoTokenizer.from_pretrained(tiny_doc_model_dir)
    tok.chat_template = ("{% for m in messages %}<user> {{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %} <assistant>{% endif %}")
    text = vllm_e2e.prompt_maker(tok, "kjv", "text")(300, 3)
    summ = vllm_e2e.prompt_maker(tok, "kjv", "summarize")(300, 3)
    assert [len(p) for p in text + summ] == [300] * 6
    assert len({tuple(p) for p in text}) == 3 and len({tuple(p) for p in summ}) == 3
    assert summ == e2e.build_batch(tok, "kjv", 300, 3, chat=True)[0].tolist()
    assert summ[0][:280] != text[0][:280]
    f = tmp_path / "short.txt"
    f.write_text("a few words", encoding="utf-8")
    with pytest.raises(ValueError, match="--document"):
        vllm_e2e.prompt_maker(tok, str(f), "text")(300, 1)
    with pytest.raises(SystemExit):
        vllm_e2e.parse_args(["--document", str(tmp_path / "missing.txt")])
