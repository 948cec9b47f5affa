"""Tests of the ``vegas`` command (``vegas_ext.cli``) and of model/document loading.

Fast tests use a tiny random-weight Llama model with a word-level tokenizer trained here on a
few sentences, saved to a temporary folder: no downloads, seconds to run. The ``slow`` tests use
the embedded SmolLM2 GGUF (converted once, then cached) and the embedded document.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from vegas_ext import cli, documents, models

WORDS = ("the a of and to in is was it that he she they we you his her said mr mrs miss "
         "bennet darcy bingley elizabeth jane house ball letter sister family fortune man "
         "woman good great very much more one two three day night long time love pride").split()
TEXT = " ".join(WORDS) + " . , ! ?"


def _make_tokenizer(folder):
    from tokenizers import Tokenizer, models as tmodels, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(tmodels.WordLevel(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>"]
    tk.train_from_iterator([TEXT] * 3, trainers.WordLevelTrainer(special_tokens=specials, min_frequency=1))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tok.save_pretrained(folder)
    return tok


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Llama (2 layers, hidden 64, 64 positions) + word-level tokenizer saved to a folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = str(tmp_path_factory.mktemp("tiny-llama"))
    tok = _make_tokenizer(folder)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, initializer_range=0.15)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def run_cli(argv, capsys):
    """Runs ``vegas`` in-process; returns (exit status, stdout, stderr)."""
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:  # argparse
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def _assert_one_line_error(rc, out, err):
    assert rc not in (0, None), (rc, out, err)
    assert "Traceback" not in err
    lines = [l for l in err.strip().splitlines() if l.strip()]
    errors = [l for l in lines if "error" in l]
    # one error line, last; before it at most the progress lines ("vegas: starting ...", "vegas: loading ...")
    assert len(errors) == 1 and lines[-1] == errors[0] and lines[-1].startswith("vegas: error:"), err
    assert all(l.startswith("vegas: ") for l in lines) and len(lines) <= 4, err
    return errors[0]


# ------------------------------------------------------------------------------------ --json

def test_json_output_fields(tiny_model_dir, capsys):
    rc, out, err = run_cli(["generate", "--model", tiny_model_dir, "--prompt", "the man said to miss bennet",
                            "--max-new-tokens", "10", "--num-speculative-tokens", "3", "--gamma-policy", "fixed",
                            "--block-size", "4",
                            "--min-tokens", "4", "--ignore-eos", "--compare", "--json", "--no-progress"], capsys)
    assert rc == 0, err
    assert "Traceback" not in err
    d = json.loads(out)  # exactly one JSON object on stdout
    for key in ("prompt_lengths", "token_ids", "text", "stats", "baseline_tokens_per_s", "speedup", "identical"):
        assert key in d, key
    assert "prompt_token_ids" not in d  # long; only with --json-prompt-ids
    assert len(d["prompt_lengths"]) == len(d["token_ids"]) == len(d["text"]) == 1
    assert d["first_difference"] is None
    assert len(d["token_ids"][0]) == 10  # --ignore-eos: every row runs to max_new_tokens
    assert d["identical"] is True  # greedy Vegas == plain greedy HF generate
    assert d["baseline_token_ids"] == d["token_ids"]
    s = d["stats"]
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos",
                "mean_acceptance_length", "draft_acceptance_rate", "num_generated_tokens", "tokens_per_s",
                "time_total_s", "time_prefill_s", "time_draft_s", "time_verify_s", "time_select_s"):
        assert key in s, key
    assert s["num_generated_tokens"] == 10
    assert len(s["num_accepted_tokens_per_pos"]) == 3
    assert 1.0 <= s["mean_acceptance_length"] <= 4.0
    assert d["speedup"] > 0 and d["baseline_tokens_per_s"] > 0
    assert d["packed_linears"] == 2 * 7 + 1  # CPU float32: every linear, lm_head included


def test_no_pack_linears(tiny_model_dir, capsys):
    rc, out, err = run_cli(["generate", "--model", tiny_model_dir, "--prompt", "the man said to miss bennet",
                            "--max-new-tokens", "6", "--num-speculative-tokens", "3", "--gamma-policy", "fixed",
                            "--block-size", "4",
                            "--min-tokens", "4", "--ignore-eos", "--compare", "--json", "--no-progress",
                            "--no-pack-linears"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    assert d["packed_linears"] == 0 and d["identical"] is True


def test_json_batch_of_prompts_and_repeat(tiny_model_dir, capsys):
    rc, out, err = run_cli(["generate", "--model", tiny_model_dir, "--prompt", "pride",
                            "--prompt", "the long letter of mr darcy to elizabeth was very long",
                            "--batch-size", "3", "--max-new-tokens", "6", "--num-speculative-tokens", "2",
                            "--gamma-policy", "fixed",
                            "--compare", "--json", "--json-prompt-ids", "--no-progress", "--ignore-eos"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    assert len(d["token_ids"]) == 3 and len(d["prompt_token_ids"]) == 3
    assert d["prompt_lengths"] == [len(r) for r in d["prompt_token_ids"]]
    assert d["prompt_token_ids"][0] == d["prompt_token_ids"][2] != d["prompt_token_ids"][1]
    assert all(len(r) == 6 for r in d["token_ids"])
    assert d["identical"] is True


def test_chat_and_full_algorithm(tiny_model_dir, capsys):
    rc, out, err = run_cli(["generate", "--model", tiny_model_dir, "--prompt", "the ball", "--chat",
                            "--algorithm", "full", "--max-new-tokens", "4", "--json", "--json-prompt-ids",
                            "--no-progress"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    tok_dir = tiny_model_dir
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert d["prompt_token_ids"][0][0] == tok.convert_tokens_to_ids("<|user|>")
    assert d["stats"]["num_drafts"] == 0


def test_sampling_seeded_is_reproducible(tiny_model_dir, capsys):
    """A seed with a fixed gamma repeats the tokens exactly; with gamma auto (whose choices follow
    the run's timings) the CLI says that only the distribution repeats."""
    argv = ["generate", "--model", tiny_model_dir, "--prompt", "the house", "--max-new-tokens", "8",
            "--do-sample", "--temperature", "0.9", "--top-k", "20", "--top-p", "0.95", "--seed", "7",
            "--ignore-eos", "--json", "--no-progress"]
    fixed = argv + ["--num-speculative-tokens", "3", "--gamma-policy", "fixed"]
    rc1, out1, err1 = run_cli(fixed, capsys)
    rc2, out2, _ = run_cli(fixed, capsys)
    assert rc1 == rc2 == 0, err1
    assert json.loads(out1)["token_ids"] == json.loads(out2)["token_ids"]
    assert "timings" not in err1
    rc3, _, err3 = run_cli(argv, capsys)
    assert rc3 == 0 and "--seed with sampling and --gamma-policy auto" in err3


def test_human_output_text_to_stdout_stats_to_stderr(tiny_model_dir, capsys):
    rc, out, err = run_cli(["generate", "--model", tiny_model_dir, "--prompt", "the day",
                            "--max-new-tokens", "5", "--compare", "--ignore-eos"], capsys)
    assert rc == 0, err
    assert out.strip()  # the text
    assert "vegas stats" in err and "speedup" in err and "identical" in err
    assert "decode only" in err and "mean accept" in err
    assert "mean accept" not in out
    assert any(line.startswith("--- vegas stats ---") for line in err.split("\n"))  # not after a bar's \r
    assert "(plain loop)" in err, err  # our plain loop's run shows its progress too


def test_human_output_full_algorithm_has_no_acceptance_lines(tiny_model_dir, capsys):
    rc, out, err = run_cli(["generate", "--model", tiny_model_dir, "--prompt", "the day", "--algorithm", "full",
                            "--max-new-tokens", "5", "--ignore-eos", "--no-progress"], capsys)
    assert rc == 0, err
    assert "--- full stats ---" in err and "vegas stats" not in err
    assert "decode only" in err and "mean accept" not in err


def test_prompt_file(tiny_model_dir, tmp_path, capsys):
    p = tmp_path / "prompt.txt"
    p.write_text("mrs bennet and her family")
    rc, out, err = run_cli(["generate", "--model", tiny_model_dir, "--prompt-file", str(p),
                            "--max-new-tokens", "3", "--json", "--no-progress"], capsys)
    assert rc == 0, err
    assert len(json.loads(out)["token_ids"]) == 1


# ------------------------------------------------------------------------------ bad input

BAD = {
    "missing_prompt_file": (["--prompt-file", "/nonexistent/prompt.txt"], "not found"),
    "unknown_model_hub_id": (["--model", "no-such-org/no-such-model-xyz", "--prompt", "hi"], "unknown model"),
    "missing_model_path": (["--model", "./no/such/folder", "--prompt", "hi"], "not found"),
    "missing_gguf": (["--model", "/tmp/none-such.gguf", "--prompt", "hi"], "not found"),
    "gamma_zero": (["--num-speculative-tokens", "0", "--gamma-policy", "fixed"], "num-speculative-tokens"),
    "gamma_negative": (["--num-speculative-tokens", "-2"], "num-speculative-tokens"),
    "ratio_zero": (["--ratio", "0"], "ratio"),
    "ratio_above_one": (["--ratio", "1.5"], "ratio"),
    "ratio_nan": (["--ratio", "nan"], "ratio"),
    "batch_zero": (["--batch-size", "0"], "batch-size"),
    "batch_not_int": (["--batch-size", "two"], "batch-size"),
    "max_new_zero": (["--max-new-tokens", "0"], "max-new-tokens"),
    "unknown_algorithm": (["--algorithm", "magic"], "algorithm"),
    "bad_dtype": (["--dtype", "int3"], "dtype"),
    "bad_top_p": (["--do-sample", "--top-p", "0"], "top-p"),
    "unknown_flag": (["--frobnicate"], "unrecognized"),
    "refresh_zero": (["--refresh-interval", "0"], "refresh-interval"),
    "score_decay_above_one": (["--score-decay", "1.5"], "score-decay"),
    "bad_query_weights": (["--query-weights", "middle"], "query-weights"),
    "bad_device": (["--device", "gpu"], "--device"),
    "unknown_draft_weights": (["--draft-weights", "int3"], "--draft-weights"),
    "model_not_gguf": (["--model", os.path.abspath(__file__), "--prompt", "hi"], "not a .gguf file"),
    "json_prompt_ids_without_json": (["--json-prompt-ids"], "--json"),
}


@pytest.mark.parametrize("algo", ["streamingllm", "quest", "vegas"])
def test_rival_algorithms_and_vegas_options(algo, tiny_model_dir, capsys):
    argv = ["generate", "--model", tiny_model_dir, "--prompt", "the man said to miss bennet", "--algorithm", algo,
            "--max-new-tokens", "6", "--num-speculative-tokens", "3", "--gamma-policy", "fixed", "--json",
            "--no-progress", "--compare"]
    if algo == "vegas":
        argv += ["--query-weights", "first_last", "--refresh-interval", "2", "--score-decay", "0.3"]
    rc, out, err = run_cli(argv, capsys)
    assert rc == 0, err
    d = json.loads(out)
    assert d["identical"] is True
    assert d["stats"]["sparse_attn_algorithm"] == algo
    if algo == "vegas":
        assert d["stats"]["query_weights"] == "first_last" and d["stats"]["selection_refresh_interval"] == 2
        assert d["stats"]["score_decay"] == 0.3


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_one_line_error(name, tiny_model_dir, capsys):
    extra, needle = BAD[name]
    argv = ["generate"] + extra
    if "--model" not in extra:
        argv += ["--model", tiny_model_dir]
    if "--prompt" not in extra and "--prompt-file" not in extra:
        argv += ["--prompt", "hello there"]
    rc, out, err = run_cli(argv, capsys)
    line = _assert_one_line_error(rc, out, err)
    assert needle in line, line
    assert out == ""


def test_prompt_longer_than_positions(tiny_model_dir, capsys):
    long_prompt = " ".join(WORDS * 3)  # > 64 tokens
    rc, out, err = run_cli(["generate", "--model", tiny_model_dir, "--prompt", long_prompt], capsys)
    line = _assert_one_line_error(rc, out, err)
    assert "positions" in line


def test_max_new_tokens_clamped_to_positions(tiny_model_dir, capsys):
    prompt = " ".join(WORDS[:50])  # 50 tokens of 64 positions
    rc, out, err = run_cli(["generate", "--model", tiny_model_dir, "--prompt", prompt, "--max-new-tokens", "40",
                            "--ignore-eos", "--json", "--no-progress"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    assert d["prompt_lengths"][0] + len(d["token_ids"][0]) <= 64


def test_generate_leaves_its_args_unchanged(tiny_model_dir, capsys):
    """cmd_generate works on a checked copy: the caller's Namespace keeps its parsed values (it used
    to get --num-speculative-tokens turned into an int and --block-size filled in)."""
    args = cli.build_parser().parse_args(["generate", "--model", tiny_model_dir, "--prompt", "the day",
                                          "--max-new-tokens", "3", "--gamma", "2", "--gamma-policy", "fixed",
                                          "--json", "--no-progress"])
    before = dict(vars(args))
    assert cli.cmd_generate(args) == 0
    assert vars(args) == before
    assert args.num_speculative_tokens == "2" and args.block_size is None
    d = json.loads(capsys.readouterr().out)
    assert d["num_speculative_tokens"] == 2 and d["block_size"] == 1  # vegas' own block size, in the result


def test_no_subcommand_prints_help(capsys):
    rc, out, err = run_cli([], capsys)
    assert rc == 2 and "generate" in err


def test_console_entry_point_subprocess(tmp_path):
    """The real process: exit status 2, one line on stderr, no traceback (validation precedes model load)."""
    env = dict(os.environ, VEGAS_CACHE_DIR=str(tmp_path))
    for module in ("vegas_ext", "vegas_ext.cli"):  # `python -m vegas_ext.cli` too, as when cli was one file
        r = subprocess.run([sys.executable, "-m", module, "generate", "--ratio", "0"], capture_output=True,
                           text=True, env=env, timeout=120)
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("vegas: error:"), r.stderr
        assert r.stdout == ""


# ---------------------------------------------------------------------- start-up and progress

def _subprocess_env(tmp_path):
    src = os.path.dirname(os.path.dirname(os.path.abspath(models.__file__)))  # python/, above vegas_ext/
    env = dict(os.environ, VEGAS_CACHE_DIR=str(tmp_path))
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_help_and_argument_errors_do_not_import_torch(tmp_path):
    """`vegas generate --help` and a bad flag answer before torch / transformers are imported: the
    console script (`vegas_ext_cli:main`) runs vegas_ext.cli without importing the package."""
    probe = ("import sys, time; t = time.perf_counter(); import vegas_ext_cli\n"
             "for argv in (['generate', '--help'], ['generate', '--ratio', '0'], ['generate', '--frobnicate'],\n"
             "             ['generate', '--algorithm', 'magic'], ['generate', '--dtype', 'int3']):\n"
             "    try:\n        vegas_ext_cli.main(argv)\n    except SystemExit:\n        pass\n"
             "print('SECONDS', time.perf_counter() - t, 'HEAVY',\n"
             "      sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=_subprocess_env(tmp_path),
                       timeout=120)
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1].split()
    assert last[0] == "SECONDS" and last[2] == "HEAVY"
    assert " ".join(last[3:]) == "[]", r.stdout  # nothing heavy was imported
    assert float(last[1]) < 5.0, last  # ~0.05 s; generous for a loaded machine


def test_help_subprocess_is_fast(tmp_path):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "vegas_ext_cli", "generate", "--help"], capture_output=True, text=True,
                       env=_subprocess_env(tmp_path), timeout=120)
    elapsed = time.perf_counter() - t0
    assert r.returncode == 0 and "--num-speculative-tokens" in r.stdout and "--json-prompt-ids" in r.stdout
    assert elapsed < 10.0, elapsed  # interpreter start-up included; importing torch alone takes longer here


def test_algorithm_list_matches_the_registry():
    """The CLI checks --algorithm before importing torch, against a list kept equal to the registry."""
    import vegas_ext

    vegas_ext.generate  # noqa: B018  (the attribute access registers the rivals)
    from vegas_ext.decode import SELECTION_ALGORITHMS

    public = sorted(n for n in SELECTION_ALGORITHMS if not n.startswith("_"))  # "_test_*": other test files
    assert tuple(public) == cli.ALGORITHMS


def test_package_import_loads_the_ops_and_stays_complete(tmp_path):
    """`import vegas_ext` makes every torch.ops.vegas op callable (issue 31) but loads no transformers;
    `from vegas_ext import generate` still works and sees every algorithm."""
    probe = ("import sys, torch; import vegas_ext\n"
             "names = sorted(n.split('::')[1] for n in torch._C._dispatch_get_all_op_names() "
             "if n.startswith('vegas::'))\n"
             "print(names, all(callable(getattr(torch.ops.vegas, n)) for n in names), 'transformers' in sys.modules)\n"
             "from vegas_ext import generate, GenerateOutput, reference\n"
             "from vegas_ext.decode import SELECTION_ALGORITHMS\n"
             "print(sorted(SELECTION_ALGORITHMS), callable(generate))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=_subprocess_env(tmp_path),
                       timeout=300)
    assert r.returncode == 0, r.stderr
    ops_line, algos_line = r.stdout.strip().splitlines()[-2:]
    names, rest = ops_line.rsplit("]", 1)
    assert rest.split() == ["True", "False"], ops_line  # every op callable; transformers not loaded
    assert {"block_minmax_update", "block_topk", "paged_block_scores", "quest_block_scores", "sparse_draft_attention",
            "verify_attention"} <= set(eval(names + "]")), ops_line
    assert algos_line == "['full', 'quest', 'streamingllm', 'vegas'] True"


def test_console_script_is_the_launcher():
    """The installed `vegas` command is the launcher that parses before importing the package."""
    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts == {"vegas": "vegas_ext_cli:main"}


def test_progress_in_a_log_file_has_no_carriage_returns(tiny_model_dir, capsys):
    """stderr is not a terminal under capsys: progress is whole lines (phase starts and ends), no \\r."""
    rc, out, err = run_cli(["generate", "--model", tiny_model_dir, "--prompt", "the man said to miss bennet",
                            "--max-new-tokens", "6", "--ignore-eos", "--compare"], capsys)
    assert rc == 0, err
    assert "\r" not in err
    lines = err.splitlines()
    for phase in ("prefill (vegas)", "decoding (vegas)", "prefill (HF generate)", "decoding (HF generate)"):
        assert any(l.startswith(f"vegas: {phase}: ") and " in " in l for l in lines), (phase, err)
    assert any(l.startswith("vegas: loaded in ") for l in lines)
    assert out.strip()  # the text, printed at the end (stdout is not a terminal either)


def test_progress_on_a_terminal_uses_bars_and_summary_lines(tiny_model_dir, capsys, monkeypatch):
    import io

    class TTY(io.StringIO):
        def isatty(self):
            return True

    fake = TTY()
    monkeypatch.setattr(sys, "stderr", fake)
    rc = cli.main(["generate", "--model", tiny_model_dir, "--prompt", "the day", "--max-new-tokens", "5",
                   "--ignore-eos", "--json"])
    err = fake.getvalue()
    assert rc == 0, err
    assert "layer" in err and "token" in err  # the tqdm bars: prefill by layer, decoding by token
    assert "vegas: prefill (vegas): 1 tokens" not in err
    assert any(l.startswith("vegas: decoding (vegas): 5 tokens in ") for l in err.replace("\r", "\n").splitlines())
    d = json.loads(capsys.readouterr().out)
    assert len(d["token_ids"][0]) == 5


def test_streamed_text_on_a_terminal_has_no_decoding_bar(tiny_model_dir, monkeypatch):
    """One row on a terminal: the text streams to stdout and is the decoding progress; no bar on
    stderr then (it would interleave with the text), only the prefill bar and the summary lines."""
    import io

    class TTY(io.StringIO):
        def isatty(self):
            return True

    out, err = TTY(), TTY()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    rc = cli.main(["generate", "--model", tiny_model_dir, "--prompt", "the day", "--max-new-tokens", "5",
                   "--ignore-eos"])
    assert rc == 0, err.getvalue()
    e = err.getvalue()
    assert "\rprefill (vegas)" in e and "\rdecoding (vegas)" not in e, e
    assert "vegas: decoding (vegas): 5 tokens in " in e
    text = out.getvalue()
    assert text.strip() and text.endswith("\n") and not text.endswith("\n\n")  # one newline after the text


def test_log_bar_rate_limited(capsys):
    bar = cli._LogBar("decoding (x)", 100, "token", interval=3600.0)
    for _ in range(100):
        bar.update(1)
    bar.close()
    assert capsys.readouterr().err == ""  # no line before the interval; the phase summary line is the caller's
    bar = cli._LogBar("decoding (x)", 100, "token", interval=0.0)
    bar.update(3)
    assert capsys.readouterr().err == "vegas: decoding (x): 3/100 tokens, 0 s ...\n"


# ------------------------------------------------------------- the lossless contract and its report

def _tiny_llama(folder, seed, layers=2, heads=4, kv_heads=2, positions=512):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _make_tokenizer(folder)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=positions,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, initializer_range=0.15)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


CONTRACT_CONFIGS = [  # seed, layers, heads, KV heads
    (0, 2, 4, 2), (1, 2, 4, 1), (2, 3, 4, 4), (3, 2, 4, 2), (4, 4, 4, 2), (5, 2, 4, 1),
]


@pytest.fixture(scope="module")
def contract_models(tmp_path_factory):
    return [_tiny_llama(str(tmp_path_factory.mktemp(f"contract{i}")), *c) for i, c in enumerate(CONTRACT_CONFIGS)]


def _contract_run(folder, dtype, capsys):
    prompt = " ".join(WORDS[(7 * i) % len(WORDS)] for i in range(180))  # ~180 tokens: drafts are sparse
    rc, out, err = run_cli(["generate", "--model", folder, "--prompt", prompt, "--dtype", dtype,
                            "--max-new-tokens", "24", "--num-speculative-tokens", "3", "--gamma-policy", "fixed",
                            "--ratio", "0.1",
                            "--min-tokens", "8", "--block-size", "4", "--ignore-eos", "--compare", "--json",
                            "--no-progress"], capsys)
    assert rc == 0, err
    return json.loads(out)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("i", range(len(CONTRACT_CONFIGS)))
def test_greedy_equal_up_to_near_ties(i, dtype, contract_models, capsys):
    """Every dtype: identical to plain greedy, or the first difference is a near-tie of the
    target's logits (where rounding decides, which depends on the CPU: so does whether there is
    one; on the Intel AVX-512 machine measured these runs were identical in float32)."""
    d = _contract_run(contract_models[i], dtype, capsys)
    assert len(d["token_ids"][0]) == 24 and len(d["baseline_token_ids"][0]) == 24
    if not d["identical"]:
        f = d["first_difference"]
        assert f["near_tie"] is True and f["eps_units"] <= f["eps_bound"] == cli.NEAR_TIE_EPS[dtype], f
        t = f["token"]
        assert d["token_ids"][f["row"]][:t] == d["baseline_token_ids"][f["row"]][:t]
    else:
        assert d["token_ids"] == d["baseline_token_ids"] and d["first_difference"] is None


def _tie_model(tiny_model_dir, tmp_path):
    """The tiny model made so that tokens a and b are 1-3.5 float32 ulps apart at the first new
    token, with a winner (a) that no rounding can change, on any CPU or BLAS: the final norm keeps
    one hidden component j (the others are multiplied by 0), so every logit is the one rounded
    product ``h_j * w_t[j]`` plus exact zeros, in any summation order; ``w_a[j] = 2 sign(h_j)``
    (an exact product) and ``w_b[j]`` is 3 ulps nearer zero, so ``logit_b`` is at least one ulp
    below ``logit_a``, and every other token's ``|w_t[j]| <= 1`` is far below both. Returns
    ``(folder, a, b, worst)``, ``worst`` the token with the lowest logit."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([tok("the man said to miss bennet").input_ids])
    with torch.no_grad():
        h = m.model(ids).last_hidden_state[0, -1]
        j = int(h.abs().argmax())
        s = 1.0 if float(h[j]) > 0 else -1.0
        keep = torch.zeros_like(m.model.norm.weight)
        keep[j] = 1.0
        m.model.norm.weight.mul_(keep)
        w = m.lm_head.weight
        w[:, j].clamp_(-1.0, 1.0)
        a, b = 7, len(tok) - 1  # any two ids; b is a higher index than a
        w[a, j] = 2.0 * s
        w[b, j] = s * (2.0 - 3 * 2.0 ** -23)  # 3 float32 ulps below 2
        logits = m(ids).logits[0, -1]
        worst = int(logits.argmin())
    assert (int(logits.argmax()) == a
            and 0 < float(logits[a] - logits[b]) <= 4 * float(torch.finfo().eps * logits[a].abs()))
    folder = str(tmp_path / "tie")
    m.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder, a, b, worst


def _swap_first_token(monkeypatch, new_first):
    """Makes our loop emit ``new_first`` as its first new token (a stand-in for a rounding flip)."""
    import vegas_ext

    real = vegas_ext.generate

    def fake(model, ids, mask=None, **kw):
        out = real(model, ids, mask, **kw)
        if kw.get("max_new_tokens", 0) > 2:  # not the warm-up
            out.sequences[:, ids.shape[1]] = new_first
        return out

    monkeypatch.setattr(vegas_ext, "generate", fake)


def test_compare_reports_a_near_tie(tiny_model_dir, tmp_path, capsys, monkeypatch):
    folder, a, b, _ = _tie_model(tiny_model_dir, tmp_path)
    _swap_first_token(monkeypatch, b)
    argv = ["generate", "--model", folder, "--prompt", "the man said to miss bennet", "--max-new-tokens", "6",
            "--ignore-eos", "--compare", "--no-progress"]
    rc, out, err = run_cli(argv + ["--json"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    f = d["first_difference"]
    assert d["identical"] is False and d["baseline_token_ids"][0][0] == a
    assert f["row"] == 0 and f["token"] == 0 and f["ours"] == b and f["baseline"] == a
    # 1-3.5 ulps by construction (see _tie_model); |h| |w| is at least |logit_a|, so < 4 eps units
    assert 1 <= f["ulps"] <= 3.5 and 0 < f["eps_units"] < 4 and f["near_tie"] is True
    assert f["abs_delta_logit"] == pytest.approx(f["logit_baseline"] - f["logit_ours"])
    assert f["tolerance"] == pytest.approx(64 * f["abs_delta_logit"] / f["eps_units"]) and f["eps_bound"] == 64
    rc, out, err = run_cli(argv, capsys)
    line = next(l for l in err.splitlines() if l.startswith("identical"))
    assert re.search(r"differs at token 0 \(near-tie, \|Δlogit\| = \S+ = [0-9.]+ float32 ulp = [0-9.]+ "
                     r"eps·\|h\|·\|w\|, near-tie up to 64\): greedy output equals plain greedy", line), line
    assert "within rounding" in line and "docs/lossless.md" in line


def test_compare_at_real_near_ties(tiny_model_dir, tmp_path, capsys):
    """Case 009 through the CLI: output-layer rows nearly equal (most top-2 gaps within rounding),
    no stand-in: identical, or the first difference is reported as a near-tie within the bound
    (which of the two depends on the CPU; on the Intel AVX-512 machine measured, token 0 differs
    at a gap of 2 ulps = 0.018 units)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        w = m.lm_head.weight
        w.copy_(w[0:1].expand_as(w) * 50 + 2e-6 * torch.randn(w.shape, generator=torch.Generator().manual_seed(3)))
    folder = str(tmp_path / "near-tied")
    m.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    prompt = " ".join(WORDS[(5 * i) % len(WORDS)] for i in range(40))
    rc, out, err = run_cli(["generate", "--model", folder, "--prompt", prompt, "--max-new-tokens", "16",
                            "--num-speculative-tokens", "4", "--gamma-policy", "fixed", "--ignore-eos", "--compare",
                            "--json", "--no-progress"],
                           capsys)
    assert rc == 0, err
    d = json.loads(out)
    assert len(d["token_ids"][0]) == 16
    if not d["identical"]:
        f = d["first_difference"]
        assert f["near_tie"] is True and 0 <= f["eps_units"] <= f["eps_bound"] == 64, f
        assert d["token_ids"][0][:f["token"]] == d["baseline_token_ids"][0][:f["token"]]


def test_compare_reports_a_real_difference(tiny_model_dir, tmp_path, capsys, monkeypatch):
    folder, a, _, worst = _tie_model(tiny_model_dir, tmp_path)
    _swap_first_token(monkeypatch, worst)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    m = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        logits = m(torch.tensor([tok("the man said to miss bennet").input_ids])).logits[0, -1]
    rc, out, err = run_cli(["generate", "--model", folder, "--prompt", "the man said to miss bennet",
                            "--max-new-tokens", "6", "--ignore-eos", "--compare", "--no-progress"], capsys)
    assert rc == 0, err
    line = next(l for l in err.splitlines() if l.startswith("identical"))
    gap = float(logits[a] - logits[worst])
    assert line.startswith("identical            NO: differs at token 0 (|Δlogit| = "), line
    assert "not a near-tie" in line and "lossless violation" in line
    shown = float(line.split("|Δlogit| = ")[1].split(" ")[0])
    assert shown == pytest.approx(gap, rel=1e-3, abs=1e-4)


def test_first_difference_unit():
    rec = cli._ChosenLogits([[5, 6, 7]])
    rec.steps = [[(2.0, 2.0)], [(3.0, 3.0)], [(4.0, 4.0 - 2 * 2.0 ** -21)]]  # step 2: 2 float32 ulps at 4.0
    f = cli.first_difference([[5, 6, 7]], [[5, 6, 9]], rec, torch.float32)
    assert (f["row"], f["token"], f["ours"], f["baseline"]) == (0, 2, 7, 9)
    assert f["ulps"] == pytest.approx(2.0) and f["near_tie"] is True
    f = cli.first_difference([[5, 6, 7]], [[5, 6, 9]], rec, torch.bfloat16)
    assert f["ulps"] == pytest.approx(2 * 2.0 ** -21 / 2.0 ** -5) and f["near_tie"] is True
    # bf16 at 4.0, no |h| |w|: the ulp rule
    assert f["eps_units"] is None and f["tolerance"] == pytest.approx(8 * 2.0 ** -5)
    assert cli.first_difference([[1, 2]], [[1, 2]], rec, torch.float32) is None
    # with the rounding scale |h| max(|w|): the gap over eps * scale decides, not the ulps at the logit
    rec.steps = [[(0.01, 0.01 - 3e-6, 4.0)]]  # 3e-6 is ~320 ulps at 0.01 but 6.3 eps * 4.0
    f = cli.first_difference([[7]], [[9]], rec, torch.float32)
    assert f["ulps"] > 300 and f["eps_units"] == pytest.approx(3e-6 / (2.0 ** -23 * 4.0), rel=1e-6)
    assert f["near_tie"] is True and f["tolerance"] == pytest.approx(64 * 2.0 ** -23 * 4.0)
    rec.steps = [[(0.01, 0.01 - 4e-5, 4.0)]]  # 84 eps units: above the bound
    f = cli.first_difference([[7]], [[9]], rec, torch.float32)
    assert f["near_tie"] is False and f["eps_units"] == pytest.approx(4e-5 / (2.0 ** -23 * 4.0), rel=1e-6)
    assert "not a near-tie" in cli.identical_line(False, f, "float32")
    f = cli.first_difference([[1, 2], [3, 4]], [[1, 2], [3, 5]], None, torch.float32)
    assert (f["row"], f["token"], f["abs_delta_logit"]) == (1, 1, None)  # no recorder: position only
    assert cli.identical_line(True, None, "float32").startswith("yes")
    assert cli.identical_line(None, None, "float32").startswith("n/a")


# ------------------------------------------------------------------------- models / documents

def test_load_model_folder_sets_padding(tiny_model_dir):
    m, tok = models.load_model(tiny_model_dir)
    assert tok.padding_side == "left" and tok.pad_token_id is not None
    assert not m.training and m.dtype == torch.float32
    assert models.last_load_info["how"] == "folder"
    m16, _ = models.load_model(tiny_model_dir, dtype="bfloat16")
    assert m16.dtype == torch.bfloat16


def test_load_model_errors(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        models.load_model(str(tmp_path / "x.gguf"))
    with pytest.raises(ValueError, match="config.json"):
        models.load_model(str(tmp_path))
    with pytest.raises(ValueError, match="unknown model"):
        models.load_model("nobody/nothing-here-123")
    with pytest.raises(ValueError, match="dtype"):
        models.parse_dtype("float8")


def test_gguf_cache_path_uses_env(tmp_path, monkeypatch):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x" * 10)
    monkeypatch.setenv("VEGAS_CACHE_DIR", str(tmp_path / "cache"))
    p = models.gguf_cache_path(str(f))
    assert p.startswith(str(tmp_path / "cache")) and os.path.basename(p).startswith("m-")
    f.write_bytes(b"x" * 11)
    assert models.gguf_cache_path(str(f)) != p  # new content -> new entry


def test_gguf_cache_reuses_a_conversion_of_the_same_content_under_another_name(tmp_path, monkeypatch):
    """A renamed copy of a GGUF file finds the finished conversion of its content; an unfinished
    one, a folder that is not ours or a symlink are not taken, and other content gets its own."""
    monkeypatch.setenv("VEGAS_CACHE_DIR", str(tmp_path / "cache"))
    a, b = tmp_path / "m.gguf", tmp_path / "renamed.gguf"
    for f in (a, b):
        f.write_bytes(b"GGUF" + bytes(range(256)) * 10)
    p = models.gguf_cache_path(str(a))
    own_b = models.gguf_cache_path(str(b))
    assert os.path.basename(own_b).startswith("renamed-") and own_b[-16:] == p[-16:]  # not yet converted
    os.makedirs(p)
    for name in ("config.json", "tokenizer_config.json"):
        (tmp_path / "cache" / os.path.basename(p) / name).write_text("{}")
    assert models.gguf_cache_path(str(b)) == own_b  # no SOURCE.txt: not one of our conversions
    (tmp_path / "cache" / os.path.basename(p) / "SOURCE.txt").write_text("converted")
    assert models.gguf_cache_path(str(b)) == p and not models.needs_conversion(str(b))
    b.write_bytes(b"GGUF" + bytes(range(255, -1, -1)) * 10)
    assert models.gguf_cache_path(str(b)) != p


def test_gguf_cache_keys_on_content_and_prunes_stale_copies(tmp_path, monkeypatch):
    """A reinstalled copy of the same GGUF file (new mtime, new path) reuses its conversion; new
    bytes of the same size do not; a conversion deletes same-name copies unused for
    CACHE_KEEP_DAYS and keeps recent ones and other names."""
    monkeypatch.setenv("VEGAS_CACHE_DIR", str(tmp_path / "cache"))
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for f in (a, b):
        f.parent.mkdir()
        f.write_bytes(b"GGUF" + bytes(range(256)) * 10)
    os.utime(b, (1e9, 1e9))
    p = models.gguf_cache_path(str(a))
    assert models.gguf_cache_path(str(b)) == p
    b.write_bytes(b"GGUF" + bytes(range(255, -1, -1)) * 10)  # same size, other bytes
    assert models.gguf_cache_path(str(b)) != p
    root = tmp_path / "cache"
    old, recent, other, odd, old_tmp, tmp = (root / n for n in (
        "m-0123456789abcdef", "m-fedcba9876543210", "n-0123456789abcdef", "m-notahash",
        "m-0123456789abcdef.tmp-k1ll3d", "m-fedcba9876543210.tmp-4ctive"))
    users = root / "m-00000000000000aa"  # named like a conversion, but no SOURCE.txt: not ours
    link = root / "m-00000000000000bb"  # a symlink to a conversion elsewhere
    elsewhere = tmp_path / "elsewhere" / "m-0123456789abcdef"  # beside an out_dir of the caller's
    for d in (old, recent, other, odd, old_tmp, tmp, users, elsewhere):
        d.mkdir(parents=True)
        (d / "SOURCE.txt").write_text("converted") if d is not users else (d / "data.txt").write_text("mine")
    link.symlink_to(old_tmp)
    stale = time.time() - (models.CACHE_KEEP_DAYS + 1) * 86400
    for d in (old, other, odd, old_tmp, users, elsewhere):
        os.utime(d, (stale, stale))
    os.utime(link, (stale, stale), follow_symlinks=False)
    models._prune_stale(str(elsewhere.parent / "m-fedcba9876543210"), "m")  # out_dir outside the root
    assert elsewhere.exists()
    models._prune_stale(p, "m")
    assert not old.exists() and not old_tmp.exists() and link.is_symlink()
    assert recent.exists() and other.exists() and odd.exists() and tmp.exists() and users.exists()


def test_gguf_digest_memo_damaged_or_cache_unwritable(tmp_path, monkeypatch):
    """A damaged remembered hash is computed again (not trusted, not an error); a cache root that
    cannot be written is named before the ~20 s conversion, with what to do."""
    monkeypatch.setenv("VEGAS_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" * 100)
    p = models.gguf_cache_path(str(f))
    (memo,) = (tmp_path / "cache" / ".digests").iterdir()
    for junk in (b"\xff" * 64, b"z" * 64, b"A" * 64, b""):
        memo.write_bytes(junk)
        assert models.gguf_cache_path(str(f)) == p
    monkeypatch.setenv("VEGAS_CACHE_DIR", str(f))  # a file, not a folder
    with pytest.raises(ValueError, match="model cache folder .* VEGAS_CACHE_DIR"):
        models.load_model(str(f))


def test_unreadable_gguf_is_one_line_error(tmp_path, monkeypatch):
    """Reading the file for its cache key fails (an I/O error, no permission): one ValueError line
    naming the file, not an OSError traceback; needs_conversion leaves the telling to load_model."""
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    monkeypatch.setenv("VEGAS_CACHE_DIR", str(tmp_path / "cache"))

    def unreadable(path):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(models, "_content_digest", unreadable)
    with pytest.raises(ValueError, match=rf"^cannot read the GGUF file {re.escape(str(f))}: .*Input/output error"):
        models.load_model(str(f))
    assert models.needs_conversion(str(f)) is False


def test_documents_exact_prompt_lengths(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert set(documents.list_documents()) >= {"pride_and_prejudice", "kjv", "python_docs"}
    for name in documents.list_documents():
        text = documents.load_document(name)
        assert len(text) > 100_000, name
        for n in (40, 80):
            assert len(documents.make_prompt_ids(tok, name, n)) == n
            assert len(documents.make_prompt_ids(tok, name, n, chat=True)) == n
    assert documents.default_prompt().rstrip().endswith(documents.default_instruction())
    with pytest.raises(ValueError):
        documents.load_document("nope")


# ------------------------------------------------------------------------------- slow: real

@pytest.mark.slow
def test_embedded_model_loads_from_cache_and_default_document_is_long():
    path = models.default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    m, tok = models.load_model()  # converts once (~20 s) if the cache is cold
    m2, _ = models.load_model()
    assert models.last_load_info["how"] == "cache"
    assert type(m).__name__ == "LlamaForCausalLM" and m.config.max_position_embeddings == 8192
    n = len(tok(documents.default_prompt()).input_ids)
    assert 6000 <= n < 8192 - 512, n
    for name in documents.list_documents():
        assert len(documents.make_prompt_ids(tok, name, 8000)) == 8000


@pytest.mark.slow
def test_default_run_is_identical_to_hf(capsys):
    """`vegas generate --compare` on the embedded model and document: lossless."""
    rc, out, err = run_cli(["generate", "--max-new-tokens", "8", "--chat", "--compare", "--json",
                            "--no-progress"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    assert d["prompt_lengths"] == [7182]  # the embedded document (7,128 tokens) + instruction + chat template
    # identical on the machines measured; where rounding decides (a near-tie) the CPU may differ
    assert d["identical"] is True or d["first_difference"]["near_tie"] is True, d["first_difference"]

# ------------------------------------------------------------------------------------ --draft-weights
def test_draft_weights_and_compare_with_our_plain_loop(tiny_model_dir, capsys):
    """--draft-weights int8 stays lossless; --compare also times our own plain loop ("full") and
    reports both ratios; the stats say how many iterations drafted and what the copy weighs."""
    base = ["generate", "--model", tiny_model_dir, "--prompt", "the man said to miss bennet", "--max-new-tokens", "10",
            "--num-speculative-tokens", "3", "--gamma-policy", "fixed", "--block-size", "4", "--min-tokens", "4",
            "--ignore-eos", "--compare",
            "--no-progress", "--draft-weights", "int8"]
    rc, out, err = run_cli(base + ["--json"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    assert d["identical"] is True and d["plain_identical"] is True and d["draft_weights"] == "int8"
    assert d["speedup_vs_plain"] > 0 and d["plain_tokens_per_s"] > 0 and d["plain_time_s"] > 0
    assert d["stats"]["draft_weights_bytes"] > 0 and d["stats"]["draft_weights_format"] == "int8-g64"
    rc, out, err = run_cli(base, capsys)
    assert rc == 0, err
    assert re.search(r"speculated +\d+ of \d+ iterations drafted", err), err
    assert re.search(r"draft weights +int8-g64: a copy of [\d.]+ MiB", err), err
    assert re.search(r"speedup \(vegas\) +[\d.]+x end to end.* vs our plain loop; [\d.]+x vs HF generate", err), err


def test_draft_weights_int4_is_refused_in_one_line(tiny_model_dir, capsys):
    rc, out, err = run_cli(["generate", "--model", tiny_model_dir, "--prompt", "the man", "--max-new-tokens", "3",
                            "--no-progress", "--draft-weights", "int4"], capsys)
    line = _assert_one_line_error(rc, out, err)
    assert "int4" in line and "60-61 %" in line


def test_help_offers_only_choices_that_work():
    """Every value --help lists for a flag passes the checks: --draft-weights offered int4, refused
    only after torch and the model had loaded."""
    import argparse

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["generate"]
    with_choices = [a for a in sub._actions if a.choices]
    assert {a.option_strings[0] for a in with_choices} >= {"--draft-weights", "--query-weights"}
    for action in with_choices:
        for value in action.choices:
            cli._validate(parser.parse_args(["generate", action.option_strings[0], value]))
    dw = next(a for a in with_choices if a.option_strings[0] == "--draft-weights")
    assert tuple(dw.choices) == ("none", "fp16", "int8")
    assert "int4" not in sub.format_help()


def test_bad_choices_and_model_paths_fail_before_torch_loads(tmp_path):
    """A refused or unknown --draft-weights and a --model path that cannot be a model answer at
    argument checking, naming the flag, with torch never imported (they took 30-40 s: the model
    loaded first)."""
    (tmp_path / "notes.txt").write_text("not a model")
    probe = ("import sys, vegas_ext_cli\n"
             "for argv in sys.argv[1:]:\n"
             "    try:\n        rc = vegas_ext_cli.main(argv.split('|'))\n    except SystemExit as e:\n"
             "        rc = e.code\n    print('RC', rc, file=sys.stderr)\n"
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    cases = {
        "generate|--draft-weights|int4": ["--draft-weights", "'int4' is not supported", "60-61 %"],
        "generate|--draft-weights|int3": ["--draft-weights", "invalid choice: 'int3'", "'none', 'fp16', 'int8')"],
        f"generate|--model|{tmp_path}/no-such-folder": ["--model", "not found", "no-such-folder"],
        f"generate|--model|{tmp_path}/notes.txt": ["--model", "not a .gguf file"],
        f"generate|--model|{tmp_path}/none.gguf": ["--model", "not found"],
        f"generate|--model|{tmp_path}": ["--model", "no config.json"],
    }
    r = subprocess.run([sys.executable, "-c", probe, *cases], capture_output=True, text=True,
                       env=_subprocess_env(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout  # nothing heavy was imported
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 * len(cases), r.stderr
    for (argv, needles), err, rc in zip(cases.items(), lines[::2], lines[1::2]):
        assert rc == "RC 2" and err.startswith("vegas: error: "), (argv, err, rc)
        assert all(n in err for n in needles), (argv, err)


def _corrupt(folder, name: str, how: str) -> None:
    path = os.path.join(folder, name)
    if how == "truncate":
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
    elif how == "garbage":
        with open(path, "wb") as f:
            f.write(b"\x00garbage" * 50)
    elif how == "empty":
        open(path, "wb").close()
    elif how == "drop_weight":  # a checkpoint without one tensor: transformers fills it with random values
        from safetensors.torch import load_file, save_file

        t = load_file(path)
        t.pop("model.layers.0.mlp.down_proj.weight")
        save_file(t, path, metadata={"format": "pt"})


@pytest.mark.parametrize("name,how,needle", [
    ("model.safetensors", "garbage", "SafetensorError"),
    ("model.safetensors", "truncate", "SafetensorError"),
    ("model.safetensors", "empty", "SafetensorError"),
    ("model.safetensors", "drop_weight", "lacks 1 weight(s) the model needs (model.layers.0.mlp.down_proj.weight)"),
    ("config.json", "garbage", "config"),
    ("tokenizer.json", "truncate", "JSONDecodeError"),
    ("tokenizer_config.json", "garbage", "JSONDecodeError"),
])
def test_corrupt_model_folder_is_one_line_error(tiny_model_dir, tmp_path, capsys, name, how, needle):
    """Any unreadable file of a model folder: `vegas: error:` naming the folder, the cause and what
    to do, exit status 2 (a corrupt model.safetensors gave a traceback and exit 1)."""
    import shutil

    folder = str(tmp_path / "model")
    shutil.copytree(tiny_model_dir, folder)
    _corrupt(folder, name, how)
    rc, out, err = run_cli(["generate", "--model", folder, "--prompt", "the man", "--max-new-tokens", "2",
                            "--no-progress"], capsys)
    line = _assert_one_line_error(rc, out, err)
    assert rc == 2 and f"cannot load the model folder {folder}: " in line and needle in line, line
    assert "download or save the model again" in line, line
    with pytest.raises(ValueError, match="^cannot load the model folder"):  # the library says the same
        models.load_model(folder)


@pytest.mark.parametrize("how", ["garbage", "truncate_header", "truncate", "empty"])
def test_corrupt_gguf_file_is_one_line_error(tmp_path, capsys, monkeypatch, how):
    """A GGUF file that cannot be read or converted (struct.error, numpy's reshape ValueError, ...)."""
    monkeypatch.setenv("VEGAS_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "broken.gguf"
    with open(models.default_model_path(), "rb") as f:
        data = f.read(1 << 20 if how == "truncate" else 64)
    path.write_bytes({"garbage": b"GARBAGE!" * 100, "truncate_header": data[:64], "truncate": data,
                      "empty": b""}[how])
    rc, out, err = run_cli(["generate", "--model", str(path), "--prompt", "hi", "--max-new-tokens", "2",
                            "--no-progress"], capsys)
    line = _assert_one_line_error(rc, out, err)
    assert rc == 2 and f"cannot read the GGUF file {path}: " in line and "download it again" in line, line
    cache = tmp_path / "cache"  # nothing half-cached (.digests: the files' remembered hashes)
    assert not [e for e in os.listdir(cache) if e != ".digests"] if cache.exists() else True


def test_corrupt_gguf_conversion_cache_names_the_folder_to_delete(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """A damaged cached conversion of a GGUF file: the error says which folder to delete."""
    import shutil

    monkeypatch.setenv("VEGAS_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF not read: the cache is complete")
    cached = models.gguf_cache_path(str(gguf))
    shutil.copytree(tiny_model_dir, cached)
    _corrupt(cached, "model.safetensors", "truncate")
    rc, out, err = run_cli(["generate", "--model", str(gguf), "--prompt", "hi", "--no-progress"], capsys)
    line = _assert_one_line_error(rc, out, err)
    assert f"cached in {cached}" in line and "delete that folder" in line, line


@pytest.mark.parametrize("options", [{"repetition_penalty": 3.0}, {"suppress_tokens": list(range(10, 20))},
                                     {"no_repeat_ngram_size": 1}])
def test_compare_baseline_ignores_the_models_generation_config_processors(tiny_model_dir, tmp_path, capsys, options):
    """Regression (break test): HF fills options left at their defaults from the model's
    generation_config, so a saved repetition penalty / suppressed tokens turned --compare's
    "plain greedy" baseline into something else (a false "lossless violation", or a crash on a
    -inf logit). The baseline is plain greedy decoding, as the loop decodes; the loop warns."""
    import shutil

    from transformers import GenerationConfig

    folder = str(tmp_path / "with-gc")
    shutil.copytree(tiny_model_dir, folder)
    GenerationConfig(**options).save_pretrained(folder)
    with pytest.warns(UserWarning, match="generation_config sets"):
        rc, out, err = run_cli(["generate", "--model", folder, "--prompt", "the house of mr bennet said",
                                "--max-new-tokens", "12", "--num-speculative-tokens", "2", "--gamma-policy", "fixed",
                                "--ignore-eos",
                                "--compare", "--no-progress", "--json"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    assert d["identical"] is True and d["plain_identical"] is True, d.get("first_difference")


def test_busy_machine_note(monkeypatch):
    """The report warns when other jobs loaded the CPU (speeds of sequential runs not comparable)."""
    from vegas_ext.cli import report

    n = os.cpu_count() or 1
    monkeypatch.setattr(os, "getloadavg", lambda: (n + 2.0, 0.0, 0.0))
    note = report.busy_note()
    assert note.startswith(f"note: load average {n + 2.0:.1f} on {n} cores") and "idle machine" in note
    monkeypatch.setattr(os, "getloadavg", lambda: (float(n), 0.0, 0.0))
    assert report.busy_note() is None

    def no_load():
        raise OSError("no load average")

    monkeypatch.setattr(os, "getloadavg", no_load)
    assert report.busy_note() is None


def test_busy_machine_note_counts_other_processes_during_the_runs(monkeypatch):
    """With a snapshot from before the runs the note counts what other processes used while they
    ran (all CPUs' busy time minus our own), not the load average, which also remembers work that
    ended before (a new user's report: the note after the test suite had just finished)."""
    from vegas_ext.cli import report

    n = os.cpu_count() or 1
    monkeypatch.setattr(os, "getloadavg", lambda: (n + 5.0, 0.0, 0.0))  # left over: ignored
    snaps = iter([(100.0, 50.0, 10.0), (110.0, 62.0, 7.0 + 10.0)])  # 10 s: 12 s busy, 7 s ours
    monkeypatch.setattr(report, "cpu_snapshot", lambda: next(snaps))
    assert report.busy_note([report.cpu_snapshot()]) is None  # others: 0.5 cores on average
    snaps = iter([(100.0, 50.0, 10.0), (110.0, 70.0, 17.0)])  # others: 1.3 cores
    note = report.busy_note([report.cpu_snapshot()])
    assert note.startswith(f"note: other processes used 1.3 of {n} cores") and "idle machine" in note
    # three runs: the load in one of them shows, though the average over all is 0.4 cores
    snaps = iter([(0.0, 0.0, 0.0), (10.0, 10.0, 10.0), (20.0, 32.0, 20.0), (30.0, 42.0, 30.0)])
    marks = [report.cpu_snapshot() for _ in range(3)]
    assert report.busy_note(marks).startswith("note: other processes used 1.2 of")


def test_json_reports_other_processes_cores(tiny_model_dir, capsys):
    rc, out, err = run_cli(["generate", "--model", tiny_model_dir, "--prompt", "the day", "--max-new-tokens", "3",
                            "--json", "--no-progress"], capsys)
    assert rc == 0, err
    v = json.loads(out)["other_processes_cores"]  # None also for a run too short to measure (< 50 ms)
    assert v is None or (isinstance(v, float) and v >= 0.0), v


def test_cpu_snapshot_reads_proc_stat():
    from vegas_ext.cli import report

    a = report.cpu_snapshot()
    if not os.path.exists("/proc/stat"):
        assert a is None
        return
    # os.times() counts in clock ticks (10 ms): spin until one passes, bounded so a bug cannot hang
    b = report.cpu_snapshot()
    while b[2] <= a[2] and b[0] - a[0] < 5.0:
        sum(i * i for i in range(20_000))
        b = report.cpu_snapshot()
    assert b[0] > a[0] and b[1] >= a[1] and b[2] > a[2]
