"""``model.generate(custom_generate=vegas_ext.hf.generate)`` where plain ``model.generate`` works
(issue 49, case 015): the same answer (greedy, fp32), or a refusal before any forward that names
the reason and the remedy (listed in docs/hf_generate.md).

* processors and stopping criteria see, for every row, a prefix that row really has (never
  filler), on ragged batches where rows advance at different speeds;
* an ``attention_mask`` with holes (given, or inferred by HF from a pad id inside a prompt) is
  read as transformers reads it;
* a row with no prompt token, and right padding, are refused naming the row;
* ``max_new_tokens`` past ``max_position_embeddings`` goes on as plain ``generate`` does (RoPE
  extrapolates), and is refused up front where the RoPE type makes that inexact;
* ``stop_strings=..., tokenizer=tok`` given to ``model.generate``, as HF documents them.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from vegas_ext import hf

from decode_utils import first_diff, make_model, make_prompts, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

VEGAS = dict(custom_generate=hf.generate, num_speculative_tokens=4, gamma_policy="fixed",
             sparse_attn_min_tokens=16, block_size=4)
LENGTHS = (40, 57, 23)
PAD, EOS = 0, 2


@pytest.fixture(scope="module")
def llama():
    return make_model("llama")


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(256, LENGTHS)


def _generate(model, vegas: bool, **kw):
    kw = {"do_sample": False, "pad_token_id": PAD, **kw, **(VEGAS if vegas else {})}
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(**kw)


def _both(model, **kw):
    return _generate(model, False, **kw), _generate(model, True, return_dict_in_generate=True, **kw)


def _strip_left_pad(row):
    row = row.tolist()
    i = 0
    while i < len(row) and row[i] == PAD:  # the prompts' tokens are >= 3: leading zeros are padding
        i += 1
    return row[i:]


class _Forwards:
    """Counts the model's forwards (a refusal must come before any)."""

    def __init__(self, model):
        self.n = 0
        self.handle = model.model.register_forward_pre_hook(self._hook)

    def _hook(self, *args):
        self.n += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()
        return False


# --------------------------------------------------------------------------------- real prefixes
def test_prefix_allowed_tokens_fn_sees_only_real_row_prefixes(llama, prompts):
    """A strict grammar: it checks the whole prefix it is given against the row's prompt and its
    own rules and returns [] for anything else (HF then raises). The loop used to pass it filler
    rows (other rows' tokens cut or padded with zeros); plain decoding never does."""
    ids, mask = prompts
    real_prompts = [ids[b][mask[b] == 1].tolist() for b in range(len(ids))]

    def allowed(b, prev):
        return [EOS] + [t for t in range(3, 90 + 50 * b) if (5 * t + prev) % 3 != 0]

    calls = []

    def strict(b, sent):
        s = _strip_left_pad(sent)
        p = real_prompts[b]
        calls.append(b)
        if s[: len(p)] != p:
            return []  # another row's tokens, or a prompt cut short: not a prefix of this row
        gen = s[len(p):]
        for j, t in enumerate(gen):
            if t == EOS:  # finished: plain decoding pads after it
                return [PAD] if all(x == PAD for x in gen[j + 1:]) else []
            if t not in allowed(b, gen[j - 1] if j else p[-1]):
                return []  # filler: no row ever emits it here
        return allowed(b, gen[-1] if gen else p[-1])

    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, prefix_allowed_tokens_fn=strict)
    want, out = _both(llama, **kw)
    assert torch.equal(out.sequences, want), first_diff(out.sequences, want)
    assert out.stats["num_draft_tokens"] > 0 and out.stats["num_accepted_tokens"] > 0
    # the grammar decides: the unconstrained continuation differs
    assert not torch.equal(want, _generate(llama, False, input_ids=ids, attention_mask=mask, max_new_tokens=24))


class _LongestPrefix(LogitsProcessor):
    """Passes the scores through; records the longest ``input_ids`` it was shown."""

    longest = 0

    def __call__(self, input_ids, scores):
        self.longest = max(self.longest, input_ids.shape[1])
        return scores


def test_processor_never_sees_past_max_new_tokens(llama, prompts):
    """Rows that may draft fewer tokens than others (near ``max_new_tokens``) are not shown to a
    processor past their own drafts: plain decoding never shows a prefix longer than the prompt
    plus ``max_new_tokens``."""
    ids, mask = prompts
    seen = _LongestPrefix()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, logits_processor=LogitsProcessorList([seen]))
    want, out = _both(llama, **kw)
    assert torch.equal(out.sequences, want), first_diff(out.sequences, want)
    assert out.stats["num_draft_tokens"] > 0
    assert seen.longest <= ids.shape[1] + 24 - 1, seen.longest


class _RealPrefixes(StoppingCriteria):
    """Stops a row after ``token``; with ``ref`` (plain decoding's output) set, fails on any row
    of ``input_ids`` that is not a prefix of that row's plain output (left padding aside)."""

    def __init__(self, token):
        self.token, self.ref, self.checked = token, None, 0

    def __call__(self, input_ids, scores, **kwargs):
        if self.ref is not None:
            for b in range(len(input_ids)):
                got, want = _strip_left_pad(input_ids[b]), _strip_left_pad(self.ref[b])
                assert got == want[: len(got)], f"row {b} is not a real prefix: {got[-6:]} vs {want[len(got) - 6:]}"
                self.checked += 1
        return input_ids[:, -1] == self.token


def test_stopping_criteria_see_only_real_row_prefixes(llama, prompts):
    ids, mask = prompts
    base = _generate(llama, False, input_ids=ids, attention_mask=mask, max_new_tokens=24)
    T = ids.shape[1]
    crit = _RealPrefixes(int(base[1, T + 12]))  # row 1 stops in the middle; the others run on
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, eos_token_id=[EOS],
              stopping_criteria=StoppingCriteriaList([crit]))
    want = _generate(llama, False, **kw)
    crit.ref = want
    out = _generate(llama, True, return_dict_in_generate=True, **kw)
    assert torch.equal(out.sequences, want), first_diff(out.sequences, want)
    assert crit.checked > 0 and out.stats["num_accepted_tokens"] > 0


# --------------------------------------------------------------------------------- attention masks
def test_pad_id_inside_a_prompt_without_attention_mask(llama, prompts):
    """No mask: HF infers ``input_ids != pad_token_id``, holes included; plain decoding skips those
    tokens, and so does the loop."""
    ids, mask = prompts
    ids = ids.clone()
    ids[1, 30] = ids[1, 45] = ids[0, 40] = PAD  # inside rows 1 and 0 (not their last tokens)
    want, out = _both(llama, input_ids=ids, max_new_tokens=16)
    assert torch.equal(out.sequences, want), first_diff(out.sequences, want)
    # the same with that mask given, and with a hole in a single row
    holes = (ids != PAD).long()
    want, out = _both(llama, input_ids=ids, attention_mask=holes, max_new_tokens=16)
    assert torch.equal(out.sequences, want), first_diff(out.sequences, want)
    want, out = _both(llama, input_ids=ids[1:2], max_new_tokens=16)
    assert torch.equal(out.sequences, want), first_diff(out.sequences, want)


def test_rows_ending_in_padding_are_refused_before_any_forward(llama, prompts):
    ids, mask = prompts
    ended = ids.clone()
    ended[2, -1] = PAD  # the prompt's last token is the pad id, and no mask is passed
    with _Forwards(llama) as fw:
        assert _generate(llama, False, input_ids=ended, max_new_tokens=4).shape[1] == ids.shape[1] + 4
        fw.n = 0
        with pytest.raises(ValueError, match=r"vegas_ext\.hf\.generate: input_ids row 2 that ends with "
                                             r"pad_token_id=0 without an attention_mask .*pass attention_mask"):
            _generate(llama, True, input_ids=ended, max_new_tokens=4)
        right = mask.clone()
        right[0, -3:] = 0  # right padding, passed
        with pytest.raises(ValueError, match=r"attention_mask must be left padding: row 0 ends with a 0 "
                                             r"\(right padding.*pad on the left"):
            _generate(llama, True, input_ids=ids, attention_mask=right, max_new_tokens=4)
        assert fw.n == 0


def test_a_row_without_prompt_tokens_is_refused_naming_it(llama, prompts):
    """Plain decoding answers for such a row from padding alone (its first token comes from a pad
    token that attends to nothing); the loop cannot reproduce that and says which row, and what to do."""
    ids, mask = prompts
    empty = mask.clone()
    empty[2] = 0
    assert _generate(llama, False, input_ids=ids, attention_mask=empty, max_new_tokens=4).shape[1] == ids.shape[1] + 4
    with _Forwards(llama) as fw, pytest.raises(ValueError, match=r"attention_mask row 2 is all zeros: .*drop the row, "
                                                                 r"or give it a token with mask 1"):
        _generate(llama, True, input_ids=ids, attention_mask=empty, max_new_tokens=4)
    assert fw.n == 0


# --------------------------------------------------------------------------------- positions
def test_max_new_tokens_past_max_position_embeddings_goes_on_like_plain():
    """Plain generate does not stop at max_position_embeddings (RoPE extrapolates): 30 new tokens
    after a 50-token prompt on a 64-position model, rows of mixed lengths, and a prompt longer
    than the positions."""
    model = make_model("llama", max_position_embeddings=64)
    ids, mask = make_prompts(model.config.vocab_size, [50, 31], seed=4)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, eos_token_id=[])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "capped" warning either
        out = _generate(model, True, return_dict_in_generate=True, **kw)
    want = _generate(model, False, **kw)
    assert want.shape[1] == ids.shape[1] + 30
    assert torch.equal(out.sequences, want), first_diff(out.sequences, want)
    assert out.stats["num_accepted_tokens"] > 0
    long_ids, long_mask = make_prompts(model.config.vocab_size, [70], seed=5)
    want, out = _both(model, input_ids=long_ids, attention_mask=long_mask, max_new_tokens=12, eos_token_id=[])
    assert torch.equal(out.sequences, want), first_diff(out.sequences, want)


def test_past_max_position_embeddings_with_dynamic_rope_is_refused_up_front():
    """``dynamic`` RoPE rescales per forward past max_position_embeddings: plain decoding's
    one-token forwards cannot be reproduced there, so the call is refused before any forward with
    the largest max_new_tokens that works; within the positions it decodes as plain."""
    model = make_model("llama", max_position_embeddings=64, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                             "rope_theta": 10000.0})
    ids, mask = make_prompts(model.config.vocab_size, [50], seed=4)
    with _Forwards(model) as fw, pytest.raises(ValueError, match=r"max_new_tokens=30: .*max_position_embeddings=64.*"
                                                                 r"'dynamic'.*lower max_new_tokens to at most 15"):
        _generate(model, True, input_ids=ids, attention_mask=mask, max_new_tokens=30, eos_token_id=[])
    assert fw.n == 0
    want, out = _both(model, input_ids=ids, attention_mask=mask, max_new_tokens=15, eos_token_id=[])
    assert torch.equal(out.sequences, want), first_diff(out.sequences, want)


# --------------------------------------------------------------------------------- stop strings
def _word_tokenizer():
    from tokenizers import Tokenizer, models as tmodels, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = ("the a of and to in is was it that he she they said mr mrs miss bennet darcy bingley elizabeth jane "
             "house ball letter sister family fortune man woman good great very much more one two day night").split()
    tk = Tokenizer(tmodels.WordLevel(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator([" ".join(words + ["abcdef"])] * 3, trainers.WordLevelTrainer(
        special_tokens=["<pad>", "<s>", "</s>", "<unk>"], min_frequency=1))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>", padding_side="left")
    return tok, words


def test_stop_strings_with_the_tokenizer_given_to_generate():
    """``model.generate(..., stop_strings=[...], tokenizer=tok)`` as HF documents it (transformers
    drops ``tokenizer`` for a callable custom_generate; the loop reads it from the call), in a
    batch, and through a pipeline's ``stop_sequence``."""
    from transformers import LlamaConfig, LlamaForCausalLM, pipeline

    tok, words = _word_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      initializer_range=0.15)
    model = LlamaForCausalLM(cfg).eval()
    texts = [" ".join(words[i % len(words)] for i in range(s, s + 7 * n, 7)) for s, n in ((0, 30), (3, 17))]
    enc = tok(texts, return_tensors="pt", padding=True)
    kw = dict(**enc, max_new_tokens=20, suppress_tokens=[tok.eos_token_id])  # this model says </s> at once
    base = _generate(model, False, **kw)
    T = enc["input_ids"].shape[1]
    stop = tok.decode(base[1, T + 8: T + 9]).strip()  # row 1's 9th new word: it stops there, row 0 later or not
    want, out = _both(model, **kw, stop_strings=[stop], tokenizer=tok)
    assert torch.equal(out.sequences, want), first_diff(out.sequences, want)
    assert tok.decode(want[1, T:], skip_special_tokens=True).rstrip().endswith(stop)
    assert not torch.equal(want, base)  # the stop string decides
    with pytest.raises(ValueError, match=r"stop_strings without a tokenizer is not supported \(.*pass tokenizer=tok"):
        _generate(model, True, **kw, stop_strings=[stop])  # (plain decoding refuses too)

    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    pkw = dict(max_new_tokens=20, do_sample=False, suppress_tokens=[tok.eos_token_id], stop_sequence=stop)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want_p = pipe(texts[1], **pkw)[0]["generated_text"]
        got_p = pipe(texts[1], custom_generate=hf.generate, num_speculative_tokens=3, gamma_policy="fixed",
                     sparse_attn_min_tokens=8,
                     block_size=2, **pkw)[0]["generated_text"]
    assert got_p == want_p and want_p.endswith(stop)


def test_negative_eos_id_is_ignored_as_plain_generate_does():
    """Break test: HF only warns about a negative ``eos_token_id`` (no token has it) and decodes;
    ``hf.generate`` refused it. Now the same tokens, alone or beside a real EOS id."""
    model = make_model("llama")
    ids, mask = make_prompts(256, [20, 14])
    for eos in (-1, [-1, 7]):
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, eos_token_id=eos, pad_token_id=0)
        ref = model.generate(**kw, do_sample=False)
        got = model.generate(**kw, **VEGAS)
        assert torch.equal(got, ref), first_diff(got, ref)
