"""The embedded default model: a ~1M-parameter Llama with a byte-level ChatML tokenizer, no hub (and its Qwen3-MoE
twin, ~1M active of 3.4M parameters: train_ppo.py --tiny moe).

`default_model()` returns a folder that `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained`
load like any Hugging Face checkpoint. It is built on first use (random init, then a short
supervised warm-up on the task so RL starts from a policy that is right some of the time; calc: the addition model,
then calc_warmup) and cached under .cache/, one model per built-in task. A few minutes on 2 CPU threads (always 2: BUILD_THREADS).

    python -m data.tiny            # build the addition model (once) and print the path
    python -m data.tiny sort       # the sort model (guess: the multi-turn guessing task; walk: the windy walk; calc: the calculator tool)
    python -m data.tiny addition moe   # the MoE twin (Qwen3-MoE, 8 experts, top-2): train_ppo.py --tiny moe
"""

import fcntl
import functools
import hashlib
import json
import os
import platform
import random
import shutil
import tempfile
import time
from typing import Callable

import torch
import torch.nn.functional as F
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

import agent
import tools
from data.calc import P_TOOL
from data.calc import demo_move as calc_move
from data.guess import interval
from data.tasks import BUILTIN, Task, calc_task, encode_prompt
from embedded_engine import EmbeddedEngine
from rollout import Rollout, Sampling

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PAD_ID, IM_START_ID, EOS_ID = 256, 257, 258  # the special tokens come right after the 256 bytes
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Bump when a change to this file changes the built model, so old caches are not reused.
CACHE_FORMAT = 4
# The warm-up's outcome depends on the torch thread count (float sums split differently): on this recipe 1 thread
# ends addition at the 600-step cap with 32% while 2 threads reach 46% at step 550. The build always runs with this
# many threads, whatever the caller's setting (OMP_NUM_THREADS=1 under torchrun, the core count under pytest), so
# one cache name is one model on every machine of a kind.
BUILD_THREADS = 2
# Embedding rows are padded to a multiple of this (Megatron-style), for the vocab-parallel embedding.
VOCAB_MULTIPLE = 64
LR_WARMUP_STEPS = 30
GRAD_CLIP = 1.0
# Supervised warm-up per built-in task: stop at target_acc greedy exact match (or max_steps), so RL starts
# from a policy that is right some of the time and has room to improve.
DEFAULT_WARMUP = {
    "addition": dict(target_acc=0.4, max_steps=600, batch_size=64, lr=3e-3, eval_every=25, n_eval=256),
    "sort": dict(target_acc=0.2, max_steps=600, batch_size=64, lr=3e-3, eval_every=25, n_eval=256),
    "guess": dict(target_acc=0.3, max_steps=600, batch_size=64, lr=3e-3, eval_every=25, n_eval=256),
    # Greedy walk success cannot pass ~0.26 (the greedy walker never jumps; bench/walk_design.py): target 1.0 runs all
    # the steps, so the sampled policy learns the demonstrations' jump rates, not just their most likely move.
    "walk": dict(target_acc=1.0, max_steps=300, batch_size=64, lr=3e-3, eval_every=50, n_eval=256),
    # calc starts from the addition model (it already writes digits) and fits calc_warmup's phases (p_tool, steps, lr)
    # in turn: demonstrations that always call the calculator (copying the expression into the call takes ~1,000
    # steps), then the P_TOOL mix at a lower lr, which brings the sampled call rate down to about a quarter and keeps
    # the copy (at lr 1e-3 the mix swung calls between 5% and 30% and lost most of the copy: bench/calc_design.py,
    # docs/tools.md).
    "calc": dict(
        init="addition", phases=((1.0, 1000, 1e-3), (P_TOOL, 200, 2e-4)), batch_size=32, n_eval=256, rows=8000
    ),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode char map, the alphabet of the ByteLevel pre-tokenizer."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {}
    n = 0  # control bytes shifted so far
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:  # control bytes, space, ...: shifted past 255 so every byte has a visible char
            chars[b] = chr(256 + n)
            n += 1
    return chars


def build_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Byte-level tokenizer: token id b is byte b (no merges, so every digit is one token), then
    <|endoftext|> (pad) = 256, <|im_start|> = 257, <|im_end|> (eos) = 258, and a ChatML template.
    No BOS token, as in Qwen's ChatML models."""
    vocab = {char: b for b, char in _bytes_to_unicode().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=256,
    )
    ids = [tok.pad_token_id, tok.convert_tokens_to_ids("<|im_start|>"), tok.eos_token_id]
    assert ids == [PAD_ID, IM_START_ID, EOS_ID], ids
    return tok


def tiny_config(vocab_size: int, **overrides) -> transformers.LlamaConfig:
    """hidden 128, 4 layers, 4 heads (2 KV heads, head_dim 32), MLP 512, tied embeddings: ~1.0M params.

    The Llama model type, not Qwen2: for a Qwen2 config AutoTokenizer loads Qwen2Tokenizer, which
    rebuilds the pre-tokenizer instead of using the saved one. Token ids are build_tokenizer()'s.
    The embedding is padded to a multiple of VOCAB_MULTIPLE rows (unused ids are never produced by the
    tokenizer), so tensor parallelism can split the vocabulary over 2, 4 or 8 ranks.
    """
    kwargs = dict(
        vocab_size=-(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    return transformers.LlamaConfig(**{**kwargs, **overrides})


def tiny_moe_config(vocab_size: int, **overrides) -> transformers.Qwen3MoeConfig:
    """The MoE twin of tiny_config (Qwen3-MoE): the same attention (plus Qwen3's q/k RMSNorm) and, in place of the MLP,
    8 experts of width 256 with top-2 routing (renormalised, as Qwen3-30B-A3B), so the active MLP per token has the
    dense model's 3 x 128 x 512 weights: ~1.0M active, ~3.4M total parameters. Tied embeddings, like the dense model
    (untied, the warm-up stalls: 3.9% after 600 steps against 57% at 400 tied); default_model saves the warmed model
    untied (untie_head), since SGLang 0.5.23's Qwen3-MoE never ties its head and would serve a random one."""
    kwargs = dict(
        vocab_size=-(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        norm_topk_prob=True,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    return transformers.Qwen3MoeConfig(**{**kwargs, **overrides})


ARCHS = {
    "dense": (tiny_config, transformers.LlamaForCausalLM),
    "moe": (tiny_moe_config, transformers.Qwen3MoeForCausalLM),
}


def build_tiny_model(out_dir: str, seed: int = 0, arch: str = "dense") -> str:
    """Randomly initialised (seeded) tiny model ("dense" or "moe") + tokenizer + generation config, saved as an HF folder."""
    tok = build_tokenizer()
    torch.manual_seed(seed)
    make_config, cls = ARCHS[arch]
    model = cls(make_config(len(tok)))
    # Greedy by default; the RL loop passes its own sampling settings.
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=False
    )
    model.save_pretrained(out_dir)  # safetensors, tied lm_head stored once
    tok.save_pretrained(out_dir)
    return out_dir


@torch.no_grad()
def greedy_completions(model, tok, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy decoding with full recompute each step (no KV cache: fine for a few tokens).

    Prompts are left-padded to [B, P] and the attention mask hides the padding. Positions count real
    tokens only, as HF generate does (RoPE is shift invariant, so for Llama this changes nothing but
    round-off). A row stops at <|im_end|>; special tokens are dropped from the returned text.
    """
    rows = [encode_prompt(tok, p) for p in prompts]
    width = max(map(len, rows))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    done = torch.zeros(len(rows), dtype=torch.bool)
    for _ in range(max_new_tokens):
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        next_id = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].argmax(-1)
        next_id = torch.where(done, tok.pad_token_id, next_id)
        ids, mask = torch.cat([ids, next_id[:, None]], 1), torch.cat([mask, (~done).long()[:, None]], 1)
        done |= next_id == tok.eos_token_id
        if done.all():
            break
    return tok.batch_decode(ids[:, width:], skip_special_tokens=True)


def _sft_batch(tok, examples: list[tuple[list[int], list[bool]]]):
    """Right-padded ids [B, L] and a bool mask [B, L - 1] over the positions whose next-token target is trained:
    examples are (ids, trained) with trained[j] True where ids[j] is a model token (answer, <|im_end|>)."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), tok.pad_token_id)
    loss_mask = torch.zeros(len(examples), width - 1, dtype=torch.bool)
    for i, (x, trained) in enumerate(examples):
        ids[i, : len(x)] = torch.tensor(x)
        loss_mask[i, : len(x) - 1] = torch.tensor(trained[1:])  # logits at t predict token t + 1
    return ids, loss_mask


class demo_engine:
    """A rollout engine that plays noisy bisection (for the warm-up's demonstrations): from the interval left, the
    midpoint with probability p_mid, else a uniform draw; the interval itself when asked for a summary. With `move`
    (conversation text, rng) -> text it plays that instead (`--task walk`: data/walk.py's demo_move). Draws come
    from each row's seed, so demonstrations are reproducible."""

    def __init__(self, tok, p_mid: float = 0.5, move: Callable[[str, random.Random], str] | None = None):
        self.tok = tok
        self.p_mid = p_mid
        self.move = move

    def bisect(self, conversation: str, rng: random.Random) -> str:
        lo, hi, summary = interval(conversation)
        lo, hi = min(lo, hi), max(lo, hi)
        if summary:
            return f"{lo}-{hi}"
        if rng.random() < self.p_mid:
            return str((lo + hi) // 2)
        return str(rng.randint(lo, hi))

    def generate(self, prompt_ids, sampling) -> Rollout:
        outs = []
        for r, ids in enumerate(prompt_ids):
            rng = random.Random(sampling.row_seed(r))
            text = (self.move or self.bisect)(self.tok.decode(ids), rng)
            outs.append(self.tok(text, add_special_tokens=False).input_ids + [self.tok.eos_token_id])
        return Rollout.from_ragged(outs, prompt_ids, ["stop"] * len(outs))


def demo_pool(ro: Rollout) -> list[tuple[list[int], list[bool]]]:
    """_sft_batch's examples from played demonstrations: each row's prompt and attended tokens, the model's trained."""
    return [
        (p + ro.tokens[b][ro.attend[b]].tolist(), [False] * len(p) + ro.mask[b][ro.attend[b]].tolist())
        for b, p in enumerate(ro.prompt_ids)
    ]


def _episode_pool(tok, task: Task, n_eval: int, seed: int) -> tuple[list, Callable]:
    """Demonstrations of a multi-turn task, played by the multi-turn driver itself so they have the exact token layout
    RL sees, and greedy success on the validation rows: data/guess.py's noisy bisection (a third with compaction), or
    for walk and calc their modules' demo_move (no compaction; calc's tool environment played as train_ppo.py plays it)."""
    rows = task.train.to_list()
    val, rest = rows[:n_eval], rows[n_eval:]
    builtin = BUILTIN.get(task.name)
    compaction = builtin is not None and builtin.demo_compaction
    move = builtin.demo_move if builtin is not None else None
    env = task.env
    if tools.is_tool_env(task.env):
        env = tools.tool_env(task.env, max_turns=task.max_turns, task=task)
    pool = []
    for i in range(0, len(rest), 1000):
        chunk = rest[i : i + 1000]
        engine = demo_engine(tok, move=move)
        ep = agent.run_episodes(
            engine,
            tok,
            env,
            chunk,
            Sampling(max_new_tokens=task.max_new_tokens, seed=seed + i),
            max_turns=task.max_turns,
            context_len=tok.model_max_length,
            compact_at=90 if i % 3000 == 0 and compaction else 0,
        )
        pool += demo_pool(ep.rollout)

    def accuracy(model) -> float:
        engine = EmbeddedEngine(model, dtype="fp32")
        greedy = Sampling(top_k=1, max_new_tokens=task.max_new_tokens, stop_token_ids=(tok.eos_token_id,))
        ep = agent.run_episodes(
            engine, tok, env, val, greedy, max_turns=task.max_turns, context_len=tok.model_max_length
        )
        return float((ep.returns > 0).float().mean())

    return pool, accuracy


def calc_pool(tok, rows: list, p_tool: float) -> list:
    """_sft_batch's examples from data/calc.py's demonstrations on `rows`, played as train_ppo.py plays the task: each
    calls the calculator with probability p_tool (drawn from its row's seed)."""
    task = calc_task()
    env = tools.tool_env(task.env, max_turns=task.max_turns, task=task)
    ep = agent.run_episodes(
        demo_engine(tok, move=functools.partial(calc_move, p_tool=p_tool)),
        tok,
        env,
        rows,
        Sampling(max_new_tokens=task.max_new_tokens, seed=0),
        max_turns=task.max_turns,
        context_len=256,
    )
    return demo_pool(ep.rollout)


def sft(
    model, tok, pool: list, steps: int, lr: float, batch_size: int, seed: int = 0, every: int = 0, report=None
) -> int:
    """Supervised steps on pool's (ids, trained) examples: mean cross-entropy over the trained tokens, AdamW (betas
    (0.9, 0.95), no weight decay), a linear LR warm-up and clipping at 1, batches from seeded shuffled epochs (the tail of
    each dropped). Every `every` steps and at the last, report(step, loss) in eval mode; a report that returns True
    stops the fit. Returns the steps taken; the model is left in eval mode."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    # Linear LR warm-up + gradient clipping: without them lr 3e-3 spikes early and the digits after
    # the first stay at chance for 500+ steps; with them addition passes 40% in ~300 steps.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / LR_WARMUP_STEPS))
    order = torch.empty(0, dtype=torch.long)
    for step in range(1, steps + 1):
        model.train()
        if len(order) < batch_size:
            order = torch.randperm(len(pool), generator=gen)
        batch, order = order[:batch_size], order[batch_size:]
        ids, trained = _sft_batch(tok, [pool[i] for i in batch])
        logits = model(input_ids=ids).logits[:, :-1]  # right padding: no attention mask needed for the loss
        loss = F.cross_entropy(logits[trained], ids[:, 1:][trained])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        sched.step()
        if report and (step % every == 0 or step == steps):
            model.eval()
            if report(step, loss.item()):
                return step
    model.eval()
    return steps


def tool_caller(model_dir: str, out_dir: str, steps: int = 200, lr: float = 1e-3, rows: int = 640) -> str:
    """A tiny model that calls the calculator, for tests and examples of tool-episode tokens (not --task calc's model):
    model_dir (the tiny addition model) after `steps` supervised steps of 32 on the first `rows` calc train rows'
    demonstrations, always calling. It writes tool calls, most with a wrongly copied expression, and gets tool messages
    back: in 42-43 of 48 sampled episodes at 1 or 2 threads (100 steps at lr 3e-3 gave 10 or 42 by thread count).
    Seconds on a CPU; saved to and returns out_dir."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pool = calc_pool(tok, calc_task().train.to_list()[:rows], p_tool=1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    torch.manual_seed(0)
    for _ in range(steps):
        ids, trained = _sft_batch(tok, [pool[i] for i in torch.randint(len(pool), (32,)).tolist()])
        loss = F.cross_entropy(model(input_ids=ids).logits[:, :-1][trained], ids[:, 1:][trained])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def calc_stats(model, tok, rows: list) -> dict:
    """On calc rows, sampled (temperature 1) and greedy: the share of episodes that call the calculator, the success
    rate, and the success rate of the episodes that call it."""
    task = calc_task()
    env = tools.tool_env(task.env, max_turns=task.max_turns, task=task)
    engine = EmbeddedEngine(model, dtype="fp32")
    stops = tools.stop_ids(tok, env)
    out = {}
    for kind, s in (
        ("sampled", Sampling(max_new_tokens=task.max_new_tokens, seed=3, stop_token_ids=stops)),
        ("greedy", Sampling(top_k=1, max_new_tokens=task.max_new_tokens, stop_token_ids=stops)),
    ):
        ep = agent.run_episodes(engine, tok, env, rows, s, max_turns=task.max_turns, context_len=tok.model_max_length)
        used = [i for i, st in enumerate(ep.tool_stats) if st["calls"]]
        out.update(
            {
                f"{kind}_calls": len(used) / len(rows),
                f"{kind}_success": ep.returns.mean().item(),
                f"{kind}_success_given_call": sum(ep.returns[i].item() for i in used) / max(1, len(used)),
            }
        )
    return {k: round(v, 3) for k, v in out.items()}


def calc_warmup(model_dir: str, out_dir: str, phases, batch_size: int, n_eval: int, rows: int, **_) -> dict:
    """--task calc's warm-up: from model_dir, sft for each (p_tool, steps, lr) of phases in turn, on the
    demonstrations of the `rows` train rows after the first n_eval (the validation slice, never trained on); then
    calc_stats on that slice. Saves to out_dir."""
    start = time.perf_counter()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    train = calc_task().train.to_list()
    for p_tool, steps, lr in phases:
        sft(model, tok, calc_pool(tok, train[n_eval : n_eval + rows], p_tool), steps, lr, batch_size)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return {
        "steps": sum(p[1] for p in phases),
        **calc_stats(model, tok, train[:n_eval]),
        "seconds": round(time.perf_counter() - start, 1),
    }


def warmup(
    model_dir: str,
    out_dir: str,
    task: Task,
    *,
    target_acc: float = 0.4,
    max_steps: int = 600,
    batch_size: int = 64,
    lr: float = 3e-3,
    eval_every: int = 25,
    n_eval: int = 256,
    seed: int = 0,
) -> dict:
    """Supervised warm-up on `task.train`, stopping once greedy accuracy (task.reward_fn; for a multi-turn task the
    share of won episodes) on a held-out slice reaches `target_acc`, or after `max_steps` (some seeds plateau).
    Saves to `out_dir`.

    The first `n_eval` train rows are the validation slice and are never trained on; the rest are
    visited in seeded shuffled epochs. The loss is the mean cross-entropy over model tokens only
    (answer + <|im_end|>; a multi-turn task's demonstrations: every turn, never the observations).
    Deterministic for a seed (at a fixed torch thread count).
    Returns {"steps", "accuracy", "seconds", "history"}.
    """
    start = time.perf_counter()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if len(task.train) <= n_eval:
        raise ValueError(f"warmup: task {task.name!r} has {len(task.train)} train rows, need more than n_eval={n_eval}")
    if task.env is not None:
        pool, accuracy_of = _episode_pool(tok, task, n_eval, seed)
    else:
        val, rest = task.train[:n_eval], task.train[n_eval:]  # dicts of lists
        pool = []
        for p, a in zip(rest["prompt"], rest["answer"]):
            x, y = encode_prompt(tok, p), tok(a + tok.eos_token, add_special_tokens=False).input_ids
            pool.append((x + y, [False] * len(x) + [True] * len(y)))

        def accuracy_of(model) -> float:
            completions = greedy_completions(model, tok, val["prompt"], task.max_new_tokens)
            return sum(task.reward_fn(completions, prompts=val["prompt"], answer=val["answer"])) / n_eval

    acc = accuracy_of(model.eval())  # a model that already meets the target is saved as is
    history = [{"step": 0, "loss": None, "accuracy": acc}]

    def evaluate(step, loss) -> bool:
        nonlocal acc
        acc = accuracy_of(model)
        history.append({"step": step, "loss": round(loss, 4), "accuracy": acc})
        return acc >= target_acc

    step = 0
    if acc < target_acc:
        step = sft(model, tok, pool, max_steps, lr, batch_size, seed, eval_every, evaluate)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return {"steps": step, "accuracy": acc, "seconds": round(time.perf_counter() - start, 1), "history": history}


def untie_head(path: str) -> None:
    """Re-save the model at path with its LM head as a copy of the embedding: the same function, two weights from now on."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    model.save_pretrained(path)


def cpu_name():
    """The CPU's model name: the warm-up's outcome depends on the CPU's float kernels, so a build records it."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine() or "unknown"


def default_model_path(cache_dir: str = ".cache", seed: int = 0, task: str = "addition", arch: str = "dense") -> str:
    """Where default_model caches this model (built or not): the name holds architecture, task, seed and a hash of
    the settings. The same name on two machines can still hold different weights: float rounding differs by CPU and
    library version (warmup.json's built_with says what built it), so bench/lab.py keeps each grid's start model."""
    if task not in DEFAULT_WARMUP:
        raise ValueError(f"default_model: no default warm-up for task {task!r}; choose one of {sorted(DEFAULT_WARMUP)}")
    if arch not in ARCHS:
        raise ValueError(f"default_model: arch must be one of {sorted(ARCHS)}, got {arch!r}")
    config = ARCHS[arch][0](256 + len(SPECIAL_TOKENS)).to_diff_dict()
    config.pop("transformers_version")  # the same model under any version, so one cache entry
    settings = {
        "format": CACHE_FORMAT,
        "config": config,
        **({"untie_head": True} if arch == "moe" else {}),
        "task": task,
        "warmup": DEFAULT_WARMUP[task],
        "lr_warmup_steps": LR_WARMUP_STEPS,
        "grad_clip": GRAD_CLIP,
        "threads": BUILD_THREADS,
    }
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]
    return os.path.abspath(os.path.join(cache_dir, f"tiny-{'moe-' if arch == 'moe' else ''}{task}-seed{seed}-{key}"))


def default_model(cache_dir: str = ".cache", seed: int = 0, task: str = "addition", arch: str = "dense") -> str:
    """Path of the tiny model ("dense", or its MoE twin "moe") warmed up on a built-in task ("addition", "sort", "guess",
    "walk" or "calc"), built on first use and cached by architecture + task + seed + settings (default_model_path).

    Built in a temp folder and renamed into place, so an interrupted build never leaves a half-written
    cache. A process that asks for a model another process is building waits for that build (a lock file beside
    the folder) instead of building it twice. The warm-up uses the task's default seed so its test split, the one RL
    evaluates on, is never trained on whatever the model seed.
    """
    path = default_model_path(cache_dir, seed, task, arch)
    if os.path.isfile(os.path.join(path, "warmup.json")):
        return path
    os.makedirs(cache_dir, exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when the process dies
        if os.path.isfile(os.path.join(path, "warmup.json")):  # built while we waited
            return path
        return _build_default_model(path, cache_dir, seed, task, arch)


def _build_default_model(path: str, cache_dir: str, seed: int, task: str, arch: str) -> str:
    """default_model's build, under its lock: warm up in a temp folder of cache_dir, then rename it to path."""
    print(
        f"building the default tiny {arch} {task} model (1-3 minutes on CPU; MoE and calc longer) into {path}",
        flush=True,
    )
    tmp = tempfile.mkdtemp(dir=cache_dir, prefix=".building-")
    os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; the cache should read like any folder
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # the load/save bars would bury the one line above
    threads = torch.get_num_threads()
    torch.set_num_threads(BUILD_THREADS)
    try:
        if "init" in DEFAULT_WARMUP[task]:  # calc: from the addition model (a MoE one is untied already)
            init = default_model(cache_dir, seed, DEFAULT_WARMUP[task]["init"], arch)
            stats = calc_warmup(init, tmp, **DEFAULT_WARMUP[task])
        else:
            build_tiny_model(tmp, seed=seed, arch=arch)
            stats = warmup(tmp, tmp, BUILTIN[task].make(), **DEFAULT_WARMUP[task], seed=seed)
            if arch == "moe":
                untie_head(tmp)
        stats["built_with"] = {
            "threads": BUILD_THREADS,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cpu": cpu_name(),
        }
        with open(os.path.join(tmp, "warmup.json"), "w") as f:
            json.dump(stats, f, indent=1)
        try:
            os.replace(tmp, path)
        except OSError:  # another process finished the same build first; theirs is identical
            if not os.path.isfile(os.path.join(path, "warmup.json")):
                raise
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(tmp, ignore_errors=True)
        if bars:
            transformers.utils.logging.enable_progress_bar()
    return path


if __name__ == "__main__":
    import sys

    task = sys.argv[1] if len(sys.argv) > 1 else "addition"
    arch = sys.argv[2] if len(sys.argv) > 2 else "dense"
    print(default_model(task=task, arch=arch))
