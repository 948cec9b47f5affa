"""The Vegas proposer for vLLM: γ draft tokens from the target model itself over a few KV pages.

Built by vLLM's ``custom_class`` method (``speculative_config={"model":
"vegas_ext.vllm.proposer.VegasProposer", ...}``, see :func:`vegas_ext.vllm.speculative_config`)
and driven by the runner hook of :mod:`vegas_ext.vllm._patches`, right after the verification
forward and sampling of each step, in the same process and batch order.

For every request that sampled a token this step, with ``P`` the position of that token (its K/V
not yet written) and the verification window ``[tail_start, seq_len)`` (the last
``min(q_len, γ + 1)`` tokens of the step's forward):

1. Budget: ``K = ceil(clamp(ceil(ratio * (P + 1)), min_tokens, max_tokens) / page_size)`` pages,
   sinks included, among the candidate pages ``[0, tail_start // page_size)`` (all of them when
   ``K`` covers them: the draft is then dense).
2. Selection, per layer: ``"vegas"`` -- :func:`vegas_ext.ops.block_topk` of the page scores the
   attention backend recorded on this step's forward (attention mass of the window's queries
   summed over the layer's KV heads on this rank), sink pages first; ``"streamingllm"`` -- sink
   pages plus the most recent candidates (:func:`vegas_ext.selection.streaming_indices`).
3. Draft step ``j = 0 .. γ-1``: one token per request at position ``P + j``; every layer attends
   through its own compacted block table ``[selected pages | tail pages]`` (the tail pages run from
   ``tail_start // page_size`` to the current page) with ``seq_len = K_sel * page_size +
   (P + j + 1 - tail_page0 * page_size)``; the token's K/V go to its real slot (the scheduler
   reserved γ lookahead slots). The next draft token is the argmax of the logits (identical on
   every tensor-parallel rank: vLLM all-gathers logits on CPU).

With ``draft_granularity="token"`` (issue 32) steps 1-3 work on tokens instead of pages, as the
decode loop does at block size 1: the budget is ``clamp(ceil(ratio * (P + 1)), min_tokens,
max_tokens)`` tokens (``num_sink_pages * page_size`` sink tokens first) among the candidates
``[0, tail_start)``; ``"vegas"`` ranks them per (layer, KV head) by the per-token attention mass of
the verification (the backend's ``score_block_size=1``); each draft step attends through the real
block table with :func:`vegas_ext.ops.paged_sparse_draft_attention` (the selected tokens of the
layer's KV head, then the tail ``[tail_start, P + j]``).

A request drafts fewer tokens when its reserved slots or ``max_model_len`` end earlier, and none
when it sampled nothing this step (a partial prefill chunk). With ``gamma_policy="auto"`` each
request drafts its own number ``0..γ`` (γ = ``num_speculative_tokens``, the lookahead the scheduler
reserves), chosen every step by :class:`vegas_ext.speculation.PerRequestGamma` from that request's
acceptance (``sampled_token_ids`` holds 1 + the accepted drafts of its last step) and the step costs
timed here, in seconds: the rest of the engine step between two calls (target forward, sampling,
scheduling: ``verify``, with the tokens it verified), each draft forward (with the requests it
drafted) and the selection. When no request drafts, the next
target forward records no page scores; a request that drafts right after such a step drafts over
StreamingLLM pages (lossless either way). Verification rewrites the drafts' K/V
with exact values, and vLLM's rejection sampler accepts; the proposer returns token ids only.

Debug counters (:attr:`VegasProposer.stats`) count draft forwards, pages read and the budget;
``VEGAS_VLLM_STATS_DIR`` makes each rank write them to ``<dir>/stats-rank<r>.json`` after every
step.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Dict, List

import numpy as np
import torch

from .. import ops
from ..selection import streaming_indices
from ..speculation import IterationCosts, make_gamma_policy
from . import draft_linears
from .backend import DraftKV, VegasState, attach_state, gather_draft_kv
from .cpu_layout import PLAIN_KEY_ISAS
from .options import ADDITIONAL_CONFIG_KEY, VegasOptions

__all__ = ["VegasProposer"]


@dataclass
class _Drafting:
    """The requests of one step that draft, as index tensors on the cache's device.

    ``rows``: batch indices; ``P``: position of each request's sampled token; ``tail0``: first
    tail page; ``tail_tok``: first tail token (int32; the verification window's first token);
    ``ndraft``: drafts per request (its cap); ``last``: the sampled token; ``bt``: ``[R, W]``
    physical pages of each request."""

    rows: List[int]
    P: torch.Tensor
    tail0: torch.Tensor
    tail_tok: torch.Tensor
    ndraft: torch.Tensor
    ndraft_list: List[int]
    last: torch.Tensor
    bt: torch.Tensor


@dataclass
class _Tables:
    """Per-layer compacted block tables ``[L, R, max_k + max_tail]`` (selected pages, then the
    tail pages), pages selected per (layer, request) ``nsel`` ``[L, R]``, the budget ``k`` ``[R]``
    and whether every layer has the same table."""

    table: torch.Tensor
    nsel: torch.Tensor
    k: torch.Tensor
    same_for_all_layers: bool


class VegasProposer:
    """vLLM ``custom_class`` proposer drafting with the target model over selected pages (see module).

    Args:
        vllm_config: the engine's ``VllmConfig``; the Vegas options come from
            ``additional_config["vegas"]`` (validated again here, in the worker).

    The proposer owns the :class:`~vegas_ext.vllm.backend.VegasState` it shares with its model's
    attention layers (handed to them by :func:`~vegas_ext.vllm.backend.attach_state`).
    """

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        self.vllm_config = vllm_config
        self.num_speculative_tokens = int(spec.num_speculative_tokens)
        extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
        self.options = VegasOptions.from_mapping(extra.get(ADDITIONAL_CONFIG_KEY) or {})
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.model = None
        self.stats: Dict[str, int] = {
            "steps": 0,             # propose calls that drafted
            "draft_forwards": 0,    # model forwards run by the drafter
            "draft_tokens": 0,      # (request, draft step) pairs
            "pages_read": 0,        # pages attended, summed over (request, step, layer)
            "pages_dense": 0,       # pages a dense draft would have read, same sum
            "budget_pages": 0,      # selection budget (sinks included), same sum
            "tail_pages": 0,        # tail pages, same sum
            "max_over_budget": -(1 << 30),  # max over (request, step, layer) of read - (budget + tail)
            "sparse_layer_steps": 0,  # (request, step, layer) with fewer pages read than dense
            "unscored_steps": 0,    # propose calls after a target forward that recorded no page scores
        }
        self._stats_dir = os.environ.get("VEGAS_VLLM_STATS_DIR") or None
        self._needs_scores = self.options.sparse_attn_algorithm == "vegas"
        self._token = self.options.draft_granularity == "token"
        self.state = VegasState(collect=self._needs_scores, num_queries=self.num_speculative_tokens + 1,
                                score_block_size=1 if self._token else None)
        if self._token:
            self.stats.update(tokens_read=0, tokens_dense=0, budget_tokens=0, tail_tokens=0)
        self._attached = False
        #: γ per request (``gamma_policy="auto"``), else ``None``: every request drafts γ
        self.gamma_policy = make_gamma_policy(self.num_speculative_tokens, self.options.gamma_policy,
                                              per_request=True)
        # the previous step: request id -> drafts proposed, when it ended, and its draft/selection seconds
        self._prev_drafts: Dict[str, int] = {}
        self._prev_end = None
        self._prev_costs = (0.0, 0.0)
        self._draft_steps: List[tuple] = []  # this step's draft forwards: (requests drafted, seconds)
        self._prev_steps: List[tuple] = []

    def load_model(self, target_model) -> None:
        """Called by the runner with the target model: the drafter is the model itself."""
        self.model = target_model
        self._attached = attach_state(target_model, self.state) > 0
        made = draft_linears.copies()
        if self.options.draft_weights is not None and made["linears"] == 0:
            from vllm.logger import init_logger

            init_logger(__name__).warning(
                "vegas_ext.vllm: draft_weights=%r was asked for but no linear got a copy (only unquantized "
                "linears on the CPU platform do): drafts read the model's own weights", self.options.draft_weights)

    def propose(self, *args, **kwargs):  # pragma: no cover - reached only without the runner hook
        raise RuntimeError(
            "vegas_ext.vllm: VegasProposer drafts through the model-runner hook installed by the "
            "vegas_ext vLLM plugin; it was not installed in this worker (is the plugin filtered out "
            "by VLLM_PLUGINS?)")

    # ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose_with_runner(self, runner, scheduler_output, sampled_token_ids: List[List[int]], cm) -> List[List[int]]:
        """Draft for the runner's current batch; returns one list of draft token ids per request
        (lengths may differ, empty included): requests to draft -> page selection -> compacted
        tables -> draft forwards."""
        t_start = time.perf_counter()
        out: List[List[int]] = [[] for _ in range(len(sampled_token_ids))]
        scored = self.state.collect  # whether this step's target forward recorded page scores
        self.stats["unscored_steps"] += not scored
        scores, self.state.scores = self.state.scores, {}
        req_ids = [str(r) for r in list(runner.input_batch.req_ids)[: len(out)]]
        if self.gamma_policy is not None:
            self._observe(scheduler_output, sampled_token_ids, cm, req_ids, t_start, scored)
        t_select = t_draft = 0.0
        req = None
        self._draft_steps = []
        if out and cm is not None:
            group = self._group(runner)
            layer_names = list(group.layer_names)
            self._check_layers(runner, layer_names)
            bs = int(group.kv_cache_spec.block_size)
            req = self._requests(runner, group, cm, sampled_token_ids, bs, req_ids)
        if req is not None and self._token:
            t0 = time.perf_counter()
            sel = self._select_tokens(req, scores, layer_names, int(group.kv_cache_spec.num_kv_heads), bs)
            t1 = time.perf_counter()
            drafts = self._draft_tokens(runner, group.get_metadata_builder(0), layer_names, req, sel, bs)
        elif req is not None:
            t0 = time.perf_counter()
            tables = self._tables(req, self._select(req, scores, layer_names, bs), bs)
            t1 = time.perf_counter()
            drafts = self._draft(runner, group.get_metadata_builder(0), layer_names, req, tables, bs)
        if req is not None:
            t_select, t_draft = t1 - t0, time.perf_counter() - t1
            self.stats["steps"] += 1
            for r, i in enumerate(req.rows):
                out[i] = drafts[r, : req.ndraft_list[r]].tolist()
        if self.gamma_policy is not None:
            # no request drafted: the next target forward skips the page scores (a plain step)
            self.state.collect = self._needs_scores and req is not None
            self._prev_drafts = {rid: len(d) for rid, d in zip(req_ids, out)}
            self._prev_costs = (t_draft, t_select)
            self._prev_steps = self._draft_steps
        if self._stats_dir:
            self._dump_stats()
        if self.gamma_policy is not None:
            self._prev_end = time.perf_counter()
        return out

    def _observe(self, scheduler_output, sampled_token_ids, cm, req_ids, t_start: float, scored: bool) -> None:
        """Feed the γ policy: each request's acceptance of its last drafts, finished requests, and
        the last step's costs when this step was a pure verification of them (same requests, every
        query a verified token: no prefill chunk in the timed forward)."""
        pol, prev = self.gamma_policy, self._prev_drafts
        for rid in getattr(scheduler_output, "finished_req_ids", None) or ():
            pol.forget(str(rid))
        q_lens = None
        if cm is not None:
            qsl = cm.query_start_loc_cpu if cm.query_start_loc_cpu is not None else cm.query_start_loc.cpu()
            q_lens = np.diff(qsl[: len(req_ids) + 1].numpy())
        pure = self._prev_end is not None and set(req_ids) == set(prev) and q_lens is not None
        for i, rid in enumerate(req_ids):
            d, s = prev.get(rid, 0), len(sampled_token_ids[i])
            if q_lens is not None:  # drafts the scheduler did not schedule were not verified
                d = min(d, max(0, int(q_lens[i]) - 1))
            if s and d:
                pol.observe_request(rid, d, s - 1)
            if pure and (not s or int(q_lens[i]) != 1 + prev.get(rid, 0)):
                pure = False
        if pure:  # every request verified 1 + its drafts: the cost model's tokens and rows
            t_draft, t_select = self._prev_costs
            pol.observe_step(IterationCosts(max(prev.values(), default=0), t_draft, t_start - self._prev_end,
                                            t_select, scored=scored, tokens=int(q_lens[: len(req_ids)].sum()),
                                            rows=len(req_ids), draft_steps=list(self._prev_steps) or None),
                             len(req_ids))

    def _group(self, runner):
        groups = [g for gs in runner.attn_groups for g in gs]
        if len(groups) != 1:
            raise RuntimeError(f"vegas_ext.vllm: one attention group expected, got {len(groups)}")
        g = groups[0]
        if g.kernel_block_size is not None and g.kernel_block_size != g.kv_cache_spec.block_size:
            raise RuntimeError("vegas_ext.vllm: kernel block size differing from the cache block size is not supported")
        return g

    def _check_layers(self, runner, layer_names) -> None:
        if getattr(self, "_layers_checked", False):
            return
        if not self._attached:  # load_model was not given the model whose layers run
            attach_state(runner.model, self.state)
            self._attached = True
        if self._token and runner.device.type != "cpu":
            raise RuntimeError("vegas_ext.vllm: draft_granularity='token' runs on the CPU_ATTN backend only; "
                               "use draft_granularity='page'")
        ctx = runner.compilation_config.static_forward_context
        for name in layer_names if runner.device.type == "cpu" else ():
            isa = getattr(ctx[name], "isa", None)
            if (self.state.collect or self._token) and isa not in PLAIN_KEY_ISAS:
                raise RuntimeError(
                    f"vegas_ext.vllm: the CPU attention ISA {isa!r} of layer {name} stores keys in a layout "
                    f"paged_block_scores does not read (supported: {PLAIN_KEY_ISAS}); use float32 or "
                    "sparse_attn_algorithm='streamingllm'")
        self._layers_checked = True

    def _requests(self, runner, group, cm, sampled_token_ids, bs: int, req_ids: List[str]):
        """The requests that draft this step (sampled a token, have reserved slots and, with the
        ``auto`` policy, chose to draft), or ``None``."""
        gamma = self.num_speculative_tokens
        num_reqs = len(sampled_token_ids)
        ib = runner.input_batch
        bt_all = cm.block_table_tensor[:num_reqs]
        num_blocks = ib.block_table[group.kv_cache_group_id].num_blocks_per_row[:num_reqs]
        qsl = (cm.query_start_loc_cpu if cm.query_start_loc_cpu is not None else cm.query_start_loc.cpu())
        q_lens = np.diff(qsl[: num_reqs + 1].numpy())
        ver_lens = cm.seq_lens[:num_reqs].cpu().numpy()
        cand = []  # (batch index, position of the sampled token, most drafts)
        for i in range(num_reqs):
            if len(sampled_token_ids[i]) == 0:
                continue
            p = int(ib.num_tokens_no_spec[i]) - 1
            cap = min(gamma, self.max_model_len - p, int(num_blocks[i]) * bs - p)
            if cap > 0:
                cand.append((i, p, cap))
        if self.gamma_policy is not None and cand:
            gs = self._choose([(req_ids[i], c) for i, _, c in cand], num_reqs)
            cand = [(i, p, g) for (i, p, _), g in zip(cand, gs)]
        rows, P, tail_tok, ndraft, last = [], [], [], [], []
        for i, p, cap in cand:
            if cap <= 0:
                continue
            rows.append(i)
            P.append(p)
            tail_tok.append(int(ver_lens[i]) - min(int(q_lens[i]), gamma + 1))
            ndraft.append(cap)
            last.append(int(sampled_token_ids[i][-1]))
        if not rows:
            return None
        dev = bt_all.device
        rows_t = torch.tensor(rows, dtype=torch.long, device=dev)
        tail_t = torch.tensor(tail_tok, dtype=torch.int32, device=dev)
        return _Drafting(rows=rows, P=torch.tensor(P, dtype=torch.long, device=dev),
                         tail0=tail_t.long() // bs, tail_tok=tail_t,
                         ndraft=torch.tensor(ndraft, device=dev), ndraft_list=ndraft,
                         last=torch.tensor(last, dtype=torch.int32, device=dev), bt=bt_all[rows_t].long())

    def _choose(self, reqs, batch_size: int) -> List[int]:
        """The ``auto`` policy's drafts for ``[(request id, cap)]`` in a step of ``batch_size``
        requests. Under tensor parallelism every rank must run the same draft forwards, and each
        rank times its own steps: rank 0's choices are broadcast to the others."""
        gs = self.gamma_policy.choose_batch(reqs, batch_size)
        from vllm.distributed import get_tp_group

        tp = get_tp_group()
        if tp.world_size > 1:
            t = tp.broadcast(torch.tensor(gs, dtype=torch.int64), src=0)
            gs = [min(int(g), cap) for g, (_, cap) in zip(t.tolist(), reqs)]
        return gs

    def _select(self, req: _Drafting, scores, layer_names, bs: int):
        """Logical page ids ``[L, R, max_k]`` (ascending, -1 padded), the budget ``k`` ``[R]`` and
        whether the selection is shared by all layers. ``"vegas"`` without scores (no target
        forward recorded them, e.g. a warm-up) falls back to StreamingLLM pages."""
        opts = self.options
        L, R, dev = len(layer_names), len(req.rows), req.bt.device
        k = torch.tensor([opts.budget_pages(p + 1, bs) for p in req.P.tolist()], dtype=torch.int32, device=dev)
        nc = req.tail0.to(torch.int32)
        max_k = max(1, int(torch.minimum(k, nc).max()))
        if opts.sparse_attn_algorithm == "vegas" and all(n in scores for n in layer_names):
            rows_t = torch.tensor(req.rows, dtype=torch.long, device=scores[layer_names[0]].device)
            s = torch.stack([scores[n][rows_t].sum(1) for n in layer_names])  # [L, R, W]
            W = s.shape[-1]
            sel = ops.block_topk(s.reshape(L * R, 1, W).contiguous(), k.repeat(L), nc.repeat(L), max_k,
                                 opts.num_sink_pages).view(L, R, max_k)
            return sel, k, False
        sel = streaming_indices(k, nc, opts.num_sink_pages, max_k).view(1, R, max_k).expand(L, R, max_k)
        return sel, k, True

    def _select_tokens(self, req: _Drafting, scores, layer_names, num_kv_heads: int, bs: int):
        """Token-granular selection: logical token ids ``[L, R, H_kv, max_k]`` int32 (ascending, -1
        padded) and the budget ``k`` ``[R]`` in tokens. ``"vegas"``: per (layer, KV head) top-k of
        the per-token scores, sink tokens first; ``"streamingllm"`` (or no scores): sink tokens plus
        the most recent candidates, the same for every layer and head."""
        opts = self.options
        L, R, dev = len(layer_names), len(req.rows), req.bt.device
        k = torch.tensor([opts.budget_tokens(p + 1) for p in req.P.tolist()], dtype=torch.int32, device=dev)
        nc = req.tail_tok
        max_k = max(1, int(torch.minimum(k, nc).max()))
        sinks = opts.num_sink_pages * bs
        if opts.sparse_attn_algorithm == "vegas" and all(n in scores for n in layer_names):
            first = scores[layer_names[0]]
            every = len(req.rows) == first.shape[0] and req.rows == list(range(R))
            rows_t = None if every else torch.tensor(req.rows, dtype=torch.long, device=first.device)
            # one top-k per layer on its own scores: stacking [L, R, H_kv, W] per-token scores
            # (12 MB at 8K x 4 for SmolLM2) cost more than the top-k itself
            sel = torch.stack([ops.block_topk(scores[n] if every else scores[n].index_select(0, rows_t), k, nc,
                                              max_k, sinks) for n in layer_names])
            return sel, k
        sel = streaming_indices(k, nc, sinks, max_k).view(1, R, 1, max_k).expand(L, R, num_kv_heads, max_k)
        return sel, k

    def _draft_tokens(self, runner, builder, layer_names, req: _Drafting, selection, bs: int) -> torch.Tensor:
        """γ greedy token-granular draft forwards (see :meth:`_draft`): every layer attends through
        the real block table to its selected tokens plus the tail, by way of the state the
        attention backend reads (:func:`vegas_ext.vllm.backend.draft_token_attention`)."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        sel, k = selection
        R, L = len(req.rows), len(layer_names)
        st, stats = self.state, self.stats
        nsel = (sel >= 0).sum(-1).amax(-1)  # [L, R] tokens read per head before the tail
        bt32 = req.bt.to(torch.int32)
        cached = {"n": -1}
        st.draft_kv = self._gather_draft_kv(runner, layer_names, req, sel)

        def metadata(act, n, pos, slots):
            if n != cached["n"]:  # the active requests only ever shrink
                full = n == R
                st.draft_tokens = {name: (sel[li] if full else sel[li, act]).contiguous()
                                   for li, name in enumerate(layer_names)}
                st.draft_tail = req.tail_tok if full else req.tail_tok[act].contiguous()
                if st.draft_kv is not None:
                    st.draft_kv.rows = None if full else act
                cached.update(n=n, bt=bt32 if full else bt32[act].contiguous(),
                              qsl=torch.arange(n + 1, dtype=torch.int32, device=act.device))
            lens = (pos + 1).to(torch.int32)
            c = CommonAttentionMetadata(
                query_start_loc=cached["qsl"], query_start_loc_cpu=cached["qsl"].cpu(), seq_lens=lens, num_reqs=n,
                num_actual_tokens=n, max_query_len=1, max_seq_len=int(lens.max()), block_table_tensor=cached["bt"],
                slot_mapping=slots, causal=True, seq_lens_cpu_upper_bound=lens.cpu(), positions=pos)
            built = builder.build(0, c)
            tail_len = pos + 1 - req.tail_tok[act].long()
            read = nsel[:, act] + tail_len.view(1, n)  # [L, n]
            stats["draft_tokens"] += n
            stats["tokens_read"] += int(read.sum())
            stats["tokens_dense"] += int((pos + 1).sum()) * L
            stats["budget_tokens"] += int(k[act].sum()) * L
            stats["tail_tokens"] += int(tail_len.sum()) * L
            stats["max_over_budget"] = max(stats["max_over_budget"],
                                           int((read - (k[act].view(1, n) + tail_len.view(1, n))).max()))
            stats["sparse_layer_steps"] += int((read < (pos + 1).view(1, n)).sum())
            return {name: built for name in layer_names}

        try:
            return self._greedy_drafts(runner, layer_names, req, bs, metadata)
        finally:
            st.draft_tokens = st.draft_tail = st.draft_kv = None

    def _gather_draft_kv(self, runner, layer_names, req: _Drafting, sel) -> DraftKV:
        """The round's :class:`~vegas_ext.vllm.backend.DraftKV`: each layer's selected tokens and
        the tail so far, gathered once, with room for the γ drafts."""
        ctx = runner.compilation_config.static_forward_context
        width = sel.shape[-1] + int((req.P - req.tail_tok.long()).max()) + self.num_speculative_tokens
        keys, values, indices = {}, {}, {}
        pos = torch.arange(sel.shape[-1], dtype=torch.int32, device=sel.device)
        for li, name in enumerate(layer_names):
            kv = ctx[name].kv_cache
            kv = kv[0] if isinstance(kv, (list, tuple)) else kv
            keys[name], values[name] = gather_draft_kv(kv, req.bt, sel[li], req.tail_tok, req.P, width)
            indices[name] = torch.where(sel[li] >= 0, pos, -1)
        return DraftKV(keys=keys, values=values, indices=indices, tail_start=req.tail_tok.long())

    @staticmethod
    def _tables(req: _Drafting, selection, bs: int) -> _Tables:
        """Compacted tables: each layer's selected pages, then the tail pages up to the last page
        the drafts write."""
        sel, k, same = selection
        L, R, max_k = sel.shape
        dev, bt = req.bt.device, req.bt
        nsel = (sel >= 0).sum(-1)  # [L, R]
        last_page = (req.P + req.ndraft - 1) // bs  # [R]
        max_tail = int((last_page - req.tail0 + 1).max())
        tail_logical = req.tail0.view(R, 1) + torch.arange(max_tail, device=dev).view(1, max_tail)
        tail_phys = torch.gather(bt, 1, torch.minimum(tail_logical, last_page.view(R, 1)))  # [R, max_tail]
        sel_phys = torch.gather(bt.unsqueeze(0).expand(L, R, bt.shape[1]), 2, sel.clamp(min=0).long())
        table = torch.zeros(L, R, max_k + max_tail, dtype=torch.long, device=dev)
        table[..., :max_k] = sel_phys
        pos_tail = nsel.view(L, R, 1) + torch.arange(max_tail, device=dev).view(1, 1, max_tail)
        table.scatter_(2, pos_tail, tail_phys.unsqueeze(0).expand(L, R, max_tail))
        return _Tables(table=table.to(torch.int32), nsel=nsel, k=k, same_for_all_layers=same)

    def _metadata(self, builder, layer_names, tables: _Tables, act, tail_len, slots, pos, bs: int):
        """Attention metadata per layer for one draft step of the active requests ``act``."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        n = int(act.numel())
        qsl_d = torch.arange(n + 1, dtype=torch.int32, device=act.device)
        md, built = {}, None
        for li, name in enumerate(layer_names):
            if built is None or not tables.same_for_all_layers:
                lens = (tables.nsel[li, act] * bs + tail_len).to(torch.int32)
                c = CommonAttentionMetadata(
                    query_start_loc=qsl_d, query_start_loc_cpu=qsl_d.cpu(), seq_lens=lens, num_reqs=n,
                    num_actual_tokens=n, max_query_len=1, max_seq_len=int(lens.max()),
                    block_table_tensor=tables.table[li, act].contiguous(), slot_mapping=slots, causal=True,
                    seq_lens_cpu_upper_bound=lens.cpu(), positions=pos)
                built = builder.build(0, c)
            md[name] = built
        return md

    def _count(self, tables: _Tables, act, dense_len, tail_len, bs: int) -> None:
        """Debug counters of one draft step: pages read per (request, layer) against budget + tail."""
        st, n, L = self.stats, int(act.numel()), tables.nsel.shape[0]
        read = tables.nsel[:, act] + (tail_len.view(1, n) + bs - 1) // bs  # [L, n]
        dense_pages = (dense_len + bs - 1) // bs
        tail_pages = (tail_len + bs - 1) // bs
        k = tables.k[act]
        st["draft_tokens"] += n
        st["pages_read"] += int(read.sum())
        st["pages_dense"] += int(dense_pages.sum()) * L
        st["budget_pages"] += int(k.sum()) * L
        st["tail_pages"] += int(tail_pages.sum()) * L
        st["max_over_budget"] = max(st["max_over_budget"], int((read - (k.view(1, n) + tail_pages.view(1, n))).max()))
        st["sparse_layer_steps"] += int((read < dense_pages.view(1, n)).sum())

    def _draft(self, runner, builder, layer_names, req: _Drafting, tables: _Tables, bs: int) -> torch.Tensor:
        """γ greedy draft forwards, one token per active request each; returns ``[R, γ]`` int64
        (CPU; entries past a request's ``ndraft`` are unused). Each token's K/V go to its real slot."""

        def metadata(act, n, pos, slots):
            dense_len = pos + 1
            tail_len = dense_len - req.tail0[act] * bs
            md = self._metadata(builder, layer_names, tables, act, tail_len, slots, pos, bs)
            self._count(tables, act, dense_len, tail_len, bs)
            return md

        return self._greedy_drafts(runner, layer_names, req, bs, metadata)

    def _greedy_drafts(self, runner, layer_names, req: _Drafting, bs: int, metadata) -> torch.Tensor:
        """The draft loop both granularities share: step ``j`` runs one forward for the requests
        with more than ``j`` drafts, at position ``P + j`` (K/V to its real slot), with the attention
        metadata ``metadata(act, n, pos, slots)`` returns per layer, and takes the argmax. Returns
        ``[R, γ]`` int64 on CPU (entries past a request's ``ndraft`` are unused)."""
        from vllm.forward_context import set_forward_context

        gamma, R = self.num_speculative_tokens, len(req.rows)
        tokens = req.last
        drafts = torch.zeros(R, gamma, dtype=torch.long)
        self.state.drafting = True
        try:
            with draft_linears.drafting():  # the linears read their low-precision copies, if any
                for j in range(gamma):
                    t0 = time.perf_counter()
                    act = (req.ndraft > j).nonzero().flatten()
                    n = int(act.numel())
                    if n == 0:
                        break
                    pos = req.P[act] + j
                    slots = req.bt[act].gather(1, (pos // bs).view(n, 1)).view(n) * bs + pos % bs
                    md = metadata(act, n, pos, slots)
                    with set_forward_context(md, self.vllm_config, num_tokens=n,
                                             slot_mapping={name: slots for name in layer_names}):
                        hidden = runner.model(input_ids=tokens[act], positions=pos, intermediate_tensors=None,
                                              inputs_embeds=None)
                    nxt = runner.model.compute_logits(hidden).argmax(dim=-1)
                    self.stats["draft_forwards"] += 1
                    drafts[act.cpu(), j] = nxt.cpu().long()
                    tokens = tokens.clone()
                    tokens[act] = nxt.to(torch.int32)
                    self._draft_steps.append((n, time.perf_counter() - t0))  # the γ policy's draft line
        finally:
            self.state.drafting = False
        return drafts

    def _dump_stats(self) -> None:
        try:
            from vllm.distributed import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
        except Exception:  # pragma: no cover
            rank = 0
        os.makedirs(self._stats_dir, exist_ok=True)
        made = draft_linears.copies()
        self.stats.update(draft_weight_linears=made["linears"], draft_weight_bytes=made["bytes"],
                          draft_weight_calls=made["calls"])
        self.stats["one_pass_layer_calls"] = self.state.one_pass_calls
        self.stats["two_pass_layer_calls"] = self.state.two_pass_calls
        if self.gamma_policy is not None:
            self.stats["gamma_histogram"] = list(self.gamma_policy.choices)
            self.stats["vetoed_steps"] = self.gamma_policy.vetoed
            self.stats.update(self.gamma_policy.cost_stats())
        path = os.path.join(self._stats_dir, f"stats-rank{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.stats, f)
        os.replace(path + ".tmp", path)
