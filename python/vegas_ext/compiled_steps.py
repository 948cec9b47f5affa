"""The decode loop's step forwards, eager or under ``torch.compile(fullgraph=True)``.

A decode iteration runs three kinds of model forward over the preallocated
:class:`~vegas_ext.cache.VegasCache`: draft steps (one token per row, sparse attention), the
verification of ``q`` tokens per row and plain steps (full attention). On a GPU their time is set
by the host as much as by the device: a Llama-3-8B-shaped plain step at 32K x 8 read ~50 GB in
~12 ms of device time but took 35 ms (bench/results/gpu_h200), the rest launches and Python.
gpt-fast removes that overhead with ``torch.compile(mode="reduce-overhead", fullgraph=True)``:
one CUDA graph per input shape, replayed. This module gives the loop the same:

* :func:`model_forward`: one forward of the HF model through our attention, the attention state
  passed as a keyword (``vegas_state``) rather than read from a context variable, and a
  placeholder 4-D mask so that HF builds no mask -- both traceable by Dynamo;
* :class:`CompiledSteps`: that forward and the lean draft forward
  (:class:`~vegas_ext.draft_forward.LeanDraft`) compiled with ``fullgraph=True`` (a graph break is
  an error, not a silent fallback): one graph per ``(rows, tokens, mode)``, the cache's capacity
  and the draft budget dynamic; on
  CUDA with Inductor's ``mode="reduce-overhead"`` (CUDA graphs; the cache buffers and block scores
  marked as static addresses, written in place).

The loop calls the same functions eager or compiled, so the CPU test suite checks what a capture
would run: no graph break, the same tokens (tests/test_compiled_steps.py). What only a GPU can
show -- the capture itself and its speed -- is in ``bench/gpu_check.sh``.
"""
from __future__ import annotations

import contextlib
import os
import threading
import weakref
from typing import Dict

import torch
from torch import Tensor

__all__ = ["CompiledSteps", "compiled_steps", "model_forward", "in_compiled_step", "traced_draft_weights",
           "eager_forward_lock", "COMPILE_BACKEND"]

#: Dynamo backend per device type where not Inductor (on CUDA with ``mode="reduce-overhead"``: its
#: kernels replayed as CUDA graphs). Not "cudagraphs" or "aot_eager" for decoding: without Inductor's
#: re-inplacing, every K/V write into the cache becomes a copy of the whole cache buffer. The
#: environment variable ``VEGAS_COMPILE_BACKEND`` overrides every device's; tests set "aot_eager"
#: on CPU (Dynamo's whole trace, no code generation).
COMPILE_BACKEND: Dict[str, str] = {}


def _backend(device_type: str) -> str:
    return os.environ.get("VEGAS_COMPILE_BACKEND") or COMPILE_BACKEND.get(device_type, "inductor")


#: distinct graphs one compiled step may hold: modes x token counts x batch sizes x block sizes
_RECOMPILE_LIMIT = 256
_MASKS: Dict[torch.device, Tensor] = {}
_LOCK = threading.RLock()
#: while a compiled step is called (under :data:`_LOCK`): the calling thread and the draft weights
#: its linears read (``None``: the model's own)
_CALL: Dict[str, object] = {"thread": None, "draft_weights": None}


@torch.compiler.assume_constant_result
def in_compiled_step() -> bool:
    """Whether this thread is inside a compiled step (its trace, or an eager fallback of it).
    Not ``torch.compiler.is_compiling()``: torch sets that for the whole process while any thread
    compiles, so another thread's eager forward would take the compiled path. A constant to Dynamo
    (evaluated once at trace time, where it is True), so the trace has no graph break."""
    return _CALL["thread"] == threading.get_ident()


def traced_draft_weights():
    """The :class:`~vegas_ext.draft_weights.DraftWeights` a compiled draft step's linears read
    (``None`` in verification and plain steps): read inside :func:`in_compiled_step` only."""
    return _CALL["draft_weights"]


def _no_mask(device: torch.device) -> Tensor:
    """A ``[1, 1, 1, 1]`` bool placeholder: HF returns a 4-D mask as given (no mask built, no
    data-dependent Python), and our attention masks by per-row lengths, never reading it."""
    m = _MASKS.get(device)
    if m is None:
        m = _MASKS.setdefault(device, torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device))
    return m


def model_forward(model, fwd_kw: str, ids: Tensor, pos: Tensor, keep: int, cache, state) -> Tensor:
    """One forward of ``model`` (a HF ``*ForCausalLM`` using the ``"vegas"`` attention) over
    ``ids`` ``[B, Q]`` int64 at positions ``pos`` ``[B, Q]`` into ``cache`` (passed as the
    model's ``fwd_kw`` argument), attention by ``state`` (an
    :class:`~vegas_ext.attention.AttentionState` after ``cache.begin_forward``). Returns the logits
    ``[B, keep or Q, V]`` (``keep = 0``: every position)."""
    out = model(input_ids=ids, position_ids=pos, attention_mask=_no_mask(ids.device), use_cache=True,
                logits_to_keep=keep, vegas_state=state, **{fwd_kw: cache})
    return out.logits


def _lean_forward(lean, ids: Tensor, pos: Tensor, state) -> Tensor:
    return lean(ids, pos, state)


class CompiledSteps:
    """The loop's step forwards under ``torch.compile``, one per device (:func:`compiled_steps`): its
    graphs serve every :func:`vegas_ext.generate` call of the same shapes.

    Args:
        device: the model's device; the backend: Inductor unless :data:`COMPILE_BACKEND` says
            otherwise, on CUDA with ``mode="reduce-overhead"`` (its kernels as CUDA graphs).

    Call :meth:`forward` as :func:`model_forward` and :meth:`lean` as a
    :class:`~vegas_ext.draft_forward.LeanDraft`. Compiled with ``fullgraph=True``: a graph break
    raises ``torch._dynamo.exc.Unsupported`` at the first call of that shape.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.backend = backend = _backend(self.device.type)
        kw = dict(fullgraph=True, dynamic=False, backend=backend)
        if self.device.type == "cuda" and backend == "inductor":
            kw["mode"] = "reduce-overhead"  # Inductor's kernels, replayed as CUDA graphs
        self._forward = torch.compile(model_forward, **kw)
        self._lean = torch.compile(_lean_forward, **kw)
        self._seen = None  # (cache, block scores) prepared last, weakly

    def _prepare(self, state) -> None:
        """Before a compiled call. Once per cache: the cache's positions per row
        (prompt + new tokens: every call its own) and the block count of its scores as dynamic
        dimensions, so that one graph serves every capacity where specialized ones recompiled at
        each new prompt length (and hit Dynamo's recompile limit); on CUDA, the tensors a step
        writes in place -- the cache buffers, the block scores -- as static addresses, so that the
        graphs write them rather than copies (a graph with other mutated inputs is not captured).
        Every call: the draft budget in blocks as dynamic (it grows with the context, a new tensor
        per selection) and, on CUDA, a new CUDA-graph step (the previous step's outputs were read)."""
        cuda = self.device.type == "cuda"
        if self._seen is None or self._seen[0]() is not state.cache or self._seen[1]() is not state.block_scores:
            for layer in state.cache.layers:
                for t in (layer.keys, layer.values):
                    torch._dynamo.maybe_mark_dynamic(t, 2)
                    if cuda:
                        torch._dynamo.mark_static_address(t)
            if state.block_scores is not None:
                torch._dynamo.maybe_mark_dynamic(state.block_scores, 3)
                if cuda:
                    torch._dynamo.mark_static_address(state.block_scores)
            # weak references: a freed cache's id may be reused by the next call's
            scores = state.block_scores
            self._seen = (weakref.ref(state.cache), weakref.ref(scores) if scores is not None else lambda: None)
        if state.block_indices is not None:
            torch._dynamo.maybe_mark_dynamic(state.block_indices, 3)
        if cuda:
            torch.compiler.cudagraph_mark_step_begin()

    def forward(self, model, fwd_kw: str, ids: Tensor, pos: Tensor, keep: int, cache, state,
                draft_weights=None) -> Tensor:
        """:func:`model_forward`, compiled; ``draft_weights``: the
        :class:`~vegas_ext.draft_weights.DraftWeights` a draft step's linears read (installed and
        active, as in the eager loop), ``None`` for verification and plain steps."""
        with _LOCK, _traced(draft_weights), torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
            self._prepare(state)
            calls, state.layer_calls = state.layer_calls, 0  # a graph's guards see 0: no recompiles for it
            try:
                return self._forward(model, fwd_kw, ids, pos, keep, cache, state)
            finally:
                state.layer_calls += calls

    def lean(self, lean, ids: Tensor, pos: Tensor, state) -> Tensor:
        """``lean(ids, pos, state)`` (a :class:`~vegas_ext.draft_forward.LeanDraft`, which reads
        its draft weights itself), compiled."""
        with _LOCK, _traced(None), torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
            self._prepare(state)
            return self._lean(lean, ids, pos, state)


@contextlib.contextmanager
def _traced(dw):
    """Inside, this thread is in a compiled step whose linears read ``dw``
    (:func:`in_compiled_step`, :func:`traced_draft_weights`). Held under :data:`_LOCK`: two
    threads' compiled steps never see each other's."""
    _CALL.update(thread=threading.get_ident(), draft_weights=dw)
    try:
        yield
    finally:
        _CALL.update(thread=None, draft_weights=None)


_BY_DEVICE: Dict[torch.device, CompiledSteps] = {}


def eager_forward_lock():
    """What an eager forward of the loop holds once any thread of the process has used compiled
    steps: :data:`_LOCK`, so that it never runs while another thread's step compiles. torch marks
    the whole process as compiling then, and code that branches on that (transformers' kernel
    context variables, which turn process-global) would change under the trace: the compile fails
    with a Dynamo guard error. A no-op (no serialization) in processes that never compiled a step."""
    return _LOCK if _BY_DEVICE else contextlib.nullcontext()


def compiled_steps(device) -> CompiledSteps:
    """The :class:`CompiledSteps` of ``device``, one per process (its graphs serve every call)."""
    device = torch.device(device)
    with _LOCK:
        c = _BY_DEVICE.get(device)
        if c is None or c.backend != _backend(device.type):
            c = _BY_DEVICE[device] = CompiledSteps(device)
        return c
