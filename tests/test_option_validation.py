"""One validation of every option (vegas_ext.config) for generate(), the CLI and the vLLM options:
each bad value gets an error naming the argument and what was expected, before any heavy work;
types are checked, not coerced (handed case 010)."""
import io
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import vegas_ext
from vegas_ext import cli, config, decode
from vegas_ext.vllm import VegasOptions, speculative_config

from decode_utils import make_model, make_prompts


@pytest.fixture(scope="module")
def case():
    model = make_model("llama")
    ids, mask = make_prompts(256, [20, 12])
    return model, ids, mask


def _gen(case, **kw):
    model, ids, mask = case
    mask = kw.pop("attention_mask", mask)
    ids = kw.pop("input_ids", ids)
    kw.setdefault("max_new_tokens", 3)
    return vegas_ext.generate(model, ids, mask, **kw)


# ------------------------------------------------------------------ case 010, the API: each item
NAN = float("nan")
TYPE, RANGE = TypeError, ValueError
API_CASES = {
    # errors that did not name the argument
    "max_tokens_nan": (dict(sparse_attn_max_tokens=NAN), TYPE, "sparse_attn_max_tokens"),
    "min_tokens_nan": (dict(sparse_attn_min_tokens=NAN), TYPE, "sparse_attn_min_tokens"),
    "min_tokens_huge": (dict(sparse_attn_min_tokens=10**30), RANGE, "sparse_attn_min_tokens"),
    "max_tokens_huge": (dict(sparse_attn_max_tokens=10**30), RANGE, "sparse_attn_max_tokens"),
    "eos_huge": (dict(eos_token_id=2**70), RANGE, "eos_token_id"),
    "pad_huge": (dict(pad_token_id=2**70), RANGE, "pad_token_id"),
    "sinks_huge": (dict(num_sink_blocks=2**63), RANGE, "num_sink_blocks"),
    "mask_list": (dict(attention_mask="tolist"), TYPE, "attention_mask"),
    "prefill_cache_foreign": (dict(prefill_cache={"ids": 5}), TYPE, r"prefill_cache\['ids'\]"),
    # accepted silently before
    "share_no": (dict(share_selection_across_heads="no"), TYPE, "share_selection_across_heads"),
    "max_new_true": (dict(max_new_tokens=True), TYPE, "max_new_tokens"),
    "top_k_float": (dict(top_k=1.5), TYPE, "top_k"),
    "ratio_str": (dict(sparse_attn_ratio="0.5"), TYPE, "sparse_attn_ratio"),
    "eos_float_tensor": (dict(eos_token_id=torch.tensor([2.7])), TYPE, "eos_token_id"),
}


@pytest.mark.parametrize("name", sorted(API_CASES))
def test_case_010_api(case, name):
    kw, kind, needle = API_CASES[name]
    if kw.get("attention_mask") == "tolist":
        kw = dict(kw, attention_mask=case[2].tolist())
    with pytest.raises(kind, match=needle) as e:
        _gen(case, **kw)
    assert isinstance(e.value, ValueError)  # type errors are ValueErrors too (callers catch those)
    assert str(e.value).startswith(needle.replace("\\", "")), str(e.value)


def test_case_010_eos_numpy_array_is_a_list_of_ids(case):
    """A 1-D integer array is taken as the list of its ids, deliberately."""
    want = _gen(case, eos_token_id=[2, 3], max_new_tokens=4).sequences
    assert torch.equal(_gen(case, eos_token_id=np.array([2, 3]), max_new_tokens=4).sequences, want)
    assert torch.equal(_gen(case, eos_token_id=torch.tensor([2, 3]), max_new_tokens=4).sequences, want)
    with pytest.raises(TypeError, match="eos_token_id"):
        _gen(case, eos_token_id=np.array([[2, 3]]))


def test_case_010_token_ids_beyond_the_vocabulary(case):
    model, ids, mask = case
    bad = ids.clone()
    bad[0, -1] = model.config.vocab_size
    with pytest.raises(ValueError, match=r"input_ids must be token ids in \[0, 256\).*got 256"):
        _gen(case, input_ids=bad)
    bad[0, -1] = -1
    with pytest.raises(ValueError, match="input_ids.*got -1"):
        _gen(case, input_ids=bad)
    ok = ids.clone()
    ok[1, 0] = 10**6  # under the padding: never embedded
    assert torch.equal(_gen(case, input_ids=ok).sequences[:, ids.shape[1]:], _gen(case).sequences[:, ids.shape[1]:])


def test_case_010_float64_model_refused_before_the_prefill():
    model = make_model("llama").double()
    ids, mask = make_prompts(256, [20, 12])
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match="model dtype float64 is not supported"):
        vegas_ext.generate(model, ids, mask, max_new_tokens=3)
    assert calls == []  # no forward ran


# ------------------------------------------------------------------ the whole kind, from the table
INT_OPTIONS = [n for n, o in config.OPTIONS.items() if o.kind in ("int", "gamma")]
FLOAT_OPTIONS = [n for n, o in config.OPTIONS.items() if o.kind == "float"]
BOOL_OPTIONS = [n for n, o in config.OPTIONS.items() if o.kind == "bool"]


@pytest.mark.parametrize("name", INT_OPTIONS)
@pytest.mark.parametrize("value, kind", [(True, TYPE), (2.0, TYPE), ("3", TYPE), (NAN, TYPE),
                                         (torch.tensor(3.0), TYPE), (np.float64(3), TYPE), (2**64, RANGE),
                                         (-(2**64), RANGE)])
def test_every_integer_option_checks_type_and_int64(case, name, value, kind):
    with pytest.raises(kind, match=f"^{name} must be"):
        _gen(case, **{name: value})


@pytest.mark.parametrize("name", FLOAT_OPTIONS)
@pytest.mark.parametrize("value, kind", [(NAN, RANGE), (math.inf, RANGE), (-math.inf, RANGE), ("0.5", TYPE),
                                         (True, TYPE), (None, TYPE), (torch.ones(2), TYPE)])
def test_every_float_option_checks_type_and_finiteness(case, name, value, kind):
    with pytest.raises(kind, match=f"^{name} must be a finite number"):
        _gen(case, do_sample=True, **{name: value})


@pytest.mark.parametrize("name", BOOL_OPTIONS)
@pytest.mark.parametrize("value", ["no", "False", 0, 1, None, np.bool_(True)])
def test_every_bool_option_takes_only_true_or_false(case, name, value):
    with pytest.raises(TypeError, match=f"^{name} must be True or False"):
        _gen(case, **{name: value})


def test_exact_integers_of_numpy_and_torch_are_accepted(case):
    want = _gen(case, max_new_tokens=4, top_k=0, num_speculative_tokens=2, gamma_policy="fixed")
    for conv in (np.int64, np.int32, torch.tensor):
        out = _gen(case, max_new_tokens=conv(4), top_k=conv(0), num_speculative_tokens=conv(2), gamma_policy="fixed",
                   num_sink_blocks=conv(1), sparse_attn_min_tokens=conv(256))
        assert torch.equal(out.sequences, want.sequences)
        assert out.stats["max_new_tokens"] == 4 and type(out.stats["top_k"]) is int


def test_int32_bounds_where_the_kernels_take_int32(case):
    top = 2**31 - 1  # the largest accepted values run (budget covers everything: exact drafting)
    out = _gen(case, sparse_attn_min_tokens=top, num_sink_blocks=top, eos_token_id=[])
    assert torch.equal(out.sequences, _gen(case, sparse_attn_algorithm="full", eos_token_id=[]).sequences)
    for name in ("sparse_attn_min_tokens", "num_sink_blocks"):
        with pytest.raises(ValueError, match=rf"^{name} must be an integer in \[0, 2\*\*31 - 1\], got 2147483648"):
            _gen(case, **{name: top + 1})


def test_unknown_algorithm_lists_the_registry(case):
    with pytest.raises(ValueError, match="sparse_attn_algorithm must be one of .*'vegas'.*got 'magic'"):
        _gen(case, sparse_attn_algorithm="magic")


# ------------------------------------------------------------------ fuzz: a clear error or success
class _Reached(Exception):
    """Raised in place of the prefill: every check passed."""


_ANY = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-3, 40),
                 st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(["auto", "vegas", "0.5", "no", "all"]),
                 st.lists(st.integers(0, 300), max_size=2))
_FUZZED = [n for n in config.LOOP_OPTIONS if n not in ("return_cache", "draft_weights")]
_FUZZED += ["eos_token_id", "pad_token_id"]


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.dictionaries(st.sampled_from(_FUZZED), _ANY, min_size=1, max_size=4))
def test_fuzz_generate_options(case, monkeypatch, kw):
    monkeypatch.setattr(decode, "prefill", _stop)
    try:
        _gen(case, **kw)
    except _Reached:  # accepted: then each value had an accepted type
        for k, v in kw.items():
            o = config.OPTIONS.get(k)
            kind = o.kind if o else "ids"
            if kind in ("int", "ids") and v is not None:
                assert isinstance(v, (int, list)) and not isinstance(v, bool), (k, v)
            if kind == "float":
                assert isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), (k, v)
            if kind == "bool":
                assert isinstance(v, bool), (k, v)
    except (TypeError, ValueError) as e:  # a clear error: it starts with one of the options given
        msg = str(e)
        assert any(msg.startswith(k + " ") or msg.startswith(k + "[") or msg.startswith(f"model.{k}")
                   for k in kw), (kw, msg)


def _stop(*a, **k):
    raise _Reached


# ------------------------------------------------------------------ the vLLM options, same checks
@pytest.mark.parametrize("kw, needle", [
    (dict(sparse_attn_min_tokens=NAN), "sparse_attn_min_tokens"),
    (dict(sparse_attn_min_tokens=10**30), "sparse_attn_min_tokens"),
    (dict(sparse_attn_ratio="0.5"), "sparse_attn_ratio"),
    (dict(sparse_attn_ratio=True), "sparse_attn_ratio"),
    (dict(num_sink_pages=2**63), "num_sink_pages"),
    (dict(num_sink_pages=1.0), "num_sink_pages"),
    (dict(num_speculative_tokens=2**64), "num_speculative_tokens"),
    (dict(num_speculative_tokens=np.float64(4)), "num_speculative_tokens"),
])
def test_vllm_options_share_the_checks(kw, needle):
    with pytest.raises(ValueError, match=f"^vegas_ext.vllm: {needle} must be"):
        speculative_config(**kw)


def test_vllm_budget_is_the_loop_budget():
    from vegas_ext.selection import SelectionConfig, budget_blocks

    lens = torch.tensor([1, 100, 999, 5000, 8000, 123457])
    for ratio, mn, mx, bs in [(0.05, 256, None, 32), (0.1, 0, 300, 16), (1.0, 1, None, 1), (0.3, 7, 9, 5)]:
        o = VegasOptions(sparse_attn_ratio=ratio, sparse_attn_min_tokens=mn, sparse_attn_max_tokens=mx)
        loop = budget_blocks(lens, SelectionConfig(ratio=ratio, min_tokens=mn, max_tokens=mx, block_size=bs))
        assert loop.dtype == torch.int32
        assert loop.tolist() == [o.budget_pages(int(n), bs) for n in lens]


def test_lists_are_defined_once():
    from vegas_ext import attention, selection
    from vegas_ext.vllm import options

    assert attention.SUPPORTED_MODEL_TYPES is config.SUPPORTED_MODEL_TYPES is options.SUPPORTED_MODEL_TYPES
    assert cli.ALGORITHMS is config.ALGORITHMS and options.ALGORITHMS is config.VLLM_ALGORITHMS
    public = {n: c for n, c in selection.SELECTION_ALGORITHMS.items() if not n.startswith("_")}
    assert sorted(public) == sorted(config.ALGORITHMS)
    assert {n: c.default_block_size for n, c in public.items()} == dict(config.DEFAULT_BLOCK_SIZE)
    assert set(config.VLLM_ALGORITHMS) <= set(config.ALGORITHMS)


def test_config_imports_only_the_standard_library():
    # the console script's way in (vegas_ext_cli): `import vegas_ext` itself loads torch and the ops
    code = ("import sys, vegas_ext_cli; vegas_ext_cli._load_cli(); assert 'vegas_ext.config' in sys.modules; "
            "print(sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)


# ------------------------------------------------------------------ case 010, the CLI: each item
def _env():
    src = os.path.dirname(os.path.dirname(os.path.abspath(config.__file__)))
    return dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""), HF_HUB_OFFLINE="1")


_NO_MODEL = ["--model", "/nonexistent/vegas-test-model"]  # never reached when the flags are checked first
CLI_CASES = {
    "seed_huge": (["--seed", "99999999999999999999999", "--do-sample"], "--seed must be an integer"),
    "min_tokens_huge": (["--min-tokens", "99999999999999999999"], "--min-tokens must be an integer"),
    "max_tokens_huge": (["--max-tokens", "99999999999999999999"], "--max-tokens must be an integer"),
    "max_new_tokens_huge": (["--max-new-tokens", "99999999999999999999"], "--max-new-tokens must be an integer"),
    "sink_blocks_huge": (["--sink-blocks", "99999999999999999999"], "--sink-blocks must be an integer"),
    "gamma_huge": (["--num-speculative-tokens", "99999999999999999999", "--gamma-policy", "fixed"],
                   "--num-speculative-tokens must be an integer"),
    "block_size_huge": (["--block-size", "99999999999999999999"], "--block-size must be an integer"),
    "refresh_huge": (["--refresh-interval", "99999999999999999999"], "--refresh-interval must be an integer"),
    "top_k_huge": (["--top-k", "99999999999999999999"], "--top-k must be an integer"),
    "batch_huge": (["--batch-size", "99999999999999999999"], "--batch-size must be an integer"),
    "temperature_inf": (["--do-sample", "--temperature", "inf"], "--temperature must be a finite number >= 1e-05"),
    "temperature_tiny": (["--do-sample", "--temperature", "1e-40"], "--temperature must be a finite number >= 1e-05"),
    "gamma_underscore": (["--gamma", "1_0"], "--num-speculative-tokens must be an integer"),
    "num_spec_underscore": (["--num-speculative-tokens", "1_0"], "--num-speculative-tokens must be an integer"),
    "num_spec_spaces": (["--num-speculative-tokens", " 4 "], "--num-speculative-tokens must be an integer"),
    "top_k_underscore": (["--top-k", "1_0"], "argument --top-k: must be an integer, got '1_0'"),
    "max_new_arabic_digits": (["--max-new-tokens", "\u0661\u0660"], "argument --max-new-tokens: must be an integer"),
    "seed_spaces": (["--seed", " 5"], "argument --seed: must be an integer"),
    "ratio_inf": (["--ratio", "inf"], "--ratio must be a finite number"),
    "max_below_min": (["--max-tokens", "10"], "--max-tokens must be an integer >= max(1, --min-tokens) = 256"),
}


def _run_cli(argv, capsys):
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line_error(rc, out, err):
    assert rc == 2 and out == "", (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vegas: error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("name", sorted(CLI_CASES))
def test_case_010_cli_numbers(name, capsys):
    flags, needle = CLI_CASES[name]
    rc, out, err = _run_cli(["generate", "--prompt", "hi", *_NO_MODEL, *flags], capsys)
    assert needle in _one_line_error(rc, out, err)


def test_case_010_cli_prompt_file_is_a_directory(tmp_path, capsys):
    rc, out, err = _run_cli(["generate", "--prompt-file", str(tmp_path), *_NO_MODEL], capsys)
    assert "is a directory" in _one_line_error(rc, out, err)


def test_case_010_cli_non_utf8_stdin(monkeypatch, capsys):
    stdin = io.TextIOWrapper(io.BytesIO(b"caf\xe9 \xff\xfe"), encoding="latin-1")
    monkeypatch.setattr(sys, "stdin", stdin)
    rc, out, err = _run_cli(["generate", "--prompt-file", "-", *_NO_MODEL], capsys)
    assert "stdin is not UTF-8 text" in _one_line_error(rc, out, err)


def test_case_010_cli_stdin_real_process(tmp_path):
    """The real process: bytes on stdin, one error line, exit 2; UTF-8 with CRLF reads as text mode did."""
    argv = [sys.executable, "-m", "vegas_ext", "generate", "--prompt-file", "-", *_NO_MODEL]
    r = subprocess.run(argv, input=b"\xff\xfe\x00bad", capture_output=True, env=_env(), timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("vegas: error: --prompt-file -: stdin is not UTF-8 text"), err
    monkey = io.TextIOWrapper(io.BytesIO("a\r\nb \u00e9\n".encode()), encoding="utf-8")
    old, sys.stdin = sys.stdin, monkey
    try:
        assert cli._read_stdin() == "a\nb \u00e9\n"
    finally:
        sys.stdin = old


# ------------------------------------------------------------------ robustness: model, mask, CLI input
@pytest.mark.parametrize("what", ["none", "str", "base_model"])
def test_generate_names_model_when_it_is_not_a_causal_lm(case, what):
    model = {"none": None, "str": "HuggingFaceTB/SmolLM2-135M", "base_model": case[0].model}[what]
    with pytest.raises(ValueError, match=r"^model must be a Hugging Face causal LM \(\*ForCausalLM\) of a "
                                         r"supported type \(llama, qwen2, qwen3, mistral\)") as e:
        _gen((model, case[1], case[2]))
    assert isinstance(e.value, TypeError) == (what != "base_model")  # not a module at all: a type error


@pytest.mark.parametrize("max_new_tokens", [0, 2])
def test_generate_refuses_an_unsupported_model_even_for_zero_new_tokens(case, max_new_tokens):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256, n_positions=64,
                                      bos_token_id=1, eos_token_id=2)).eval()
    with pytest.raises(ValueError, match=r"^model must be .*got GPT2LMHeadModel \(model_type='gpt2'\)"):
        _gen((gpt2, case[1], case[2]), max_new_tokens=max_new_tokens)
    assert _gen(case, max_new_tokens=0).sequences.shape == case[1].shape  # a supported one still returns


@pytest.mark.parametrize("bad", [float("nan"), 2, 0.5, -1, float("inf")])
def test_attention_mask_values_must_be_0_or_1(case, bad):
    mask = case[2].double()
    mask[0, -1] = bad  # in the prompt's ones: 2 made a row longer than the input, NaN a huge index
    with pytest.raises(ValueError, match=r"^attention_mask values must be 0 or 1"):
        _gen(case, attention_mask=mask)
    mask = case[2].clone()
    mask[1, 0] = 1  # 0/1 but not left padding: still said so
    with pytest.raises(ValueError, match="^attention_mask must be left padding"):
        _gen(case, attention_mask=mask)


def test_attention_masks_of_0_and_1_in_any_dtype_are_accepted(case):
    ref = _gen(case, max_new_tokens=2).sequences
    for mask in (case[2].bool(), case[2].float(), case[2].int()):
        assert torch.equal(_gen(case, attention_mask=mask, max_new_tokens=2).sequences, ref)


class _MyStr(str):
    pass


def test_str_subclasses_equal_to_a_choice_are_that_choice(case):
    for v in (_MyStr("all"), np.str_("all")):
        assert config.OPTIONS["query_weights"].check(v) == "all"
        assert type(config.OPTIONS["query_weights"].check(v)) is str
    assert config.check_selection({"sparse_attn_algorithm": np.str_("vegas")})["sparse_attn_algorithm"] == "vegas"
    assert config.check_speculation({"num_speculative_tokens": np.str_("auto")}) == {"num_speculative_tokens": "auto"}
    assert VegasOptions(sparse_attn_algorithm=np.str_("vegas")).sparse_attn_algorithm == "vegas"
    ref = _gen(case, max_new_tokens=2)
    out = _gen(case, max_new_tokens=2, sparse_attn_algorithm=np.str_("vegas"), query_weights=_MyStr("all"),
               num_speculative_tokens=np.str_("auto"))
    assert torch.equal(out.sequences, ref.sequences)
    assert type(out.stats["sparse_attn_algorithm"]) is str and type(out.stats["query_weights"]) is str
    with pytest.raises(ValueError, match=r"^query_weights must be one of 'all', 'first_last', "
                                         r"got 'some' \(a _MyStr\)$"):
        config.OPTIONS["query_weights"].check(_MyStr("some"))
    with pytest.raises(ValueError, match=r"got 'x'$"):
        config.OPTIONS["query_weights"].check("x")
    with pytest.raises(ValueError, match=r"^draft_weights must be one of"):  # None stays compared by type
        config.OPTIONS["draft_weights"].check("None")


def test_vllm_max_below_min_names_the_bound_plainly():
    with pytest.raises(ValueError) as e:
        speculative_config(sparse_attn_max_tokens=10)
    assert str(e.value) == ("vegas_ext.vllm: sparse_attn_max_tokens must be None or an integer >= "
                            "max(1, sparse_attn_min_tokens) = 256, got 10")


@pytest.mark.parametrize("t", [1e-40, 1e-38, 0.0, 9.9e-6])
def test_sampling_temperature_has_a_floor(case, t):
    with pytest.raises(ValueError, match=r"^temperature must be a finite number >= 1e-05, got"):
        _gen(case, do_sample=True, temperature=t, generator=torch.Generator().manual_seed(0))
    _gen(case, do_sample=False, temperature=t, max_new_tokens=1)  # greedy ignores it, as HF does


def test_sampling_at_the_smallest_temperature_is_greedy(case):
    out = _gen(case, do_sample=True, temperature=config.MIN_TEMPERATURE, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out.sequences, _gen(case).sequences)


def test_cli_prompt_file_stdin_closed(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", None)
    rc, out, err = _run_cli(["generate", "--prompt-file", "-", *_NO_MODEL], capsys)
    assert "--prompt-file -: no stdin to read" in _one_line_error(rc, out, err)


def test_cli_prompt_file_stdin_closed_real_process():
    argv = [sys.executable, "-m", "vegas_ext", "generate", "--prompt-file", "-", *_NO_MODEL]
    r = subprocess.run(["bash", "-c", 'exec "$@" <&-', "bash", *argv], capture_output=True, env=_env(), timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 2 and err == "vegas: error: --prompt-file -: no stdin to read (it is closed)\n", err


@pytest.mark.parametrize("kind", ["fifo", "dev_fd"])
def test_cli_prompt_file_from_a_pipe(kind, tmp_path):
    """`--prompt-file <(cmd)`: a /dev/fd path or a FIFO is read like a file."""
    import threading

    if kind == "fifo":
        path = str(tmp_path / "prompt")
        os.mkfifo(path)

        def write():
            with open(path, "w") as f:
                f.write("the prompt\n")
        threading.Thread(target=write, daemon=True).start()
    else:
        r, w = os.pipe()
        os.write(w, b"the prompt\n")
        os.close(w)
        path = f"/dev/fd/{r}"
    args = cli.build_parser().parse_args(["generate", "--prompt-file", path, *_NO_MODEL])
    try:
        assert cli._read_prompts(args) == ["the prompt\n"]
    finally:
        if kind == "dev_fd":
            os.close(r)


def test_prompt_file_bom_and_errors(tmp_path):
    """A byte-order mark is not part of the prompt; a missing file says so, a name too long for
    the system says it cannot be read; every message starts with the flag."""
    bom = tmp_path / "bom.txt"
    bom.write_bytes(b"\xef\xbb\xbfthe prompt\n")
    read = lambda p: cli._read_prompts(cli.build_parser().parse_args(["generate", "--prompt-file", p, *_NO_MODEL]))  # noqa: E731
    assert read(str(bom)) == ["the prompt\n"]
    (tmp_path / "only_bom.txt").write_bytes(b"\xef\xbb\xbf")
    for path, what in ((str(tmp_path / "none.txt"), "not found"), ("/" + "x" * 5000, "cannot read it"),
                       (str(tmp_path / "only_bom.txt"), "empty or blank")):
        with pytest.raises(cli.CLIError, match=f"^--prompt-file .*{what}"):
            read(path)


# ------------------------------------------------------------------ listed values (handed case 016)

@pytest.mark.parametrize("name", [n for n, o in config.OPTIONS.items() if o.kind == "choice"])
def test_every_listed_choice_is_accepted(name):
    """The values an error lists for a choice option are exactly what the option takes: each
    passes its check, and nothing refused is listed ('int3' listed 'int4', refused itself)."""
    opt = config.OPTIONS[name]
    with pytest.raises(ValueError) as e:
        opt.check("no-such-value")
    listed = str(e.value).split(" must be one of ", 1)[1].rsplit(", got ", 1)[0]
    assert listed == ", ".join(repr(c) for c in opt.choices)
    for c in opt.choices:
        assert opt.check(c) == c
    if name == "draft_weights":
        assert "int4" not in listed and set(config.REFUSED_DRAFT_WEIGHTS).isdisjoint(opt.choices)


def test_draft_weights_errors_list_what_works(case):
    with pytest.raises(ValueError, match=r"^draft_weights must be one of None, 'fp16', 'int8', got 'int3'$"):
        _gen(case, draft_weights="int3")
    with pytest.raises(ValueError, match=r"^draft_weights='int4' is not supported: 4-bit weights .* use 'int8'"):
        _gen(case, draft_weights="int4")
    with pytest.raises(ValueError, match=r"^draft_weights='int4' is not supported"):
        config.OPTIONS["draft_weights"].check("int4")  # the option table says the same as generate
    with pytest.raises(ValueError, match=r"^vegas_ext.vllm: draft_weights must be one of None, 'fp16', 'int8', "
                                         r"got 'int3'$"):
        VegasOptions(draft_weights="int3").to_dict()
    assert config.check_draft_weights(np.str_("int8")) == "int8" and config.check_draft_weights(None) is None
