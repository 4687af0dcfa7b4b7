"""Can a critic learn the value of a frozen policy offline, given enough data? A supervised value-fit diagnostic.

    1. sample --rollouts responses of the frozen policy on the task's train rows (--temperature, 1; a multi-turn task
       plays episodes with the trainer's own driver, agent.run_episodes);
    2. Monte Carlo targets: the row's reward (the episode return) on every model token, gamma = 1, what the
       trainer's GAE(lambda=1) returns are;
    3. split the rows by prompt into fit / held-out (--holdout), build the critic as the trainer does
       (value_model.build_critic from the policy, head set to the mean reward), and train it --epochs passes of
       AdamW on the fit rows, minibatches of --batch, with the trainer's value loss (losses.value_loss, no clip)
       through forward.response_values;
    4. after each epoch print the held-out explained variance, overall and per position bucket, and the fit-set
       EV (fit >> held-out: over-fitting; both ~0: the critic cannot learn the value from this data).

With --ceiling, the last epoch is printed beside bench/value_ceiling.py's perfect and prompt-only ceilings
(its --out JSON) and the ratio fit / perfect. --critic-context answer (env) puts the reference answer (the
environment's critic_context() string) before the prompt in the critic's input only, with the trainer's own prefix
code (value_model.context_ids, critic_batch); the policy's rollouts are unchanged. Seeds: --seed drives sampling, the
split, the head-free init and the minibatch order; the same command prints the same figures.

    .venv/bin/python bench/value_fit.py                                    # default tiny addition model
    .venv/bin/python bench/value_fit.py --rollouts 8192 --epochs 3 --lr 3e-4 --critic-context answer
    .venv/bin/python bench/value_fit.py --ceiling /tmp/ceiling.json --out /tmp/fit.json
    .venv/bin/python bench/value_fit.py --model PATH --task math.jsonl --reward math --rollouts 1024
    .venv/bin/python bench/value_fit.py --rollouts 1024 --save /tmp/critic   # then train_ppo.py --critic-init /tmp/critic
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import losses as L  # noqa: E402
from config import Config  # noqa: E402
from data.rewards import load_reward  # noqa: E402
from data.tasks import get_task  # noqa: E402
from evaluation import rollouts, scored  # noqa: E402
from forward import response_values  # noqa: E402
from update import micro  # noqa: E402
from value_model import context_ids, critic_batch  # noqa: E402
from embedded_engine import EmbeddedEngine  # noqa: E402
from rollout import Sampling  # noqa: E402
from value_model import build_critic, save_fitted_critic, set_head_to_mean  # noqa: E402
from checkpoint import sha256_path  # noqa: E402


def sample(
    task, tok, model: str, rows, seed: int, max_turns: int = 0, temperature: float = 1.0, max_new_tokens: int = 0
):
    """(Rollout or agent.Episodes, its Rollout, Monte Carlo returns [B, T], mask [B, T]) of one sample per row
    (max_new_tokens 0: the task's)."""
    engine = EmbeddedEngine(model, dtype="fp32")
    s = Sampling(
        temperature, max_new_tokens=max_new_tokens or task.max_new_tokens, stop_token_ids=(tok.eos_token_id,), seed=seed
    )
    play = None
    if task.env is not None:
        from agent import run_episodes

        def play(eng, r, s_):
            return run_episodes(
                eng,
                tok,
                task.env,
                r,
                s_,
                max_turns=max_turns or task.max_turns,
                context_len=engine.max_positions,
                timeout=task.user_timeout,
            )

    out = rollouts(engine, tok, rows, s, play)
    _, sc = scored(task, tok, rows, 1, out, play)
    ro = out.rollout if play else out
    if play:  # each episode row's return on all its model tokens
        r, ok = out.returns[out.episode].float(), torch.ones(len(ro.mask), dtype=torch.bool)
    else:
        r, ok = sc.rewards.float(), sc.rewarded
    mask = ro.mask & ok[:, None]  # a row without a reward teaches nothing
    return out, ro, r[:, None].expand_as(mask).clone(), mask


@torch.no_grad()
def values_of(critic, tb, rows: torch.Tensor, cfg: Config) -> torch.Tensor:
    return (
        torch.cat([response_values(critic, tb, r) for r in micro(rows, cfg.micro_batch)])
        if len(rows)
        else torch.zeros(0, tb.keep.numel())
    )


def evs(v: torch.Tensor, r: torch.Tensor, m: torch.Tensor) -> dict[str, float]:
    out = {"ev": L.explained_variance(v, r, m).item()}
    out.update(
        {k.removeprefix("critic/ev_pos_"): e.item() for k, e in L.explained_variance_by_position(v, r, m).items()}
    )
    return out


def fit(
    critic,
    tb,
    returns,
    mask,
    fit_rows,
    held_rows,
    *,
    epochs: int,
    batch: int,
    lr: float,
    seed: int,
    cfg: Config,
    log=print,
):
    """Train the critic on fit_rows; per epoch {"epoch", "held": evs, "fit": evs}. tb: the critic's TrainBatch."""
    set_head_to_mean(critic, returns[fit_rows, 0][mask[fit_rows].any(-1)].sum(), mask[fit_rows].any(-1).sum())
    opt = torch.optim.AdamW([p for p in critic.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    hist = []
    for epoch in range(1, epochs + 1):
        critic.train()
        for mb in fit_rows[torch.randperm(len(fit_rows), generator=g)].split(batch):
            denom = L.loss_denominator(mask[mb], cfg.agg, mask.size(1)).clamp_min(1)
            for r in micro(mb, cfg.micro_batch):
                loss, _ = L.value_loss(
                    v := response_values(critic, tb, r),
                    v.detach(),
                    returns[r],
                    mask[r],
                    clip=None,
                    agg=cfg.agg,
                    num_tokens=denom,
                )
                loss.backward()
            torch.nn.utils.clip_grad_norm_(critic.parameters(), cfg.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
        critic.eval()
        row = {
            "epoch": epoch,
            "held": evs(values_of(critic, tb, held_rows, cfg), returns[held_rows], mask[held_rows]),
            "fit": evs(values_of(critic, tb, fit_rows, cfg), returns[fit_rows], mask[fit_rows]),
        }
        log(f"  epoch {epoch}: held-out EV {row['held']['ev']:.3f}, fit EV {row['fit']['ev']:.3f}")
        hist.append(row)
    return hist


def split(prompts: list, holdout: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fit rows, held-out rows): all rows of a prompt on one side; a seeded 1 - holdout : holdout split of the prompts."""
    uniq = sorted(set(map(str, prompts)))
    g = torch.Generator().manual_seed(seed + 7)
    held = {uniq[i] for i in torch.randperm(len(uniq), generator=g)[: max(1, round(holdout * len(uniq)))].tolist()}
    side = torch.tensor([str(p) in held for p in prompts])
    return (~side).nonzero().flatten(), side.nonzero().flatten()


def table(hist: list[dict], ceiling: dict | None) -> str:
    buckets = [k for k in hist[-1]["held"] if k != "ev"]
    lines = [f"  {'':16s} {'overall':>8s} " + " ".join(f"{b:>6s}" for b in buckets)]

    def fmt(d, k):
        return f"{d[k]:6.3f}" if isinstance(d.get(k), (int, float)) and math.isfinite(d[k]) else f"{'-':>6s}"

    for h in hist:
        for side in ("held", "fit"):
            d = h[side]
            lines.append(
                f"  {'epoch ' + str(h['epoch']) + ' ' + side:16s} {fmt(d, 'ev'):>8s} "
                + " ".join(fmt(d, b) for b in buckets)
            )
    if ceiling:
        last = hist[-1]["held"]
        for name in ("perfect", "prompt_only", "probe"):
            if name in ceiling:
                d = {"ev": ceiling[name], **{b: ceiling.get(f"{name}/{b}") for b in buckets}}
                lines.append(f"  {name:16s} {fmt(d, 'ev'):>8s} " + " ".join(fmt(d, b) for b in buckets))
        if "perfect" in ceiling:
            d = {
                k: last[k] / ceiling[p] if isinstance(ceiling.get(p), (int, float)) and ceiling[p] > 0 else None
                for k, p in [("ev", "perfect")] + [(b, f"perfect/{b}") for b in buckets]
            }
            lines.append(f"  {'fit / perfect':16s} {fmt(d, 'ev'):>8s} " + " ".join(fmt(d, b) for b in buckets))
        if "headroom" in ceiling:
            lines.append(f"  headroom (value_ceiling.py): {ceiling['headroom']}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="HF model folder; empty = the default tiny model of --task")
    ap.add_argument("--task", default="addition", help="addition, sort, or a .jsonl/.parquet file")
    ap.add_argument("--reward", default="", help="as train_ppo.py's --reward: '' (exact), 'math', 'file.py:fn'")
    ap.add_argument(
        "--rollouts", type=int, default=1024, help="N: one sample per train row (rows repeat if N exceeds them)"
    )
    ap.add_argument("--temperature", type=float, default=1.0, help="the frozen policy's sampling temperature")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="response budget; 0 = the task's")
    ap.add_argument("--holdout", type=float, default=1 / 8, help="fraction of the prompts held out")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64, help="rows per optimiser step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument(
        "--critic-context",
        choices=("policy", "answer", "env"),
        default="policy",
        help="as train_ppo.py's: policy = the policy's tokens; answer = the reference answer prefixed; env = the "
        "environment's critic_context() string prefixed (multi-turn)",
    )
    ap.add_argument("--ceiling", default="", help="bench/value_ceiling.py --out JSON to print beside the fit")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="also write the figures as JSON here")
    ap.add_argument(
        "--save",
        default="",
        help="also save the fitted critic here, as the folder train_ppo.py --critic-init starts from (with its record: "
        "the base model's sha256, the critic context, this fit's settings and held-out EV)",
    )
    args = ap.parse_args(argv)
    for bad, msg in (
        (args.rollouts < 2, "--rollouts must be >= 2"),
        (not 0 < args.holdout < 1, "--holdout must be in (0, 1)"),
        (args.epochs < 1, "--epochs must be >= 1"),
        (args.batch < 1, "--batch must be >= 1"),
        (not args.lr > 0, "--lr must be > 0"),
        (not args.temperature > 0, "--temperature must be > 0"),
        (args.max_new_tokens < 0, "--max-new-tokens must be >= 0"),
        (args.ceiling and not os.path.isfile(args.ceiling), f"--ceiling {args.ceiling!r}: no such file"),
        (args.save and os.path.exists(args.save), f"--save {args.save!r} exists: give a new folder"),
    ):
        if bad:
            ap.error(msg)
    ceiling = json.load(open(args.ceiling)) if args.ceiling else None
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(args.seed)
    task = get_task(args.task, reward_fn=load_reward(args.reward) if args.reward else None)
    if args.critic_context == "env" and not callable(getattr(task.env, "critic_context", None)):
        ap.error(f"--critic-context env: --task {args.task} has no environment with a critic_context() method")
    model = args.model
    if not model:
        from data.tiny import default_model

        model = default_model(
            os.path.join(REPO, ".cache"),
            task=args.task if args.task in ("addition", "sort", "guess", "walk") else "addition",
        )
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    start = time.perf_counter()
    rows = task.train.select([i % len(task.train) for i in range(args.rollouts)])
    out, ro, returns, mask = sample(
        task, tok, model, rows, args.seed, temperature=args.temperature, max_new_tokens=args.max_new_tokens
    )
    sampled = time.perf_counter() - start
    if args.critic_context == "policy":
        tb = ro.to_batch(tok.pad_token_id)
    else:  # the trainer's critic-only prefixes (value_model.context_ids), one sample per row
        tb = critic_batch(ro, context_ids(args.critic_context, tok, rows, out, 1), tok.pad_token_id)
    fit_rows, held_rows = split(rows["prompt"], args.holdout, args.seed)
    cfg = Config()
    critic = build_critic(model, dtype=torch.float32)
    mean_return = returns[:, 0][mask.any(-1)].mean().item()
    print(
        f"value fit: {task.name}, {len(rows)} rollouts ({len(fit_rows)} fit / {len(held_rows)} held out), mean return "
        f"{mean_return:.3f}, critic context {args.critic_context}, lr {args.lr}, {args.epochs} epochs of batch {args.batch}"
        f" ({args.epochs * math.ceil(len(fit_rows) / args.batch)} steps); sampled in {sampled:.0f} s\n  model {model}"
    )
    hist = fit(
        critic,
        tb,
        returns,
        mask,
        fit_rows,
        held_rows,
        epochs=args.epochs,
        batch=args.batch,
        lr=args.lr,
        seed=args.seed,
        cfg=cfg,
    )
    print(table(hist, ceiling))
    out = {
        "model": model,
        "task": task.name,
        "rollouts": len(rows),
        "fit_rows": len(fit_rows),
        "held_rows": len(held_rows),
        "critic_context": args.critic_context,
        "temperature": args.temperature,
        "lr": args.lr,
        "epochs": args.epochs,
        "batch": args.batch,
        "seed": args.seed,
        "mean_return": mean_return,
        "seconds": round(time.perf_counter() - start, 1),
        "history": hist,
        "held": hist[-1]["held"],
        "fit": hist[-1]["fit"],
    }
    if ceiling and isinstance(ceiling.get("perfect"), (int, float)) and ceiling["perfect"] > 0:
        out["fit_over_perfect"] = hist[-1]["held"]["ev"] / ceiling["perfect"]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    if args.save:
        record = {k: v for k, v in out.items() if k not in ("history", "critic_context")}
        save_fitted_critic(
            critic, args.save, base_sha256=sha256_path(model), critic_context=args.critic_context, **record
        )
        print(f"saved the fitted critic to {args.save} (train_ppo.py --critic-init {args.save})")
    return out


if __name__ == "__main__":
    main()
