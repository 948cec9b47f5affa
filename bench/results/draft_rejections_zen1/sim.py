"""Greedy self-speculative decoding in Hugging Face fp32, one prompt at a time, with oracle draft
variants; prints one JSON line per (prompt, variant): MAL, rounds, tokens read per (layer, KV head)
per draft step, the selection's coverage of the verification's attention mass, and the target's
top-2 logit margin at every rejected draft position.

    python sim.py CONTEXT BATCH VARIANT[,VARIANT...] [ROWS]

Prompts: bench.e2e.build_batch(tok, "kjv", CONTEXT, BATCH, chat=True), rows ROWS. γ 6, 128 new
tokens, budget max(256, 5 %) with a 32-token sink, selection per (layer, KV head) from the sum of
the γ + 1 verification queries' attention probabilities (the plugin's token drafts). Variants:
vegas, streaming, dense; vegas+layers@A-B (layers A..B-1 draft densely); vegas+dense@T (KV heads
whose selection covers less than T of the verification's mass draft densely); vegas+fb@M (a draft
step whose own top-2 logit margin is below M is run again with dense attention).
"""
import copy, json, math, os, sys, time
import torch, torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path[:0] = [ROOT, os.path.join(ROOT, "python")]
from vegas_ext.models import load_model
from bench.e2e import build_batch

torch.set_num_threads(2)
ST = dict(mode="prefill", variant="vegas", layers={}, k=256, sink=32, thr=1.0, stats=[])

def attn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    B, Hq, q, D = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    G = Hq // Hkv
    L = module.layer_idx
    mode = ST["mode"]
    if mode == "prefill":
        k2 = key.repeat_interleave(G, 1); v2 = value.repeat_interleave(G, 1)
        o = F.scaled_dot_product_attention(query, k2, v2, is_causal=True, scale=scaling)
        return o.transpose(1, 2).contiguous(), None
    qq = query[0].view(Hkv, G, q, D)
    s = torch.einsum("hgqd,hsd->hgqs", qq, key[0]) * scaling
    pos = torch.arange(S); qpos = torch.arange(S - q, S)
    causal = pos[None, :] <= qpos[:, None]
    if mode == "verify":
        s = s.masked_fill(~causal, -math.inf)
        p = torch.softmax(s, -1)
        o = torch.einsum("hgqs,hsd->hgqd", p, value[0])
        ST["layers"][L] = dict(p=p)
        return o.reshape(Hq, q, D).transpose(0, 1)[None].contiguous(), None
    if ST["variant"] == "dense" or ST.get("force_dense"):
        m = causal[None].expand(Hkv, q, S)
    else:
        m = F.pad(ST["sel"][L], (0, S - ST["sel"][L].shape[1]), value=True)
        m = m[:, None, :] & causal[None]
    s = s.masked_fill(~m[:, None], -math.inf)
    o = torch.einsum("hgqs,hsd->hgqd", torch.softmax(s, -1), value[0])
    return o.reshape(Hq, q, D).transpose(0, 1)[None].contiguous(), None

AttentionInterface.register("exp", attn)

def select(n):
    var = ST["variant"]; k = ST["k"]; sink = ST["sink"]; n0 = ST["n0"]
    sel, reads, cov_all = {}, 0, []
    for L, d in ST["layers"].items():
        p = d["p"]  # [Hkv, G, q, S0]
        Hkv = p.shape[0]
        m = torch.zeros(Hkv, n, dtype=torch.bool)
        m[:, n0:n] = True
        m[:, :min(sink, n0)] = True
        if var.startswith("streaming"):
            m[:, max(sink, n0 - (k - sink)):n0] = True
        elif var.startswith("vegas"):
            sc = p.sum((1, 2))[:, sink:n0]
            top = sc.topk(min(k - sink, sc.shape[1]), -1).indices + sink
            m.scatter_(1, top, True)
            S0 = p.shape[-1]
            mm = F.pad(m, (0, max(0, S0 - n)))[:, :S0]
            cov = (p * mm[:, None, None]).sum(-1).mean((1, 2))  # [Hkv]
            cov_all.append(cov)
            if var.startswith("vegas+dense"):
                m[cov < ST["thr"]] = True
            if var.startswith("vegas+layers") and ST["lo"] <= L < ST["hi"]:
                m[:] = True
        sel[L] = m
        reads += int(m[:, :n0].sum())
    ST["sel"] = sel
    ST["reads"].append(reads / (len(ST["layers"]) * Hkv))
    if cov_all:
        ST["stats"].append(torch.stack(cov_all))

def crop(cache, length):
    r = cache.get_seq_length() - length
    if r > 0:
        cache.crop(-r)

@torch.no_grad()
def run(model, ids, variant, pre, gamma=6, new_tokens=128):
    ST["variant"] = variant; ST["reads"] = []; ST["margins"] = []; ST["rej"] = []; ST["fb"] = 0; ST["steps"] = 0
    n = len(ids)
    cache = copy.deepcopy(pre)
    ST["mode"] = "verify"; ST["n0"] = n - gamma - 1
    out = model(torch.tensor([ids[n - gamma - 1:]]), past_key_values=cache, use_cache=True)
    last = int(out.logits[0, -1].argmax())
    ST["k"] = max(256, math.ceil(0.05 * n))
    select(n)
    emitted, acc, cur = [last], [], n
    while len(emitted) < new_tokens:
        ST["mode"] = "draft"
        drafts, t = [], last
        for _ in range(gamma):
            o = model(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
            if "+fb@" in variant:
                t2 = o.logits[0, -1].topk(2).values
                ST["steps"] += 1
                if float(t2[0] - t2[1]) < float(variant.split("+fb@")[1]):
                    ST["fb"] += 1
                    crop(cache, cache.get_seq_length() - 1)
                    ST["force_dense"] = True
                    o = model(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
                    ST["force_dense"] = False
            t = int(o.logits[0, -1].argmax()); drafts.append(t)
        crop(cache, cur)
        ST["mode"] = "verify"; ST["n0"] = cur
        o = model(torch.tensor([[last] + drafts]), past_key_values=cache, use_cache=True)
        tg = o.logits[0].argmax(-1).tolist()
        top2 = o.logits[0].topk(2, -1).values
        marg = (top2[:, 0] - top2[:, 1]).tolist()
        a = 0
        while a < gamma and drafts[a] == tg[a]:
            a += 1
        ST["margins"] += marg[:a + 1]
        if a < gamma:
            ST["rej"].append(round(marg[a], 3))
        emitted += drafts[:a] + [tg[a]]
        acc.append(a + 1)
        crop(cache, cur + a + 1)
        ST["k"] = max(256, math.ceil(0.05 * (cur + a + 1)))
        ST["n0"] = cur
        select(cur + a + 1)
        cur += a + 1
        last = tg[a]
    return emitted[:new_tokens], acc

if __name__ == "__main__":
    ctx, B = int(sys.argv[1]), int(sys.argv[2]); variants = sys.argv[3].split(",")
    rows = [int(r) for r in sys.argv[4].split(",")] if len(sys.argv) > 4 else range(B)
    model, tok = load_model(None, "float32")
    model.config._attn_implementation = "exp"
    batch = build_batch(tok, "kjv", ctx, B, chat=True)[0].tolist()
    for i in rows:
        ids = batch[i]; n = len(ids)
        pre = DynamicCache(); ST["mode"] = "prefill"; t0 = time.time()
        with torch.no_grad():
            model(torch.tensor([ids[:n - 7]]), past_key_values=pre, use_cache=True)
        print("prefill", round(time.time() - t0, 1), flush=True)
        ref = None
        for var in variants:
            if var.startswith("vegas+dense"):
                ST["thr"] = float(var.split("@")[1])
            if var.startswith("vegas+layers"):
                ST["lo"], ST["hi"] = map(int, var.split("@")[1].split("-"))
            ST["stats"] = []
            t0 = time.time()
            toks, acc = run(model, ids, var, pre)
            ref = ref or toks
            extra = {}
            if ST["stats"]:
                c = torch.stack(ST["stats"]).mean(0)  # [L, Hkv]
                extra = dict(cov_mean=round(float(c.mean()), 3), cov_min=round(float(c.min()), 3))
            mg = torch.tensor(ST["margins"])
            extra.update(rej=ST["rej"], marg_med=round(float(mg.median()), 2), marg_q10=round(float(mg.quantile(0.1)), 3))
            if ST["steps"]:
                extra["fb_frac"] = round(ST["fb"] / ST["steps"], 3)
            print(json.dumps(dict(row=i, variant=var, mal=round(sum(acc) / len(acc), 3), rounds=len(acc),
                                  same=toks == ref, reads=round(sum(ST["reads"]) / len(ST["reads"]), 1),
                                  s=round(time.time() - t0, 1), **extra)), flush=True)
