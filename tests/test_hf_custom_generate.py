"""Vegas inside Hugging Face's own ``model.generate`` and pipelines (issue 31):
``model.generate(..., custom_generate=vegas_ext.hf.generate)``.

Greedy output must equal plain ``model.generate`` token for token (fp32) with each supported
logits processor and stopping criterion, on batches with mixed prompt lengths (left padding);
sampling must keep the distribution of plain sampling with the processors applied (chi-square
against the exact joint distribution); what cannot be honoured is refused with a ValueError
naming the option.
"""
from __future__ import annotations

import functools
import warnings

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

import vegas_ext
from vegas_ext import hf

from decode_utils import first_diff, make_model, make_prompts, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

# a small sparse budget so drafts are real (and often rejected): the loop's speculation runs
VEGAS = dict(custom_generate=hf.generate, num_speculative_tokens=4, gamma_policy="fixed",
             sparse_attn_min_tokens=16, block_size=4)
LENGTHS = (40, 57, 23)  # mixed prompt lengths: left padding
NEW = 24


@pytest.fixture(scope="module")
def llama():
    return make_model("llama")


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(256, LENGTHS)


def _plain(model, ids, mask, **kw):
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0, **kw)


def _vegas(model, ids, mask, **kw):
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True, **VEGAS, **kw)
    assert isinstance(out, hf.VegasGenerateOutput)
    return out


# processors HF builds from generate's options; each changes the greedy output of these prompts
# (plain greedy continuations of these prompts: row 0 ends with EOS 2 at its 8th token, row 1
# loops "111 82", row 2 repeats 137)
PROCESSORS = {
    "repetition_penalty": dict(repetition_penalty=1.6),
    "no_repeat_ngram": dict(no_repeat_ngram_size=2),
    "min_new_tokens": dict(min_new_tokens=12),
    "min_length": dict(min_length=57 + 12),
    "bad_words": dict(bad_words_ids=[[137], [111, 82]]),
    "suppress_tokens": dict(suppress_tokens=[137, 226], begin_suppress_tokens=[174]),
    "sequence_bias": dict(sequence_bias={(137,): -20.0, (111, 82): -10.0}),
    "prefix_allowed_tokens_fn": dict(prefix_allowed_tokens_fn=lambda b, ids: list(range(3, 120 + 40 * b))),
    "encoder_repetition_penalty": dict(encoder_repetition_penalty=0.7),
    "eos_list": dict(eos_token_id=[111, 137, 5]),
    "all_together": dict(repetition_penalty=1.3, no_repeat_ngram_size=3, min_new_tokens=10, bad_words_ids=[[137]],
                         suppress_tokens=[23], eos_token_id=[2, 111]),
}


@pytest.fixture(scope="module")
def baseline(llama, prompts):
    ids, mask = prompts
    return _plain(llama, ids, mask, max_new_tokens=NEW)


def test_greedy_equals_plain_generate_without_processors(llama, prompts, baseline):
    ids, mask = prompts
    out = _vegas(llama, ids, mask, max_new_tokens=NEW)
    assert torch.equal(out.sequences, baseline), first_diff(out.sequences, baseline)
    assert out.stats["num_draft_tokens"] > 0 and 0 < out.stats["num_accepted_tokens"] < out.stats["num_draft_tokens"]
    # plain tensor when return_dict_in_generate is off
    with torch.inference_mode():
        seq = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                             **VEGAS)
    assert torch.equal(seq, baseline)


@pytest.mark.parametrize("name", list(PROCESSORS))
def test_greedy_equals_plain_generate_with_processor(llama, prompts, baseline, name):
    ids, mask = prompts
    kw = PROCESSORS[name]
    want = _plain(llama, ids, mask, max_new_tokens=NEW, **kw)
    assert not torch.equal(want, baseline)  # the processor matters for these prompts
    out = _vegas(llama, ids, mask, max_new_tokens=NEW, **kw)
    assert torch.equal(out.sequences, want), first_diff(out.sequences, want)
    assert out.stats["num_draft_tokens"] > 0 and out.stats["num_accepted_tokens"] > 0


def test_greedy_rows_ending_early_with_eos_lists_and_max_length(llama, prompts):
    ids, mask = prompts
    kw = dict(max_length=ids.shape[1] + 30, eos_token_id=[5, 7, 9, 11, 13, 17, 19], no_repeat_ngram_size=2)
    want = _plain(llama, ids, mask, **kw)
    assert bool((want[:, -1] == 0).any())  # some row ended early (padded)
    out = _vegas(llama, ids, mask, **kw)
    assert torch.equal(out.sequences, want), first_diff(out.sequences, want)


class StopAfterToken(StoppingCriteria):
    """Row-wise custom criterion: a row is done once its last token is ``token``."""

    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_greedy_custom_stopping_criteria(llama, prompts, baseline):
    ids, mask = prompts
    T = ids.shape[1]
    # a token each row emits in the middle of its plain output: rows stop at different places
    tok = int(baseline[1, T + NEW // 2])
    at = baseline[1, T:].tolist().index(tok)  # where row 1 first emits it
    crit = StoppingCriteriaList([StopAfterToken(tok)])
    want = _plain(llama, ids, mask, max_new_tokens=NEW, stopping_criteria=crit, eos_token_id=[255])
    assert int(want[1, T + at]) == tok and bool((want[1, T + at + 1:] == 0).all())  # row 1 stopped there
    out = _vegas(llama, ids, mask, max_new_tokens=NEW, stopping_criteria=crit, eos_token_id=[255])
    assert torch.equal(out.sequences, want), first_diff(out.sequences, want)
    # one row only: the criterion alone ends it (no EOS needed)
    want1 = _plain(llama, ids[1:2], mask[1:2], max_new_tokens=NEW, stopping_criteria=crit)
    out1 = _vegas(llama, ids[1:2], mask[1:2], max_new_tokens=NEW, stopping_criteria=crit)
    assert torch.equal(out1.sequences, want1) and want1.shape[1] == T + at + 1


def test_greedy_other_families_with_processors():
    for family in ("qwen3", "mistral"):
        model = make_model(family)
        ids, mask = make_prompts(model.config.vocab_size, (33, 50))
        kw = dict(max_new_tokens=16, repetition_penalty=1.4, no_repeat_ngram_size=2)
        want = _plain(model, ids, mask, **kw)
        out = _vegas(model, ids, mask, **kw)
        assert torch.equal(out.sequences, want), (family, first_diff(out.sequences, want))


def test_streamer_gets_the_prompt_once_then_the_new_tokens(llama, prompts):
    ids, mask = prompts

    class Recorder:
        def __init__(self):
            self.puts, self.ends = [], 0

        def put(self, value):
            self.puts.append(value.clone())

        def end(self):
            self.ends += 1

    got, ref = Recorder(), Recorder()
    kw = dict(max_new_tokens=NEW, repetition_penalty=1.3)
    want = _plain(llama, ids[:1], mask[:1], streamer=ref, **kw)
    out = _vegas(llama, ids[:1], mask[:1], streamer=got, **kw)
    assert torch.equal(out.sequences, want)
    assert got.ends == 1 == ref.ends
    assert torch.equal(got.puts[0], ids[:1])  # the prompt, once (HF's generate sends it)
    assert torch.equal(torch.cat([p.flatten() for p in got.puts[1:]]), want[0, ids.shape[1]:])


def test_pipeline_text_generation(tmp_path):
    """The same through ``pipeline("text-generation")``, on a tiny model with a word-level tokenizer."""
    from tokenizers import Tokenizer, models as tmodels, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, pipeline

    words = ("the a of and to in is was it that he she they said mr mrs miss bennet darcy bingley elizabeth jane "
             "house ball letter sister family fortune man woman good great very much more one two day night").split()
    tk = Tokenizer(tmodels.WordLevel(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    # ("abcdef": StopStringCriteria tokenizes it to learn how tokens decode)
    tk.train_from_iterator([" ".join(words + ["abcdef"])] * 3, trainers.WordLevelTrainer(
        special_tokens=["<pad>", "<s>", "</s>", "<unk>"], min_frequency=1))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      initializer_range=0.15)
    model = LlamaForCausalLM(cfg).eval()
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    prompt = " ".join(words[i % len(words)] for i in range(0, 150, 7))
    # (this random model says </s> at once: suppressed, which also runs a processor)
    kw = dict(max_new_tokens=20, do_sample=False, repetition_penalty=1.2, suppress_tokens=[tok.eos_token_id])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = pipe(prompt, **kw)[0]["generated_text"]
        got = pipe(prompt, custom_generate=hf.generate, num_speculative_tokens=3, gamma_policy="fixed",
                   sparse_attn_min_tokens=8,
                   block_size=2, **kw)[0]["generated_text"]
    assert got == want and len(got) > len(prompt)
    # stop strings (the pipeline's stop_sequence) need the tokenizer, which transformers does not
    # pass to a callable custom_generate: read from the call, or bound with functools.partial
    stop = want[len(prompt):].split()[8]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want_s = pipe(prompt, stop_sequence=stop, **kw)[0]["generated_text"]
        for custom in (hf.generate, functools.partial(hf.generate, tokenizer=tok)):
            got_s = pipe(prompt, stop_sequence=stop, custom_generate=custom, num_speculative_tokens=3,
                         gamma_policy="fixed",
                         sparse_attn_min_tokens=8, block_size=2, **kw)[0]["generated_text"]
            assert got_s == want_s and want_s.endswith(stop) and len(want_s) < len(want)


# --------------------------------------------------------------------------------- refusals
REFUSED = {
    "num_beams": dict(num_beams=2),
    "penalty_alpha": dict(penalty_alpha=0.6, top_k=4),
    "prompt_lookup_num_tokens": dict(prompt_lookup_num_tokens=3),
    "output_scores": dict(output_scores=True, return_dict_in_generate=True),
    "output_logits": dict(output_logits=True, return_dict_in_generate=True),
    "output_attentions": dict(output_attentions=True, return_dict_in_generate=True),
    "guidance_scale": dict(guidance_scale=1.5),
    "synced_gpus": dict(synced_gpus=True),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refuses_what_it_cannot_honour(llama, prompts, name):
    ids, mask = prompts
    with pytest.raises(ValueError, match=rf"vegas_ext\.hf\.generate: {name}"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            llama.generate(input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=4, custom_generate=hf.generate,
                           **REFUSED[name])


def test_refuses_assistant_model_and_filled_cache(llama, prompts):
    ids, mask = prompts
    with pytest.raises(ValueError, match=r"vegas_ext\.hf\.generate: assistant_model"):
        llama.generate(input_ids=ids[:1], max_new_tokens=4, custom_generate=hf.generate, assistant_model=llama)
    from transformers import DynamicCache

    cache = DynamicCache(config=llama.config)
    with torch.inference_mode():
        llama(input_ids=ids[:1, :10], past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match=r"vegas_ext\.hf\.generate: (cache|past_key_values) \(a filled cache\)"):
        llama.generate(input_ids=ids[:1], max_new_tokens=4, custom_generate=hf.generate, past_key_values=cache)


def test_refuses_early_stopping_without_eos_in_a_batch(llama, prompts):
    ids, mask = prompts
    llama_eos = llama.generation_config.eos_token_id
    try:
        llama.generation_config.eos_token_id = None
        with pytest.raises(ValueError, match=r"stopping criteria with batch size > 1 and no eos_token_id"):
            llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, custom_generate=hf.generate,
                           stopping_criteria=StoppingCriteriaList([StopAfterToken(3)]), pad_token_id=0)
    finally:
        llama.generation_config.eos_token_id = llama_eos


def test_vegas_options_reach_the_loop(llama, prompts):
    ids, mask = prompts
    out = _vegas(llama, ids, mask, max_new_tokens=8, sparse_attn_ratio=0.5, vegas_options={"num_sink_blocks": 2})
    s = out.stats
    assert s["num_speculative_tokens"] == 4 and s["block_size"] == 4 and s["sparse_attn_ratio"] == 0.5
    assert s["num_sink_blocks"] == 2
    with pytest.raises(ValueError, match=r"vegas_options\['temperature'\]"):
        _vegas(llama, ids, mask, max_new_tokens=8, vegas_options={"temperature": 0.5})
    with pytest.raises(ValueError, match=r"sparse_attn_algorithm must be one of"):
        _vegas(llama, ids, mask, max_new_tokens=8, sparse_attn_algorithm="magic")


# --------------------------------------------------------------------------------- sampling
V_SMALL = 5
K_NEW = 3
PROMPT = 32
N_ROWS = 4000


def _chi2_pvalue(counts, probs):
    from test_spec_sampling import chi2_pvalue

    return chi2_pvalue(counts, probs)


def _exact_joint(model, prompt, procs):
    """Exact joint distribution of the next K_NEW tokens under plain sampling with ``procs``."""
    from test_spec_sampling import _exact_joint

    return _exact_joint(model, prompt, procs)


def test_sampling_with_processors_keeps_the_target_distribution():
    """Repetition penalty + temperature + top-k through model.generate: the loop's speculative
    sampling draws from the processed target; the counts also reject the unprocessed one."""
    pytest.importorskip("scipy.stats")
    model = make_model("llama", seed=11, vocab_size=V_SMALL, initializer_range=0.2, max_position_embeddings=256)
    model.generation_config.eos_token_id = None
    prompt = torch.randint(0, V_SMALL, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(3.0), TemperatureLogitsWarper(0.8),
                                 TopKLogitsWarper(4)])
    joint = _exact_joint(model, prompt, procs)
    torch.manual_seed(1)  # HF-style sampling uses the global generator
    with torch.inference_mode():
        out = model.generate(input_ids=prompt.expand(N_ROWS, -1),
                             attention_mask=torch.ones(N_ROWS, PROMPT, dtype=torch.long),
                             max_new_tokens=K_NEW, do_sample=True,
                             repetition_penalty=3.0, temperature=0.8, top_k=4, pad_token_id=0,
                             return_dict_in_generate=True, custom_generate=hf.generate, num_speculative_tokens=3,
                             gamma_policy="fixed",
                             sparse_attn_ratio=0.01, sparse_attn_min_tokens=0, block_size=4)
    s = out.stats
    assert 0.05 < s["draft_acceptance_rate"] < 0.95, s["draft_acceptance_rate"]
    new = out.sequences[:, PROMPT:]
    counts = torch.bincount((new * torch.tensor([V_SMALL**2, V_SMALL, 1])).sum(1), minlength=V_SMALL**K_NEW)
    pv = _chi2_pvalue(counts, joint)
    assert pv > 1e-4, f"chi-square p-value {pv:.2e}"
    # power: without the repetition penalty the distribution is far from these counts
    unpenalized = _exact_joint(model, prompt, LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(4)]))
    assert _chi2_pvalue(counts, unpenalized) < 1e-6


def test_sampling_with_warpers_only_uses_the_loops_warpers(monkeypatch):
    """temperature / top-k / top-p alone go to the loop's own warpers: no per-position processor calls."""
    calls = []
    from vegas_ext import decode

    real = decode.generate

    def spy(*a, **kw):
        calls.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr(decode, "generate", spy)
    model = make_model("llama")
    ids, mask = make_prompts(256, (30,))
    with torch.inference_mode():
        model.generate(input_ids=ids, max_new_tokens=6, do_sample=True, temperature=0.7, top_k=20, top_p=0.9,
                       pad_token_id=0, custom_generate=hf.generate, num_speculative_tokens=2, gamma_policy="fixed")
        model.generate(input_ids=ids, max_new_tokens=6, do_sample=True, temperature=0.7, min_p=0.05,
                       pad_token_id=0, custom_generate=hf.generate, num_speculative_tokens=2, gamma_policy="fixed")
    assert calls[0]["logits_processor"] is None
    cfg = calls[0]["vegas_config"]
    assert (cfg.temperature, cfg.top_k, cfg.top_p) == (0.7, 20, 0.9)
    assert calls[1]["logits_processor"] is not None  # min-p: HF's processor list, per position


# --------------------------------------------------------------------------------- embedded model
@pytest.mark.slow
def test_embedded_model_greedy_with_processors_and_stop_strings():
    from vegas_ext import models

    model, tok = models.load_model()
    text = ["The capital of France is", "Write a short poem about the sea and the wind, in four lines:"]
    enc = tok(text, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=24, do_sample=False, repetition_penalty=1.2, no_repeat_ngram_size=3)
    with torch.inference_mode():
        want = model.generate(**enc, **kw)
        got = model.generate(**enc, **kw, custom_generate=hf.generate, num_speculative_tokens=4, gamma_policy="fixed",
                             sparse_attn_min_tokens=8, block_size=2)
    assert torch.equal(got, want), first_diff(got, want)
    stop = tok.decode(want[1, enc["input_ids"].shape[1] + 10:]).split()[0]
    kw.update(stop_strings=[stop])
    with torch.inference_mode():
        want_s = model.generate(**enc, **kw, tokenizer=tok)
        got_s = model.generate(**enc, **kw, custom_generate=functools.partial(hf.generate, tokenizer=tok),
                               num_speculative_tokens=4, gamma_policy="fixed", sparse_attn_min_tokens=8, block_size=2)
    assert torch.equal(got_s, want_s), first_diff(got_s, want_s)
    T = enc["input_ids"].shape[1]
    assert tok.decode(want_s[1, T:], skip_special_tokens=True).rstrip().endswith(stop)  # row 1 stopped there
    assert want_s[1, T:].shape[0] > 10


# --------------------------------------------------------------------------------- the hook itself
def test_decode_generate_logits_processor_hook_directly(llama, prompts):
    """vegas_ext.generate(logits_processor=..., stopping_criteria=...) is the hook hf.generate
    uses; called directly it matches plain decoding with the same lists."""
    from transformers import NoRepeatNGramLogitsProcessor

    ids, mask = prompts
    procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5), NoRepeatNGramLogitsProcessor(2)])
    crit = StoppingCriteriaList([StopAfterToken(82)])
    want = _plain(llama, ids, mask, max_new_tokens=NEW, logits_processor=procs, stopping_criteria=crit)
    with torch.inference_mode():
        got = vegas_ext.generate(llama, ids, mask, max_new_tokens=NEW, pad_token_id=0, logits_processor=procs,
                                 stopping_criteria=crit, num_speculative_tokens=4, gamma_policy="fixed",
                                 sparse_attn_min_tokens=16,
                                 block_size=4).sequences
    assert torch.equal(got, want), first_diff(got, want)
    for name in ("logits_processor", "stopping_criteria"):
        with pytest.raises(ValueError, match=rf"{name} must be callable"):
            vegas_ext.generate(llama, ids, mask, max_new_tokens=2, **{name: 3})
