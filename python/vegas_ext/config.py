"""Every Vegas option in one place: names, defaults, types, ranges, and the checks that enforce them.

Used by the decode loop (:func:`vegas_ext.generate`), the ``vegas`` CLI and the vLLM plugin
(:class:`vegas_ext.vllm.VegasOptions`), so each surface accepts and refuses the same values with
the same words. Standard library only (no torch, no numpy): the CLI checks its flags before the
heavy imports.

Types are checked, never coerced: ``True`` is not an int, ``1.5`` is not an int, ``"0.5"`` is not
a float, ``"no"`` is not a bool; NaN and infinities are refused where a number is expected. An
integer option also takes a numpy integer scalar or a 0-d integer tensor (exactly integral values
only; ``torch.tensor(2.0)`` and ``numpy.float64(2)`` are refused), returned as a Python ``int``.
Integers are bounded to int64, and to int32 where the kernels take them as int32 (budget tokens,
sink blocks). A wrong type raises :class:`OptionTypeError` (a ``TypeError`` that is also a
``ValueError``, so code catching ``ValueError`` for bad options still catches it); a value out of
range raises ``ValueError``. Both name the argument and what was expected.

One word per concept in code:

* ``num_speculative_tokens`` -- the drafts per iteration, the paper's γ (``gamma`` in local
  variables and the ``--gamma`` alias of the CLI flag; vLLM's name for the same number);
* *block* -- the unit of KV selection, ``block_size`` tokens. The vLLM plugin selects whole KV
  cache blocks of vLLM, which its public options call *pages* (``num_sink_pages`` is the loop's
  ``num_sink_blocks``; a page is a block whose size is vLLM's ``block_size``). The public names are
  kept; :func:`budget_blocks` is the one budget formula for both.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

__all__ = [
    "INT32_MAX", "INT64_MAX", "INT64_MIN", "SEED_MAX", "MAX_BATCH_SIZE", "MIN_TEMPERATURE",
    "ALGORITHMS", "VLLM_ALGORITHMS", "DEFAULT_BLOCK_SIZE", "SUPPORTED_MODEL_TYPES", "QUERY_WEIGHTS",
    "DRAFT_WEIGHTS", "REFUSED_DRAFT_WEIGHTS", "DEVICE_DRAFT_WEIGHTS", "MODEL_DTYPES", "Option", "OPTIONS",
    "OptionTypeError",
    "check_int", "check_float", "check_bool", "check_choice", "check_token_ids",
    "check_length", "check_speculation", "check_budget", "check_selection", "check_sampling",
    "check_generate_options", "check_seed", "check_draft_weights", "budget_blocks", "check_model_path",
    "DOORS", "door_options", "GAMMA_POLICIES", "DRAFT_GRANULARITIES", "LOOP_OPTIONS", "RETIRED_OPTIONS", "VegasConfig",
]

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
#: ``torch.manual_seed`` takes ``[-2**63, 2**64 - 1]``.
SEED_MAX = 2**64 - 1
#: The CLI's ``--batch-size`` bound (it repeats the prompts into that many rows up front).
MAX_BATCH_SIZE = 65536

#: The built-in ``sparse_attn_algorithm`` names. The decode loop's registry
#: (``vegas_ext.selection.SELECTION_ALGORITHMS``) maps each to its class, plus any algorithm
#: registered later; a test keeps the two equal.
ALGORITHMS: Tuple[str, ...] = ("full", "quest", "streamingllm", "vegas")
#: The algorithms the vLLM plugin implements.
VLLM_ALGORITHMS: Tuple[str, ...] = ("vegas", "streamingllm")
#: ``block_size=None`` means this, per algorithm (the classes' ``default_block_size``).
DEFAULT_BLOCK_SIZE: Mapping[str, int] = {"full": 16, "quest": 16, "streamingllm": 16, "vegas": 1}
#: ``config.model_type`` values the HF drop-in and the vLLM plugin support (decoder-only
#: attention through one KV cache).
SUPPORTED_MODEL_TYPES: Tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral")
QUERY_WEIGHTS: Tuple[str, ...] = ("all", "first_last")
#: ``gamma_policy`` values: the number of drafts chosen per iteration from the measured acceptance
#: and costs (``"auto"``), or always ``num_speculative_tokens`` (``"fixed"``).
GAMMA_POLICIES: Tuple[str, ...] = ("auto", "fixed")
#: The vLLM plugin's ``draft_granularity`` values: drafts attend to selected tokens or whole pages.
DRAFT_GRANULARITIES: Tuple[str, ...] = ("page", "token")
#: ``draft_weights``: the precision of the weights the draft steps read (``None``: the model's own).
#: Only what is implemented: the lists shown in errors and ``--help`` come from here.
DRAFT_WEIGHTS: Tuple[Optional[str], ...] = (None, "fp16", "int8")
#: ``draft_weights`` values that run on some devices only: accepted by the option check (``generate``,
#: HF ``generate``), refused with the reason where the draft copies are made on another device. Not in
#: :data:`DRAFT_WEIGHTS`, whose lists (errors, the CLI's ``--help``, vLLM-CPU) offer what runs everywhere.
DEVICE_DRAFT_WEIGHTS: Mapping[str, str] = {
    "fp8": "CUDA GPUs of compute capability >= 8.9 (float8 e4m3 weights and activations through torch._scaled_mm)",
}
#: ``draft_weights`` values that were measured and rejected: value -> why (said when one is asked for).
REFUSED_DRAFT_WEIGHTS: Mapping[str, str] = {
    "int4": ("4-bit weights (groups of 32) agreed with the fp32 model's next-token argmax on only 60-61 % of "
             "positions on SmolLM2-135M (issue 33; 53-71 % on three documents in "
             "bench/results/draft_weights_xeon_avx512), too few accepted drafts to pay for verifying them; "
             "use 'int8' (97-98 %) or 'fp16' (99.6-100 %)"),
}
#: The smallest sampling ``temperature``: the fp32 logits are divided by it, and below ~1e-37 a
#: logit of a few units overflows to ``inf`` (the softmax gives NaN); at 1e-5 a logit would have to
#: exceed 3e33 to overflow. Lower it toward greedy with ``do_sample=False`` instead.
MIN_TEMPERATURE = 1e-5
#: The model dtypes the Vegas ops compute in (``str(torch.float32)`` without ``"torch."``).
MODEL_DTYPES: Tuple[str, ...] = ("float32", "bfloat16", "float16")


class OptionTypeError(TypeError, ValueError):
    """An option of the wrong type. Also a ``ValueError``: bad options raised ``ValueError``
    before, and callers (the CLI among them) catch that."""


# ------------------------------------------------------------------------------ primitives

def _describe(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _integral(v: Any) -> Optional[int]:
    """``v`` as a Python int if it is an exact integer (int, numpy integer scalar, 0-d integer
    tensor or array; never a bool), else ``None``."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return int(v)
    # numpy scalars / 0-d arrays / 0-d tensors, by duck typing so numpy and torch stay unimported
    if getattr(v, "ndim", None) == 0 and hasattr(v, "tolist"):
        x = v.tolist()
        if isinstance(x, int) and not isinstance(x, bool):
            return x
    return None


def check_int(v: Any, name: str, low: Optional[int] = 0, high: Optional[int] = INT64_MAX, *,
              none_ok: bool = False, what: str = "") -> Optional[int]:
    """``v`` as an ``int`` in ``[low, high]`` (``None`` passes with ``none_ok``).

    Raises:
        OptionTypeError: not an exact integer (bools, floats, strings, arrays refused).
        ValueError: outside ``[low, high]``. Both messages start with ``name``.
    """
    if v is None and none_ok:
        return None
    x = _integral(v)
    # a CLI flag ("--...") is left out rather than given None
    expect = _int_range(low, high) + (" or None" if none_ok and not name.startswith("--") else "")
    expect += f" ({what})" if what else ""
    if x is None:
        raise OptionTypeError(f"{name} must be {expect}, got {_describe(v)} of type {type(v).__name__}")
    if (low is not None and x < low) or (high is not None and x > high):
        raise ValueError(f"{name} must be {expect}, got {x}")
    return x


def _int_range(low, high) -> str:
    if high is None:
        return f"an integer >= {low}"
    if high in (INT32_MAX, INT64_MAX, SEED_MAX):
        hi = {INT32_MAX: "2**31 - 1", INT64_MAX: "2**63 - 1", SEED_MAX: "2**64 - 1"}[high]
    else:
        hi = str(high)
    if low is None:
        return f"an integer <= {hi}"
    if low == INT64_MIN:
        return f"an integer in [-2**63, {hi}]"
    return f"an integer in [{low}, {hi}]"


def check_float(v: Any, name: str, low: float, high: float, *, low_open: bool = False,
                high_open: bool = False) -> float:
    """``v`` (an int or a float, not a bool or a string) as a finite ``float`` in the interval
    from ``low`` to ``high`` (open at either end as asked; ``math.inf`` for no bound).

    Raises:
        OptionTypeError: not a real number. ValueError: NaN, infinite, or outside the interval.
    """
    if math.isfinite(low) and math.isfinite(high):
        expect = f"a finite number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    elif math.isfinite(low):
        expect = f"a finite number {'>' if low_open else '>='} {low:g}"
    elif math.isfinite(high):
        expect = f"a finite number {'<' if high_open else '<='} {high:g}"
    else:
        expect = "a finite number"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        # numpy floating scalars are floats (float64) or have ndim 0 and a float tolist()
        x = v.tolist() if getattr(v, "ndim", None) == 0 and hasattr(v, "tolist") else None
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise OptionTypeError(f"{name} must be {expect}, got {_describe(v)} of type {type(v).__name__}")
        v = x
    try:
        f = float(v)
    except OverflowError:  # an int beyond the float range
        raise ValueError(f"{name} must be {expect}, got {_describe(v)}") from None
    ok = math.isfinite(f) and (f > low if low_open else f >= low) and (f < high if high_open else f <= high)
    if not ok:
        raise ValueError(f"{name} must be {expect}, got {_describe(v)}")
    return f


def check_bool(v: Any, name: str) -> bool:
    """``v`` if it is a ``bool`` (``True`` / ``False`` only: no ints, no strings, no truthiness)."""
    if not isinstance(v, bool):
        raise OptionTypeError(f"{name} must be True or False, got {_describe(v)} of type {type(v).__name__}")
    return v


def _str_value(v: Any) -> Optional[str]:
    """The plain ``str`` value of ``v`` if it is a ``str`` (a subclass too: ``numpy.str_``, a
    user's ``str`` subclass; read without its own ``__str__`` / ``__eq__``), else ``None``."""
    return str.__str__(v) if isinstance(v, str) else None


def check_draft_weights(v: Any, name: str = "draft_weights") -> Optional[str]:
    """``v`` if it is one of :data:`DRAFT_WEIGHTS`, else ``ValueError`` naming ``name`` and the
    valid values (a value of :data:`REFUSED_DRAFT_WEIGHTS`, ``"int4"``, with the measured reason); a
    value of :data:`DEVICE_DRAFT_WEIGHTS` (``"fp8"``) passes here and is checked against the model's
    device when the copies are made (:mod:`vegas_ext.draft_weights`)."""
    sv = _str_value(v)
    if sv in DEVICE_DRAFT_WEIGHTS and not isinstance(v, bool):
        return sv
    if sv in REFUSED_DRAFT_WEIGHTS:
        raise ValueError(f"{name}={sv!r} is not supported: {REFUSED_DRAFT_WEIGHTS[sv]}")
    if isinstance(v, bool) or (v is not None and (sv is None or sv not in DRAFT_WEIGHTS)):
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in DRAFT_WEIGHTS)}, got {_describe(v)}")
    return sv


def check_choice(v: Any, name: str, choices: Iterable[Any]) -> Any:
    """The choice ``v`` is (compared by type and value: ``1`` is not ``True``); a ``str`` subclass
    (``numpy.str_``) whose value is a string choice counts as that choice and is returned as the
    plain ``str``."""
    choices = tuple(choices)
    sv = _str_value(v)
    for c in choices:
        if type(c) is str and sv is not None:
            if sv == c:
                return c
        elif type(v) is type(c) and v == c:
            return v
    shown = ", ".join(repr(c) for c in choices)
    got = _describe(v if sv is None or type(v) is str else sv)
    if sv is not None and type(v) is not str:
        got += f" (a {type(v).__name__})"
    raise ValueError(f"{name} must be one of {shown}, got {got}")


def check_token_ids(v: Any, name: str = "eos_token_id") -> List[int]:
    """``v`` as a list of token ids, each an integer in ``[0, 2**63 - 1]``.

    Takes ``None`` (no ids), one id (an int, numpy integer or 0-d integer tensor), a list or tuple
    of them, or a 1-D integer tensor / numpy array (taken as the list of its values).

    Raises:
        OptionTypeError: anything else (floats, strings, bools, 2-D arrays). ValueError: an id
        out of range.
    """
    if v is None:
        return []
    expect = "token ids: an int or a list / 1-D integer tensor of ints in [0, 2**63 - 1]"
    if isinstance(v, (list, tuple)):
        vals = list(v)
    elif getattr(v, "ndim", None) == 1 and hasattr(v, "tolist"):
        vals = v.tolist()
    elif getattr(v, "ndim", 0) not in (0, None):
        raise OptionTypeError(f"{name} must be {expect}, got a {v.ndim}-D {type(v).__name__}")
    else:
        vals = [v]
    out = []
    for x in vals:
        i = _integral(x)
        if i is None:
            raise OptionTypeError(f"{name} must be {expect}, got {_describe(x)} of type {type(x).__name__}")
        if not 0 <= i <= INT64_MAX:
            raise ValueError(f"{name} must be {expect}, got {i}")
        out.append(i)
    return out


def check_seed(v: Any, name: str = "seed") -> int:
    """A random seed: an integer in ``[-2**63, 2**64 - 1]`` (what ``torch.manual_seed`` takes)."""
    return check_int(v, name, INT64_MIN, SEED_MAX)


# ------------------------------------------------------------------------------ the option table

#: The doors an option can be given through: :func:`vegas_ext.generate`, HF's ``model.generate``
#: (``custom_generate=vegas_ext.hf.generate``), the ``vegas generate`` CLI, the vLLM plugin.
DOORS: Tuple[str, ...] = ("generate", "hf", "cli", "vllm")
_LOOP_DOORS = ("generate", "hf", "cli")


@dataclass(frozen=True)
class Option:
    """One option: its API name, default, kind (``"int"``, ``"float"``, ``"bool"``,
    ``"choice"``, ``"gamma"``), range and what it means. ``low_open`` / ``high_open``: open ends
    of a float interval; ``none_ok``: ``None`` allowed; ``cli``: the ``vegas generate`` flag;
    ``vllm``: the key of the vLLM plugin's ``speculative_config`` (``None``: not offered there);
    ``doors``: where it is offered (:data:`DOORS`); ``door_defaults``: a door whose default must
    differ, ``{door: (default, why)}``."""

    name: str
    default: Any
    kind: str
    low: Any = None
    high: Any = None
    low_open: bool = False
    high_open: bool = False
    none_ok: bool = False
    choices: Tuple[Any, ...] = ()
    cli: Optional[str] = None
    doc: str = ""
    vllm: Optional[str] = None
    doors: Tuple[str, ...] = _LOOP_DOORS
    door_defaults: Mapping[str, Tuple[Any, str]] = field(default_factory=dict)

    def default_at(self, door: str) -> Any:
        """This option's default at ``door`` (one of :data:`DOORS`)."""
        return self.door_defaults[door][0] if door in self.door_defaults else self.default

    def check(self, v: Any, label: Optional[str] = None, *, choices: Optional[Iterable[Any]] = None) -> Any:
        """``v`` validated (and normalized: numpy / 0-d tensor integers to ``int``); errors name
        ``label`` (default the option's name)."""
        name = label or self.name
        if v is None and self.none_ok:
            return None
        if self.kind == "int":
            return check_int(v, name, self.low, self.high, none_ok=self.none_ok)
        if self.kind == "float":
            return check_float(v, name, self.low, self.high, low_open=self.low_open, high_open=self.high_open)
        if self.kind == "bool":
            return check_bool(v, name)
        if self.kind == "choice":
            if self.name == "draft_weights" and choices is None:  # a refused value gets its reason
                return check_draft_weights(v, name)
            return check_choice(v, name, self.choices if choices is None else choices)
        if self.kind == "gamma":
            if _str_value(v) == "auto":  # numpy.str_ and other str subclasses too, as a choice
                return "auto"
            if _integral(v) is None:
                raise OptionTypeError(f"{name} must be 'auto' or {_int_range(self.low, self.high)}, got "
                                      f"{_describe(v)} of type {type(v).__name__}")
            return check_int(v, name, self.low, self.high, what="or 'auto'")
        raise AssertionError(self.kind)


def _opt(*a, **k) -> Option:
    return Option(*a, **k)


#: Every option, once: name, default, type and range, the ``vegas generate`` flag, the vLLM key.
#: The defaults are the fastest lossless ones measured (docs/options.md); a door whose default
#: differs says why. :class:`VegasConfig` is built from this table at every door.
OPTIONS: Dict[str, Option] = {o.name: o for o in (
    _opt("max_new_tokens", None, "int", 0, INT64_MAX, cli="--max-new-tokens", doors=("generate", "cli"),
         doc="new tokens per row (the CLI asks for >= 1)",
         door_defaults={"cli": (128, "a command line needs a length; HF's generate takes its own")}),
    _opt("num_speculative_tokens", 8, "gamma", 0, INT64_MAX, cli="--num-speculative-tokens",
         vllm="num_speculative_tokens", doors=DOORS,
         doc="γ's cap: the most drafts per iteration (0: plain steps; the CLI and vLLM ask for >= 1); 'auto' is "
             "gamma_policy='auto' with the default cap",
         door_defaults={"vllm": (6, "vLLM reserves γ lookahead slots per request in every step; the plugin's "
                                    "grid (docs/vllm_gamma.md) was measured at γ <= 6")}),
    _opt("gamma_policy", "auto", "choice", choices=GAMMA_POLICIES, cli="--gamma-policy", vllm="gamma_policy",
         doors=DOORS, doc="'auto': each iteration (vLLM: each request) drafts 0..num_speculative_tokens, chosen "
                          "from the measured acceptance and step costs; 'fixed': always num_speculative_tokens"),
    _opt("draft_weights", "int8", "choice", choices=DRAFT_WEIGHTS, cli="--draft-weights", vllm="draft_weights",
         doors=DOORS, doc="precision of the weights the draft steps read; none: the model's own (verification "
                          "always reads the model's own, so the output is unchanged)"),
    _opt("sparse_attn_algorithm", "vegas", "choice", choices=ALGORITHMS, cli="--algorithm",
         vllm="sparse_attn_algorithm", doors=DOORS,
         doc="the draft's KV selection: vegas, streamingllm, quest, or full (plain decoding through the same "
             "cache and kernels); vLLM: vegas, streamingllm"),
    _opt("sparse_attn_ratio", 0.05, "float", 0.0, 1.0, low_open=True, cli="--ratio", vllm="sparse_attn_ratio",
         doors=DOORS, doc="draft KV budget as a fraction of the context"),
    _opt("sparse_attn_min_tokens", 256, "int", 0, INT32_MAX, cli="--min-tokens", vllm="sparse_attn_min_tokens",
         doors=DOORS, doc="lower clamp of the budget in tokens (at most 2**31 - 1)"),
    _opt("sparse_attn_max_tokens", None, "int", 1, INT64_MAX, none_ok=True, cli="--max-tokens",
         vllm="sparse_attn_max_tokens", doors=DOORS,
         doc="upper clamp of the budget in tokens, at least the lower clamp (and 1); none: no clamp"),
    _opt("block_size", None, "int", 1, INT64_MAX, none_ok=True, cli="--block-size",
         doc="tokens per KV selection block; none: the algorithm's (1 for vegas, 16 for streamingllm and "
             "quest; vLLM: its page size)"),
    _opt("num_sink_blocks", 1, "int", 0, INT32_MAX, cli="--sink-blocks", vllm="num_sink_pages", doors=DOORS,
         doc="leading blocks always selected (attention sinks); the plugin's blocks are vLLM's pages"),
    _opt("num_recent_tokens", 32, "int", 0, INT32_MAX, cli="--recent-tokens",
         doc="vegas: the tokens just before the draft tail (whole blocks of them) are always selected, within "
             "the budget, and the top-scored blocks fill the rest (a local window, as SparseSpec-L keeps); 0: "
             "the top-scored alone (the paper's)"),
    _opt("share_selection_across_heads", False, "bool", cli="--share-selection",
         doc="one block set per layer instead of one per KV head"),
    _opt("query_weights", "all", "choice", choices=QUERY_WEIGHTS, cli="--query-weights",
         doc="verification queries that score blocks"),
    _opt("selection_refresh_interval", 1, "int", 1, INT64_MAX, cli="--refresh-interval",
         doc="re-select the draft blocks every n iterations"),
    _opt("score_decay", 0.8, "float", 0.0, 1.0, cli="--score-decay",
         doc="vegas (any strategy reading verification scores): block scores = score_decay x those stored "
             "before + the last verification's (a sum over its queries), so blocks that recent verifications "
             "attended to stay selected; 0: the last verification's alone (the paper's)"),
    _opt("draft_granularity", "page", "choice", choices=DRAFT_GRANULARITIES, vllm="draft_granularity",
         doors=("vllm",), doc="vLLM: drafts attend to whole selected pages or to selected tokens (the loop's "
                              "block_size=1)"),
    # HF's generate takes these four (and the length) from its own generation config
    _opt("do_sample", False, "bool", cli="--do-sample", doc="speculative sampling instead of greedy",
         doors=("generate", "cli")),
    _opt("temperature", 1.0, "float", MIN_TEMPERATURE, math.inf, cli="--temperature", doors=("generate", "cli"),
         doc="sampling temperature, >= 1e-05 (range checked with do_sample)"),
    _opt("top_k", 0, "int", 0, INT64_MAX, cli="--top-k", doc="top-k filter, 0 = off", doors=("generate", "cli")),
    _opt("top_p", 1.0, "float", 0.0, 1.0, low_open=True, cli="--top-p", doors=("generate", "cli"),
         doc="nucleus filter (range checked with do_sample)"),
    _opt("return_cache", False, "bool", doors=("generate",), doc="also return the KV cache"),
    _opt("compile_steps", False, "bool", cli="--compile-steps",
         doc="run the draft, verification and plain steps under torch.compile(fullgraph=True), one graph per "
             "(rows, tokens); on CUDA as CUDA graphs (mode='reduce-overhead'); finished rows stay in the batch "
             "and rows verify equal token counts"),
)}
#: Options that were folded into others: name -> what to pass instead.
RETIRED_OPTIONS: Mapping[str, str] = {
    "max_speculative_tokens": "pass the cap as num_speculative_tokens=N (with gamma_policy='auto', the default)",
}
#: The options of the decode loop (:class:`VegasConfig`'s fields), in table order.
LOOP_OPTIONS: Tuple[str, ...] = tuple(n for n, o in OPTIONS.items() if set(o.doors) & set(_LOOP_DOORS))


def door_options(door: str) -> Tuple[str, ...]:
    """The options offered at ``door`` (one of :data:`DOORS`), in table order."""
    return tuple(n for n, o in OPTIONS.items() if door in o.doors)


def _label(name: str, labels: Optional[Mapping[str, str]]) -> str:
    return (labels or {}).get(name, name)


def _check(names: Iterable[str], values: Mapping[str, Any], labels, skip=()) -> Dict[str, Any]:
    return {n: OPTIONS[n].check(values[n], _label(n, labels)) for n in names if n in values and n not in skip}


# ------------------------------------------------------------------------------ option families
# Each takes the options by their API names and returns them validated and normalized; ``labels``
# maps an API name to the name the caller's user knows (a CLI flag, a vLLM option).

def check_length(max_new_tokens: Any, labels: Optional[Mapping[str, str]] = None) -> int:
    """``max_new_tokens``: an int in ``[0, 2**63 - 1]``."""
    return OPTIONS["max_new_tokens"].check(max_new_tokens, _label("max_new_tokens", labels))


def check_speculation(values: Mapping[str, Any], labels: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """``num_speculative_tokens`` ('auto' or an int >= 0), ``gamma_policy`` (one of
    :data:`GAMMA_POLICIES`) and ``draft_weights`` (one of :data:`DRAFT_WEIGHTS`), those of them in
    ``values``."""
    return _check(("num_speculative_tokens", "gamma_policy", "draft_weights"), values, labels)


def check_budget(values: Mapping[str, Any], labels: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """The draft's KV budget: ``sparse_attn_ratio`` in ``(0, 1]``, ``sparse_attn_min_tokens`` in
    ``[0, 2**31 - 1]``, ``sparse_attn_max_tokens`` ``None`` or ``>= max(1, min_tokens)``,
    ``block_size`` ``None`` or ``>= 1``, ``num_sink_blocks`` in ``[0, 2**31 - 1]`` (those present)."""
    out = _check(("sparse_attn_ratio", "sparse_attn_min_tokens", "sparse_attn_max_tokens", "block_size",
                  "num_sink_blocks"), values, labels)
    mx, mn = out.get("sparse_attn_max_tokens"), out.get("sparse_attn_min_tokens", 0)
    if mx is not None and mx < max(1, mn):
        name = _label("sparse_attn_max_tokens", labels)
        # the bound's name without the caller's prefix ("vegas_ext.vllm: "), which starts the message
        mn_name = _label("sparse_attn_min_tokens", labels).rsplit(": ", 1)[-1]
        raise ValueError(f"{name} must be {'' if name.startswith('--') else 'None or '}an integer >= "
                         f"max(1, {mn_name}) = {max(1, mn)}, got {mx}")
    return out


def check_selection(values: Mapping[str, Any], labels: Optional[Mapping[str, str]] = None,
                    algorithms: Optional[Iterable[str]] = None) -> Dict[str, Any]:
    """``sparse_attn_algorithm`` (one of ``algorithms``, default :data:`ALGORITHMS`),
    ``share_selection_across_heads`` (bool), ``query_weights`` (one of :data:`QUERY_WEIGHTS`),
    ``selection_refresh_interval`` (>= 1), ``score_decay`` (in ``[0, 1]``), ``num_recent_tokens``
    (in ``[0, 2**31 - 1]``), those present."""
    out = _check(("share_selection_across_heads", "query_weights", "selection_refresh_interval", "score_decay",
                  "num_recent_tokens"), values, labels)
    if "sparse_attn_algorithm" in values:
        name = _label("sparse_attn_algorithm", labels)
        out["sparse_attn_algorithm"] = OPTIONS["sparse_attn_algorithm"].check(
            values["sparse_attn_algorithm"], name, choices=sorted(algorithms) if algorithms is not None else None)
    return out


def check_sampling(values: Mapping[str, Any], labels: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """``do_sample`` (bool), ``temperature`` (a finite number, >= :data:`MIN_TEMPERATURE` when
    sampling), ``top_k``
    (an int >= 0), ``top_p`` (a number, in ``(0, 1]`` when sampling), those present. Types are
    always checked; the ranges of ``temperature`` and ``top_p`` only when ``do_sample`` (greedy
    ignores them, as HF's ``generate`` does)."""
    out = _check(("do_sample", "top_k"), values, labels)
    sampling = out.get("do_sample", False)
    for n in ("temperature", "top_p"):
        if n not in values:
            continue
        if sampling:
            out[n] = OPTIONS[n].check(values[n], _label(n, labels))
        else:  # type only
            out[n] = check_float(values[n], _label(n, labels), -math.inf, math.inf)
    return out


def check_generate_options(values: Mapping[str, Any], labels: Optional[Mapping[str, str]] = None,
                           algorithms: Optional[Iterable[str]] = None) -> Dict[str, Any]:
    """Every option family over ``values`` (API names; absent ones are skipped): the options
    validated and normalized, in one dict. ``algorithms``: the accepted ``sparse_attn_algorithm``
    names (the decode loop passes its registry)."""
    out: Dict[str, Any] = {}
    if "max_new_tokens" in values:
        out["max_new_tokens"] = check_length(values["max_new_tokens"], labels)
    out.update(check_selection(values, labels, algorithms))
    out.update(check_speculation(values, labels))
    out.update(check_budget(values, labels))
    out.update(check_sampling(values, labels))
    for n in ("return_cache", "compile_steps"):
        if n in values:
            out[n] = OPTIONS[n].check(values[n], _label(n, labels))
    return out


# ------------------------------------------------------------------------------ the one options value

def _default(name: str) -> Any:
    return OPTIONS[name].default  # the table's, written once


@dataclass(frozen=True)
class VegasConfig:
    """Every option of the decode loop, validated once: what :func:`vegas_ext.generate`, HF's
    ``model.generate(custom_generate=vegas_ext.hf.generate)`` and the ``vegas`` CLI build from
    their arguments (:meth:`build`) and carry to the loop, the γ policy and the kernels, which do
    not check again. Fields: the :data:`LOOP_OPTIONS` (:data:`OPTIONS` says each one's type,
    range, default and meaning); ``num_speculative_tokens`` is always the int cap here (``"auto"``
    given at a door becomes ``gamma_policy="auto"`` with the door's default cap).

    Build with :meth:`build` (or :meth:`replace`), not the constructor: they validate."""

    max_new_tokens: Optional[int] = _default("max_new_tokens")
    num_speculative_tokens: int = _default("num_speculative_tokens")
    gamma_policy: str = _default("gamma_policy")
    draft_weights: Optional[str] = _default("draft_weights")
    sparse_attn_algorithm: str = _default("sparse_attn_algorithm")
    sparse_attn_ratio: float = _default("sparse_attn_ratio")
    sparse_attn_min_tokens: int = _default("sparse_attn_min_tokens")
    sparse_attn_max_tokens: Optional[int] = _default("sparse_attn_max_tokens")
    block_size: Optional[int] = _default("block_size")
    num_sink_blocks: int = _default("num_sink_blocks")
    num_recent_tokens: int = _default("num_recent_tokens")
    share_selection_across_heads: bool = _default("share_selection_across_heads")
    query_weights: str = _default("query_weights")
    selection_refresh_interval: int = _default("selection_refresh_interval")
    score_decay: float = _default("score_decay")
    do_sample: bool = _default("do_sample")
    temperature: float = _default("temperature")
    top_k: int = _default("top_k")
    top_p: float = _default("top_p")
    return_cache: bool = _default("return_cache")
    compile_steps: bool = _default("compile_steps")

    @classmethod
    def build(cls, values: Optional[Mapping[str, Any]] = None, *, door: str = "generate",
              labels: Optional[Mapping[str, str]] = None, algorithms: Optional[Iterable[str]] = None,
              base: Optional["VegasConfig"] = None) -> "VegasConfig":
        """The config of ``values`` (API names; absent ones take ``base``'s value, else the
        default at ``door``), validated: types, then ranges, then how options combine.
        ``labels`` maps an API name to the name the door's user knows (a CLI flag);
        ``algorithms``: the accepted ``sparse_attn_algorithm`` names (default :data:`ALGORITHMS`).

        Raises:
            OptionTypeError: an unknown option name (listing the known ones) or a wrong type.
            ValueError: a value out of range, a retired option (with what to pass instead), or
                ``num_speculative_tokens='auto'`` with ``gamma_policy='fixed'``.
        """
        values = dict(values or {})
        for name in values:
            if name in RETIRED_OPTIONS:
                raise ValueError(f"{_label(name, labels)} is no longer an option: {RETIRED_OPTIONS[name]}")
        unknown = sorted(set(values) - set(LOOP_OPTIONS))
        if unknown:
            raise OptionTypeError(f"unknown option(s) {', '.join(unknown)}; the options are: {', '.join(LOOP_OPTIONS)}")
        checked = check_generate_options(values, labels, algorithms)
        if base is not None:
            out = {f.name: getattr(base, f.name) for f in fields(cls)}
        else:
            out = {n: OPTIONS[n].default_at(door) for n in LOOP_OPTIONS}
        out.update(checked)
        if checked.get("num_speculative_tokens") == "auto":
            if checked.get("gamma_policy", "auto") != "auto":
                raise ValueError(f"{_label('num_speculative_tokens', labels)}='auto' asks for "
                                 f"{_label('gamma_policy', labels)}='auto', got {checked['gamma_policy']!r}; pass "
                                 "the cap as an int with gamma_policy='fixed'")
            out["num_speculative_tokens"] = OPTIONS["num_speculative_tokens"].default_at(door)
            out["gamma_policy"] = "auto"
        return cls(**out)

    def replace(self, **values: Any) -> "VegasConfig":
        """A copy with ``values`` changed, validated as :meth:`build` does."""
        return type(self).build(values, base=self)

    def to_dict(self) -> Dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# ------------------------------------------------------------------------------ the budget

def budget_blocks(context_len: Any, ratio: float, min_tokens: int, max_tokens: Optional[int], block_size: int):
    """Blocks in the draft's KV budget, sinks included, the tail not:
    ``ceil(clamp(ceil(ratio * context_len), min_tokens, max_tokens) / block_size)``.

    The one budget formula of the decode loop (``block_size`` tokens per block) and the vLLM
    plugin (its pages: vLLM's KV cache blocks).

    Args:
        context_len: an ``int`` (or a numpy / 0-d tensor integer), or an integer tensor ``[B]``
            (torch is not imported here: the tensor's own methods compute it, in float64).
        ratio, min_tokens, max_tokens: the budget in tokens (``max_tokens`` ``None``: no cap).
        block_size: tokens per block (>= 1).

    Returns:
        an ``int``, or an int32 tensor ``[B]`` for a tensor ``context_len``.
    """
    if getattr(context_len, "ndim", 0) == 0:  # an int (numpy and 0-d tensor integers too)
        n = _integral(context_len)
        if n is None:
            raise OptionTypeError(
                f"context_len must be an integer or an integer tensor [B], got {_describe(context_len)}")
        tok = max(math.ceil(n * ratio), min_tokens)
        if max_tokens is not None:
            tok = min(tok, max_tokens)
        return -(-tok // block_size)
    tok = (context_len.double() * ratio).ceil().clamp(min=min_tokens)
    if max_tokens is not None:
        tok = tok.clamp(max=max_tokens)
    return (tok / block_size).ceil().int()


# ------------------------------------------------------------------------------ the model argument

def check_model_path(spec: str) -> None:
    """What can be told about a model argument (``vegas_ext.models.load_model(model)``, the CLI's
    ``--model``; ``~`` expanded) without opening a file: ``ValueError`` naming it when it is a
    missing path, a file that is not ``.gguf``, or a folder with neither ``config.json`` nor exactly
    one ``.gguf`` file. A name that is not a path (a hub id) passes: only the model cache can tell."""
    if spec.endswith(".gguf") or os.path.isfile(spec):
        if not os.path.isfile(spec):
            raise ValueError(f"model file not found: {spec}")
        if not spec.endswith(".gguf"):
            raise ValueError(f"model file {spec} is not a .gguf file; pass a .gguf file or a model folder")
    elif os.path.isdir(spec):
        if os.path.isfile(os.path.join(spec, "config.json")):
            return
        try:
            ggufs = sum(f.endswith(".gguf") for f in os.listdir(spec))
        except OSError as e:
            raise ValueError(f"cannot read the model folder {spec}: {e.strerror}") from None
        if ggufs != 1:
            raise ValueError(f"{spec} is not a Hugging Face model folder (no config.json, and not one .gguf file)")
    elif spec.startswith((".", "/", "~")) or os.sep in spec.strip("/").replace("/", "", 1):
        raise ValueError(f"model path not found: {spec}")
