"""compile_steps=True: the loop's step forwards under torch.compile(fullgraph=True) on CPU.

The same functions a GPU captures as CUDA graphs (mode="reduce-overhead"), traced here with the
"aot_eager" backend (Dynamo's full trace and AOT autograd, no code generation): no graph break
(fullgraph=True raises on one) and the same tokens as the eager loop.
"""
import threading

import pytest
import torch
from torch._dynamo.utils import counters

import vegas_ext
from vegas_ext import compiled_steps

from decode_utils import FAMILIES, cached_model, hf_greedy, make_model, make_prompts


@pytest.fixture(autouse=True)
def _aot_eager(monkeypatch):
    monkeypatch.setitem(compiled_steps.COMPILE_BACKEND, "cpu", "aot_eager")


def _prompts(model, lengths=(41, 29), seed=3):
    return make_prompts(model.config.vocab_size, list(lengths), seed=seed)


def _both(model, ids, mask, **kw):
    eager = vegas_ext.generate(model, ids, attention_mask=mask, **kw)
    counters.clear()
    compiled = vegas_ext.generate(model, ids, attention_mask=mask, compile_steps=True, **kw)
    assert counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    assert not counters["graph_break"], dict(counters["graph_break"])
    return eager, compiled


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_eager_and_plain(family):
    """Ragged prompts, γ per row, int8 drafts (the lean draft forward on CPU): compiled steps give
    the eager loop's tokens, which are plain greedy's."""
    model = cached_model(family)
    ids, mask = _prompts(model)
    eager, compiled = _both(model, ids, mask, max_new_tokens=24)
    assert torch.equal(compiled.sequences, eager.sequences)
    assert torch.equal(compiled.sequences, hf_greedy(model, ids, mask, 24, eos_token_id=2))
    assert compiled.stats["num_iterations"] >= 2


@pytest.mark.parametrize("algorithm", ["streamingllm", "quest", "full"])
def test_rivals_and_plain_steps(algorithm):
    """StreamingLLM's blocks, Quest's per-step draft hook (K/V min-max kept by the write hook)
    and plain steps ("full") trace too."""
    model = cached_model("llama")
    ids, mask = _prompts(model)
    eager, compiled = _both(model, ids, mask, max_new_tokens=20, sparse_attn_algorithm=algorithm)
    assert torch.equal(compiled.sequences, eager.sequences)


def test_drafts_through_the_models_forward_with_draft_weights():
    """A model the lean forward does not take (a hook on a module) drafts through its own forward
    with the int8 copies (the path of CUDA models): traced, the copies read in drafts only."""
    model = make_model("qwen2", seed=5)
    model.model.norm.register_forward_hook(lambda m, i, o: None)
    ids, mask = _prompts(model, (37, 52))
    eager, compiled = _both(model, ids, mask, max_new_tokens=20, num_speculative_tokens=3, gamma_policy="fixed")
    assert torch.equal(compiled.sequences, eager.sequences)
    assert torch.equal(compiled.sequences, hf_greedy(model, ids, mask, 20, eos_token_id=2))


def test_sampling_with_fixed_gamma_draws_what_eager_draws():
    """Sampling reads the generator in the same order when both keep every row in the batch
    (return_cache) at a fixed γ: same tokens for the same seed."""
    model = cached_model("mistral")
    ids, mask = _prompts(model)
    kw = dict(max_new_tokens=20, do_sample=True, temperature=0.8, num_speculative_tokens=4, gamma_policy="fixed",
              return_cache=True)
    eager = vegas_ext.generate(model, ids, attention_mask=mask, generator=torch.Generator().manual_seed(7), **kw)
    compiled = vegas_ext.generate(model, ids, attention_mask=mask, generator=torch.Generator().manual_seed(7),
                                  compile_steps=True, **kw)
    assert torch.equal(compiled.sequences, eager.sequences)


def test_threads_with_draft_weights_keep_their_tokens():
    """Two threads decoding compiled steps at once, one through the model's forward with draft
    weights: each gets its tokens alone (the traced draft weights never reach a verification)."""
    hooked = make_model("llama", seed=9)
    hooked.model.norm.register_forward_hook(lambda m, i, o: None)
    lean = cached_model("llama")
    jobs = [(hooked, *_prompts(hooked, (33, 45), seed=4)), (lean, *_prompts(lean, (50, 21), seed=6))]
    want = [hf_greedy(m, i, k, 16, eos_token_id=2) for m, i, k in jobs]
    got = [None, None]
    errors = []

    def run(n):
        try:
            m, i, k = jobs[n]
            got[n] = vegas_ext.generate(m, i, attention_mask=k, max_new_tokens=16, compile_steps=True).sequences
        except Exception as e:  # reported below: a thread's exception would otherwise be lost
            errors.append(e)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_compile_steps_must_be_a_bool():
    model = cached_model("llama")
    ids, mask = _prompts(model)
    with pytest.raises(TypeError, match="compile_steps"):
        vegas_ext.generate(model, ids, attention_mask=mask, max_new_tokens=2, compile_steps="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("draft_weights", [None, "int8"])
def test_cuda_graphs_give_the_eager_tokens(monkeypatch, draft_weights):
    """On CUDA: Inductor with mode="reduce-overhead" (CUDA graphs over the cache's static buffers),
    fp32, two calls (the second replays the first's graphs): the eager loop's tokens."""
    monkeypatch.delenv("VEGAS_COMPILE_BACKEND", raising=False)
    model = make_model("llama", seed=2).to("cuda")
    ids, mask = (t.to("cuda") for t in _prompts(model, (45, 38)))
    kw = dict(max_new_tokens=24, num_speculative_tokens=4, gamma_policy="fixed", draft_weights=draft_weights)
    eager = vegas_ext.generate(model, ids, attention_mask=mask, **kw)
    for _ in range(2):
        compiled = vegas_ext.generate(model, ids, attention_mask=mask, compile_steps=True, **kw)
        assert torch.equal(compiled.sequences, eager.sequences)


def test_an_eager_thread_while_another_compiles():
    """torch marks the whole process as compiling while one thread compiles; an eager decode of
    the same model in another thread meanwhile keeps its tokens and does not break the compile
    (transformers' kernel context variables turn process-global then)."""
    model = make_model("qwen3", seed=11)
    ids, mask = _prompts(model, (12, 40), seed=4)
    want = vegas_ext.generate(model, ids, attention_mask=mask, max_new_tokens=14).sequences
    done, errors, got = threading.Event(), [], []

    def compiled():
        try:
            got.append(vegas_ext.generate(model, ids, attention_mask=mask, max_new_tokens=14,
                                          compile_steps=True).sequences)
        except Exception as e:  # reported below
            errors.append(e)
        finally:
            done.set()

    def eager():
        try:
            while not done.is_set():
                got.append(vegas_ext.generate(model, ids, attention_mask=mask, max_new_tokens=14).sequences)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=compiled), threading.Thread(target=eager)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(got) >= 2 and all(torch.equal(g, want) for g in got)


@pytest.mark.parametrize("algorithm", ["vegas", "quest"])
def test_new_prompt_lengths_reuse_the_graphs(algorithm):
    """The cache's capacity (prompt + new tokens), the scores' block count and the draft budget
    are dynamic dimensions, and Quest's budget is a power of two: after a warm-up, calls with
    other prompt lengths compile few graphs -- only shapes not seen yet (a draft count that `auto`
    or the end of a row makes new) -- where a specialized trace compiled 4-6 per call and hit
    Dynamo's recompile limit after ~80 calls."""
    torch._dynamo.reset()
    model = make_model("llama", seed=13)
    kw = dict(max_new_tokens=12, sparse_attn_algorithm=algorithm)
    late = 0
    for n, width in enumerate(range(20, 28)):
        ids, mask = _prompts(model, (width, width - 5), seed=n)
        before = counters["stats"]["unique_graphs"]
        got = vegas_ext.generate(model, ids, attention_mask=mask, compile_steps=True, **kw).sequences
        assert torch.equal(got, vegas_ext.generate(model, ids, attention_mask=mask, **kw).sequences)
        if n >= 3:
            late += counters["stats"]["unique_graphs"] - before
    assert late <= 8, f"{late} graphs compiled over 5 calls after the warm-up"
