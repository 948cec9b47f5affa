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

A request drafts fewer tokens when its reserved slots or ``max_model_len`` end earlier, and none
when it sampled nothing this step (a partial prefill chunk). Verification rewrites the drafts' K/V
with exact values, and vLLM's rejection sampler accepts; the proposer returns token ids only.

Debug counters (:attr:`VegasProposer.stats`) count draft forwards, pages read and the budget;
``VEGAS_VLLM_STATS_DIR`` makes each rank write them to ``<dir>/stats-rank<r>.json`` after every
step.
"""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

import numpy as np
import torch

from .. import ops
from ..selection import streaming_indices
from .backend import PLAIN_KEY_ISAS, STATE
from .options import ADDITIONAL_CONFIG_KEY, VegasOptions

__all__ = ["VegasProposer"]


class VegasProposer:
    """vLLM ``custom_class`` proposer drafting with the target model over selected pages (see module).

    Args:
        vllm_config: the engine's ``VllmConfig``; the Vegas options come from
            ``additional_config["vegas"]`` (validated again here, in the worker).
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
        }
        self._stats_dir = os.environ.get("VEGAS_VLLM_STATS_DIR") or None
        STATE.active = True
        STATE.collect = self.options.sparse_attn_algorithm == "vegas"
        STATE.num_queries = self.num_speculative_tokens + 1
        STATE.scores.clear()

    def load_model(self, target_model) -> None:
        """Called by the runner with the target model: the drafter is the model itself."""
        self.model = target_model

    def propose(self, *args, **kwargs):  # pragma: no cover - reached only without the runner hook
        raise RuntimeError(
            "vegas_ext.vllm: VegasProposer drafts through the model-runner hook installed by the "
            "vegas_ext vLLM plugin; it was not installed in this worker (is the plugin filtered out "
            "by VLLM_PLUGINS?)")

    # ------------------------------------------------------------------------------------------
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
        ctx = runner.compilation_config.static_forward_context
        for name in layer_names if runner.device.type == "cpu" else ():
            isa = getattr(ctx[name], "isa", None)
            if STATE.collect and isa not in PLAIN_KEY_ISAS:
                raise RuntimeError(
                    f"vegas_ext.vllm: the CPU attention ISA {isa!r} of layer {name} stores keys in a layout "
                    f"paged_block_scores does not read (supported: {PLAIN_KEY_ISAS}); use float32 or "
                    "sparse_attn_algorithm='streamingllm'")
        self._layers_checked = True

    @torch.inference_mode()
    def propose_with_runner(self, runner, scheduler_output, sampled_token_ids: List[List[int]], cm) -> List[List[int]]:
        """Draft for the runner's current batch; returns one list of draft token ids per request."""
        from vllm.forward_context import set_forward_context
        from vllm.v1.attention.backend import CommonAttentionMetadata

        gamma = self.num_speculative_tokens
        num_reqs = len(sampled_token_ids)
        out: List[List[int]] = [[] for _ in range(num_reqs)]
        scores = STATE.scores
        STATE.scores = {}
        if num_reqs == 0 or cm is None:
            return out
        group = self._group(runner)
        layer_names = list(group.layer_names)
        self._check_layers(runner, layer_names)
        builder = group.get_metadata_builder(0)
        bs = int(group.kv_cache_spec.block_size)
        ib = runner.input_batch
        bt_all = cm.block_table_tensor[:num_reqs]
        num_blocks = ib.block_table[group.kv_cache_group_id].num_blocks_per_row[:num_reqs]
        qsl = cm.query_start_loc_cpu[: num_reqs + 1].numpy() if cm.query_start_loc_cpu is not None else cm.query_start_loc[: num_reqs + 1].cpu().numpy()
        ver_lens = cm.seq_lens[:num_reqs].cpu().numpy()
        q_lens = np.diff(qsl)

        rows, P, tail0, ndraft, last = [], [], [], [], []
        for i in range(num_reqs):
            if len(sampled_token_ids[i]) == 0:
                continue
            p = int(ib.num_tokens_no_spec[i]) - 1
            cap = min(gamma, self.max_model_len - p, int(num_blocks[i]) * bs - p)
            if cap <= 0:
                continue
            ts = int(ver_lens[i]) - min(int(q_lens[i]), gamma + 1)
            rows.append(i)
            P.append(p)
            tail0.append(ts // bs)
            ndraft.append(cap)
            last.append(int(sampled_token_ids[i][-1]))
        if not rows:
            return out
        R = len(rows)
        L = len(layer_names)
        dev = bt_all.device
        rows_t = torch.tensor(rows, dtype=torch.long, device=dev)
        P_t = torch.tensor(P, dtype=torch.long, device=dev)
        tail0_t = torch.tensor(tail0, dtype=torch.long, device=dev)
        bt = bt_all[rows_t].long()  # [R, W] physical pages

        # --- selection: logical page ids [L, R, max_k] ascending, -1 padded
        opts = self.options
        k = torch.tensor([opts.budget_pages(p + 1, bs) for p in P], dtype=torch.int32, device=dev)
        nc = tail0_t.to(torch.int32)
        max_k = max(1, int(torch.minimum(k, nc).max()))
        # vegas without scores (no target forward recorded them, e.g. a warm-up) falls back to streaming
        have_scores = opts.sparse_attn_algorithm == "vegas" and all(n in scores for n in layer_names)
        if have_scores:
            s = torch.stack([scores[n][rows_t].sum(1) for n in layer_names])  # [L, R, W]
            W = s.shape[-1]
            sel = ops.block_topk(s.reshape(L * R, 1, W).contiguous(), k.repeat(L), nc.repeat(L), max_k,
                                 opts.num_sink_pages).view(L, R, max_k)
        else:
            sel = streaming_indices(k, nc, opts.num_sink_pages, max_k).view(1, R, max_k).expand(L, R, max_k)
        nsel = (sel >= 0).sum(-1)  # [L, R]
        # --- compacted tables [L, R, max_k + max_tail]: selected pages, then the tail pages
        last_page = (P_t + torch.tensor(ndraft, device=dev) - 1) // bs  # [R]
        n_tail = last_page - tail0_t + 1
        max_tail = int(n_tail.max())
        tail_logical = tail0_t.view(R, 1) + torch.arange(max_tail, device=dev).view(1, max_tail)
        tail_logical = torch.minimum(tail_logical, last_page.view(R, 1))
        tail_phys = torch.gather(bt, 1, tail_logical)  # [R, max_tail]
        sel_phys = torch.gather(bt.unsqueeze(0).expand(L, R, bt.shape[1]), 2, sel.clamp(min=0).long())
        table = torch.zeros(L, R, max_k + max_tail, dtype=torch.long, device=dev)
        table[..., :max_k] = sel_phys
        pos_tail = nsel.view(L, R, 1) + torch.arange(max_tail, device=dev).view(1, 1, max_tail)
        table.scatter_(2, pos_tail, tail_phys.unsqueeze(0).expand(L, R, max_tail))
        table = table.to(torch.int32)
        same_for_all_layers = not have_scores

        # --- γ draft forwards
        ndraft_t = torch.tensor(ndraft, device=dev)
        tokens = torch.tensor(last, dtype=torch.int32, device=dev)
        drafts = torch.zeros(R, gamma, dtype=torch.long)
        st = self.stats
        STATE.drafting = True
        try:
            for j in range(gamma):
                act = (ndraft_t > j).nonzero().flatten()
                n = int(act.numel())
                if n == 0:
                    break
                pos = P_t[act] + j
                slots = bt[act].gather(1, (pos // bs).view(n, 1)).view(n) * bs + pos % bs
                dense_len = pos + 1
                tail_len = dense_len - tail0_t[act] * bs
                qsl_d = torch.arange(n + 1, dtype=torch.int32, device=dev)
                md = {}
                built = None
                for li, name in enumerate(layer_names):
                    if built is not None and same_for_all_layers:
                        md[name] = built
                        continue
                    lens = (nsel[li, act] * bs + tail_len).to(torch.int32)
                    c = CommonAttentionMetadata(
                        query_start_loc=qsl_d, query_start_loc_cpu=qsl_d.cpu(), seq_lens=lens, num_reqs=n,
                        num_actual_tokens=n, max_query_len=1, max_seq_len=int(lens.max()),
                        block_table_tensor=table[li, act].contiguous(), slot_mapping=slots, causal=True,
                        seq_lens_cpu_upper_bound=lens.cpu(), positions=pos)
                    built = builder.build(0, c)
                    md[name] = built
                # counters: pages read per (request, layer) vs budget + tail
                read = nsel[:, act] + (tail_len.view(1, n) + bs - 1) // bs  # [L, n]
                dense_pages = (dense_len + bs - 1) // bs
                tail_pages = (tail_len + bs - 1) // bs
                st["draft_tokens"] += n
                st["pages_read"] += int(read.sum())
                st["pages_dense"] += int(dense_pages.sum()) * L
                st["budget_pages"] += int(k[act].sum()) * L
                st["tail_pages"] += int(tail_pages.sum()) * L
                st["max_over_budget"] = max(st["max_over_budget"], int((read - (k[act].view(1, n) + tail_pages.view(1, n))).max()))
                st["sparse_layer_steps"] += int((read < dense_pages.view(1, n)).sum())
                with set_forward_context(md, self.vllm_config, num_tokens=n,
                                         slot_mapping={name: slots for name in layer_names}):
                    hidden = runner.model(input_ids=tokens[act], positions=pos, intermediate_tensors=None,
                                          inputs_embeds=None)
                logits = runner.model.compute_logits(hidden)
                nxt = logits.argmax(dim=-1)
                st["draft_forwards"] += 1
                drafts[act.cpu(), j] = nxt.cpu().long()
                tokens = tokens.clone()
                tokens[act] = nxt.to(torch.int32)
        finally:
            STATE.drafting = False
        st["steps"] += 1
        for r, i in enumerate(rows):
            out[i] = drafts[r, : ndraft[r]].tolist()
        if self._stats_dir:
            self._dump_stats()
        return out

    def _dump_stats(self) -> None:
        try:
            from vllm.distributed import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
        except Exception:  # pragma: no cover
            rank = 0
        os.makedirs(self._stats_dir, exist_ok=True)
        path = os.path.join(self._stats_dir, f"stats-rank{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.stats, f)
        os.replace(path + ".tmp", path)
