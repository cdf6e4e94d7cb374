#!/usr/bin/env python3
"""Train the embedded mini MoE (models/reap-mini-moe) deterministically on the CPU.

Steps (all seeded; same corpus + same torch build + same thread count -> same weights):
  1. train a byte-level BPE tokenizer (vocab --vocab) with `tokenizers` on the training split;
  2. pack the training records into one token stream (documents separated by <|endoftext|>;
     --chat-frac of them wrapped as a ChatML user/assistant turn so the chat template is
     not foreign to the model);
  3. train transformers' Qwen3MoeForCausalLM from scratch (AdamW, warm-up + cosine),
     CE + --aux-coef * per-layer load-balancing loss (balance_loss); log every --log-every steps and the
     per-domain held-out loss every --eval-every steps;
  4. save bf16 safetensors + tokenizer (with chat template) + generation config, the loss log
     (training_log.csv, training_summary.json) beside them, and the loss plot.

The corpus comes from scripts/build_corpus.py (train split in .cache/corpus/train.jsonl,
held-out split in data/corpus/heldout.jsonl).

usage: python scripts/train_moe.py [--steps 1000] [--out models/reap-mini-moe]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import sys
import time

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def load_jsonl(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def train_tokenizer(texts, vocab, out_dir):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tr = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIALS,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, tr, length=len(texts))
    assert tok.get_vocab_size() == vocab, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=SPECIALS[1:],
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    # make sure the chat template sits in tokenizer_config.json (transformers 5 may write
    # it to a separate chat_template.jinja)
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    cfg = json.load(open(cfg_path))
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["eos_token"] = "<|endoftext|>"
    cfg["pad_token"] = "<|endoftext|>"
    # spelled so that transformers 4.x and 5.x both read it
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("extra_special_tokens", None)
    cfg["additional_special_tokens"] = SPECIALS[1:]
    json.dump(cfg, open(cfg_path, "w"), indent=2)
    jinja = os.path.join(out_dir, "chat_template.jinja")
    if os.path.exists(jinja):
        os.remove(jinja)
    return fast


def build_stream(recs, tok, chat_frac, rng):
    """Token stream of all records, each followed by <|endoftext|>."""
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    ids = []
    n_chat = 0
    for r in recs:
        text = r["text"]
        if rng.random() < chat_frac:
            lines = text.split("\n")
            cut = max(1, len(lines) // 3)
            text = (
                "<|im_start|>user\n" + "\n".join(lines[:cut]) + "<|im_end|>\n"
                "<|im_start|>assistant\n" + "\n".join(lines[cut:]) + "<|im_end|>\n"
            )
            n_chat += 1
        ids += tok.encode(text, add_special_tokens=False) + [eot]
    return torch.tensor(ids, dtype=torch.long), n_chat


def make_config(a, tok):
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=len(tok),
        hidden_size=a.hidden,
        intermediate_size=4 * a.hidden,
        moe_intermediate_size=a.moe_inter,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim,
        num_experts=a.experts,
        num_experts_per_tok=a.topk,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        router_aux_loss_coef=a.aux_coef,
        output_router_logits=False,
        initializer_range=0.02,
        attention_dropout=0.0,
        use_cache=True,
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
    )
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    return cfg


def balance_loss(router_logits, num_experts, top_k):
    """Switch-style load-balancing loss, per layer, averaged over layers.

    For each layer: N * sum_i f_i * P_i, with f_i the fraction of top-k selections that go to
    expert i and P_i its mean router probability over the batch; 1.0 when perfectly balanced.
    Balance is asked of the whole (mixed-domain) batch, so experts may still specialise by
    domain. (transformers' load_balancing_loss_func pools all layers before the product,
    which lets one layer collapse while another compensates.)
    """
    losses = []
    for lg in router_logits:
        probs = torch.softmax(lg.float(), dim=-1)
        sel = torch.topk(probs, top_k, dim=-1).indices
        f = torch.bincount(sel.reshape(-1), minlength=num_experts).float() / sel.numel()
        losses.append(num_experts * torch.sum(f * probs.mean(0)))
    return torch.stack(losses).mean()


def split_loss(model, ids, coef, kind="layer"):
    out = model(input_ids=ids, output_router_logits=True, use_cache=False)
    logits = out.logits[:, :-1].float()
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    if kind == "pooled":  # transformers' own formulation (all layers pooled)
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

        aux = load_balancing_loss_func(
            out.router_logits, model.config.num_experts, model.config.num_experts_per_tok
        )
    else:
        aux = balance_loss(out.router_logits, model.config.num_experts, model.config.num_experts_per_tok)
    return ce, aux, ce + coef * aux


@torch.no_grad()
def eval_domains(model, eval_sets):
    model.eval()
    res = {}
    for dom, seqs in eval_sets.items():
        tot, n = 0.0, 0
        for s in seqs:
            out = model(input_ids=s[None], use_cache=False)
            lg = out.logits[0, :-1].float()
            tot += torch.nn.functional.cross_entropy(lg, s[1:], reduction="sum").item()
            n += len(s) - 1
        res[dom] = tot / n
    res["all"] = sum(res[d] for d in eval_sets) / len(eval_sets)
    model.train()
    return res


def plot(log_rows, eval_rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    steps = [r["step"] for r in log_rows]
    ax.plot(steps, [r["ce"] for r in log_rows], lw=0.8, alpha=0.6, label="train CE (batch)")
    # running mean for readability
    w = 10
    ce = [r["ce"] for r in log_rows]
    sm = [sum(ce[max(0, i - w + 1) : i + 1]) / len(ce[max(0, i - w + 1) : i + 1]) for i in range(len(ce))]
    ax.plot(steps, sm, lw=1.6, label=f"train CE (mean of {w} logs)")
    doms = [k for k in eval_rows[0] if k not in ("step", "all")] if eval_rows else []
    for d in doms:
        ax.plot(
            [r["step"] for r in eval_rows],
            [r[d] for r in eval_rows],
            "o-",
            ms=3,
            lw=1,
            label=f"held-out CE: {d}",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", default=".cache/corpus/train.jsonl")
    ap.add_argument("--heldout", default="data/corpus/heldout.jsonl")
    ap.add_argument("--out", default="models/reap-mini-moe")
    ap.add_argument("--plot", default="research-notes/mini-moe-loss.png")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="1 by default: on a shared, oversubscribed CPU two OpenMP threads "
        "spend most of a step waiting for each other",
    )
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--moe-inter", type=int, default=96)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument(
        "--aux-kind",
        default="layer",
        choices=["layer", "pooled"],
        help="layer: balance_loss below; pooled: transformers' load_balancing_loss_func",
    )
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--chat-frac", type=float, default=0.2)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--eval-per-domain", type=int, default=24)
    ap.add_argument("--experts-impl", default="eager", help="transformers experts implementation")
    ap.add_argument("--bench", type=int, default=0, help="only time this many steps, save nothing")
    ap.add_argument("--device", default="cpu", help="cpu (the shipped recipe) or cuda")
    ap.add_argument(
        "--routing-every",
        type=int,
        default=0,
        help="every N steps log per-domain routing structure (scripts/routing_stats.py "
        "on --routing-per-domain held-out records) to routing_log.csv",
    )
    ap.add_argument("--routing-per-domain", type=int, default=12)
    a = ap.parse_args(argv)

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    random.seed(a.seed)
    t_start = time.time()
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3MoeForCausalLM

    train = load_jsonl(a.train)
    held = load_jsonl(a.heldout)
    os.makedirs(a.out, exist_ok=True)
    tok = train_tokenizer([r["text"] for r in train], a.vocab, a.out)
    tok = PreTrainedTokenizerFast.from_pretrained(a.out)
    t_tok = time.time() - t_start
    rng = random.Random(a.seed)
    stream, n_chat = build_stream(train, tok, a.chat_frac, rng)
    n_blocks = (len(stream) - 1) // a.seq_len
    print(
        f"tokenizer {t_tok:.1f}s; train records {len(train)} ({n_chat} chat-wrapped), "
        f"{len(stream)} tokens, {n_blocks} blocks of {a.seq_len}; "
        f"chars/token {sum(len(r['text']) for r in train) / len(stream):.2f}",
        flush=True,
    )

    doms = sorted({r["source"] for r in held})
    eval_sets = {}
    for d in doms:
        rs = [r for r in held if r["source"] == d][: a.eval_per_domain]
        eval_sets[d] = [
            torch.tensor(tok.encode(r["text"], add_special_tokens=False)[: a.seq_len], device=a.device)
            for r in rs
        ]

    cfg = make_config(a, tok)
    cfg._experts_implementation = a.experts_impl
    torch.manual_seed(a.seed)
    model = Qwen3MoeForCausalLM(cfg).to(a.device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params} ({n_params * 2 / 1e6:.2f} MB in bf16)", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    def lr_at(step):
        if step < a.warmup:
            return a.lr * (step + 1) / a.warmup
        t = (step - a.warmup) / max(1, a.steps - a.warmup)
        return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))

    # block order: a seeded permutation per epoch
    g = torch.Generator().manual_seed(a.seed)
    order, pos, epoch = torch.randperm(n_blocks, generator=g), 0, 0
    log_rows, eval_rows, routing_rows = [], [], []
    rs = None
    if a.routing_every:
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "routing_stats", os.path.join(os.path.dirname(os.path.abspath(__file__)), "routing_stats.py")
        )
        rs = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(rs)
        routing_recs = rs.load_jsonl(a.heldout, a.routing_per_domain)
    steps = a.bench or a.steps
    t0 = time.time()
    for step in range(steps):
        if pos + a.batch > n_blocks:
            order, pos, epoch = torch.randperm(n_blocks, generator=g), 0, epoch + 1
        idx = order[pos : pos + a.batch]
        pos += a.batch
        batch = torch.stack([stream[i * a.seq_len : i * a.seq_len + a.seq_len] for i in idx.tolist()]).to(
            a.device
        )
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step)
        ce, aux, loss = split_loss(model, batch, a.aux_coef, a.aux_kind)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        if step % a.log_every == 0 or step == steps - 1:
            row = {
                "step": step,
                "tokens": (step + 1) * a.batch * a.seq_len,
                "epoch": epoch,
                "lr": lr_at(step),
                "ce": ce.item(),
                "aux": aux.item(),
                "grad_norm": gn.item(),
                "elapsed_s": round(time.time() - t0, 2),
            }
            log_rows.append(row)
            print(json.dumps(row), flush=True)
        if not a.bench and (step % a.eval_every == 0 or step == steps - 1):
            ev = {"step": step, **{k: round(v, 4) for k, v in eval_domains(model, eval_sets).items()}}
            eval_rows.append(ev)
            print("eval", json.dumps(ev), flush=True)
        if rs is not None and (step % a.routing_every == 0 or step == steps - 1):
            model.eval()
            sm = rs.summarize(rs.route_counts(model, tok, routing_recs, a.seq_len))
            model.train()
            rrow = {
                "step": step,
                "js_mean": round(sm["js_mean_over_layers"], 4),
                "top25_per_domain": round(sm["top25_per_domain_mean_over_layers"], 4),
                "top25_pooled": round(sm["top25_pooled_mean_over_layers"], 4),
                **{f"js_L{r['layer']}": round(r["js_mean"], 4) for r in sm["layers"]},
            }
            routing_rows.append(rrow)
            print("routing", json.dumps(rrow), flush=True)
    train_s = time.time() - t0
    if a.bench:
        print(
            f"bench: {steps} steps in {train_s:.1f}s = {train_s / steps:.3f} s/step, "
            f"{steps * a.batch * a.seq_len / train_s:.0f} tok/s"
        )
        return

    # ---- save (bf16) ----
    model = model.to("cpu", torch.bfloat16)
    model.config.output_router_logits = False
    model.save_pretrained(a.out, safe_serialization=True)
    cj_path = os.path.join(a.out, "config.json")
    cj = json.load(open(cj_path))
    cj["torch_dtype"] = "bfloat16"
    cj["dtype"] = "bfloat16"
    cj["architectures"] = ["Qwen3MoeForCausalLM"]
    # both spellings, for readers that look at the JSON rather than the config class
    cj["num_experts"] = a.experts
    cj["num_local_experts"] = a.experts
    cj["rope_theta"] = 10000.0
    cj.pop("_experts_implementation", None)
    cj.pop("experts_implementation", None)
    json.dump(cj, open(cj_path, "w"), indent=2, sort_keys=True)
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    GenerationConfig(
        eos_token_id=[eot, im_end], pad_token_id=eot, bos_token_id=None, do_sample=False
    ).save_pretrained(a.out)
    with open(os.path.join(a.out, "training_log.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(log_rows[0]))
        w.writeheader()
        w.writerows(log_rows)
    with open(os.path.join(a.out, "eval_log.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(eval_rows[0]))
        w.writeheader()
        w.writerows(eval_rows)
    if routing_rows:
        with open(os.path.join(a.out, "routing_log.csv"), "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(routing_rows[0]))
            w.writeheader()
            w.writerows(routing_rows)
    tail = log_rows[-10:]
    summary = {
        "command": "python scripts/train_moe.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "args": vars(a),
        "params": n_params,
        "train_tokens_in_stream": len(stream),
        "tokens_seen": steps * a.batch * a.seq_len,
        "epochs_seen": steps * a.batch / n_blocks,
        "chat_wrapped_records": n_chat,
        "train_records": len(train),
        "final_train_ce_mean_last10_logs": sum(r["ce"] for r in tail) / len(tail),
        "final_heldout_ce": eval_rows[-1],
        "train_seconds": round(train_s, 1),
        "total_seconds": round(time.time() - t_start, 1),
        "torch": torch.__version__,
        "checkpoint_bytes": os.path.getsize(os.path.join(a.out, "model.safetensors")),
    }
    json.dump(summary, open(os.path.join(a.out, "training_summary.json"), "w"), indent=1)
    if a.plot:
        plot(
            log_rows,
            eval_rows,
            a.plot,
            f"reap-mini-moe: {a.layers}L h{a.hidden} {a.experts}E top-{a.topk}, "
            f"{steps} steps x {a.batch}x{a.seq_len} tokens ({a.device}, {train_s / 60:.1f} min)",
        )
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    sys.exit(main())
