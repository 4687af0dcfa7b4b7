"""The critic: the policy's backbone with a fresh scalar head, and what it reads beyond the policy's input
(--critic-context: context_ids, critic_batch); load_policy, the policy's (and reference's) load; and PromptBaseline,
the critic-free running-mean baseline of --algo reinforce.

It is a stock Hugging Face ``AutoModelForTokenClassification`` with ``num_labels=1``: ``.model`` is the
backbone (the same module names as the policy's, so parallel.py's TP plan covers it) and ``.score`` is a
``Linear(hidden, 1)`` head. That makes a critic checkpoint a normal HF folder (safetensors) that
``AutoModelForTokenClassification.from_pretrained`` loads with no conversion step, for every architecture
that has a token-classification class (Llama, Qwen2, Qwen3, Mistral, ...).

    critic = build_critic("path/to/policy")            # backbone copied, head N(0, 0.02), zero bias
    values = critic_values(critic, input_ids, attention_mask)   # [B, L] float32
    critic.save_pretrained("ckpt/critic"); load_critic("ckpt/critic")
    save_fitted_critic(critic, "fitted", base_sha256=..., critic_context="policy")   # train_ppo.py --critic-init fitted
    ctb = critic_batch(ro, context_ids("answer", tok, task_rows, out, n), pad_id, n)  # --critic-context answer
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace

import torch
from torch import Tensor, nn
from transformers import (
    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    PreTrainedModel,
)

import losses
from agent import Episodes
from decoder import load_pretrained
from parallel import all_reduce
from rollout import Rollout, TrainBatch


def load_policy(path: str, what: str = "--model") -> PreTrainedModel:
    """The fp32 causal LM of a model folder; weights that do not fill its architecture are refused naming `what` and
    the tensors (decoder.load_pretrained)."""
    return load_pretrained(AutoModelForCausalLM, path, what, dtype=torch.float32)


def _critic_config(config):
    if type(config) not in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING:
        raise ValueError(
            f"build_critic: model type {config.model_type!r} has no Hugging Face token-classification class to carry "
            "a value head; supported: Llama, Qwen2, Qwen3, Mistral and the other *ForTokenClassification families"
        )
    # One scalar per token; no dropout before the head (a PPO critic must be deterministic in train mode).
    config.num_labels = 1
    config.classifier_dropout = 0.0
    return config


def build_critic(
    policy: str | PreTrainedModel, *, head_std: float = 0.02, dtype: torch.dtype | None = None
) -> PreTrainedModel:
    """Critic initialised from a policy checkpoint folder or an (unsharded) policy model.

    The backbone weights are copied from the policy; the head is re-drawn from N(0, head_std) with a zero
    bias (slime's init; head_std 0.02 is the usual initializer_range), so the first values are near 0.
    """
    if isinstance(policy, str):
        config = _critic_config(AutoConfig.from_pretrained(policy))
        # The policy's files have no value head (new) and may have an untied lm_head the critic drops (unused).
        critic = load_pretrained(
            AutoModelForTokenClassification,
            policy,
            "--model",
            new=("score.",),
            unused=("lm_head.",),
            config=config,
            dtype=dtype or "auto",
        )
    else:
        config = _critic_config(policy.config.__class__.from_dict(policy.config.to_dict()))
        critic = AutoModelForTokenClassification.from_config(config, dtype=dtype or policy.dtype)
        critic.model.load_state_dict(policy.get_submodule(policy.base_model_prefix).state_dict())
    with torch.no_grad():
        nn.init.normal_(critic.score.weight, std=head_std)
        if critic.score.bias is not None:
            critic.score.bias.zero_()
    return critic


def freeze_attention(critic: PreTrainedModel) -> None:
    """SAO's frozen-attention critic: every self-attention weight gets requires_grad=False (the MLPs, norms, embeddings
    and head still train)."""
    for name, p in critic.named_parameters():
        p.requires_grad_(".self_attn." not in name)


@torch.no_grad()
def set_head_to_mean(critic: PreTrainedModel, total: Tensor, count: Tensor) -> None:
    """A fresh head starts as the constant total / count (the mean reward of the first batch): explained variance 0, not
    the negative EV of a random head's noise (N(0, 0.02) rows give values of std ~0.2 on the tiny model)."""
    critic.score.weight.zero_()
    critic.score.bias.fill_((total / count.clamp_min(1)).item())


# Critic pretraining stops once the mean explained variance of the last PLATEAU_WINDOW steps is less than
# PLATEAU_MIN_GAIN above that of the window before (windows smooth the per-batch noise of 64-row EVs).
PLATEAU_WINDOW = 10
PLATEAU_MIN_GAIN = 0.01


def finite_mean(xs: list[float]) -> float:
    xs = [x for x in xs if math.isfinite(x)]  # EV is NaN on a batch whose returns are all equal
    return sum(xs) / len(xs) if xs else float("nan")


def ev_plateaued(evs: list[float]) -> bool:
    """The plateau rule of critic pretraining, on the per-step explained variances so far."""
    W = PLATEAU_WINDOW
    return len(evs) >= 2 * W and not finite_mean(evs[-W:]) >= finite_mean(evs[-2 * W : -W]) + PLATEAU_MIN_GAIN


def load_critic(path: str, dtype: torch.dtype | None = None, what: str = "the critic checkpoint") -> PreTrainedModel:
    """Load a critic saved with ``save_pretrained`` (a plain HF token-classification folder)."""
    return load_pretrained(AutoModelForTokenClassification, path, what, dtype=dtype or "auto")


# A fitted critic that --critic-init starts from: the critic's folder plus this record of what it was fitted for.
CRITIC_INIT = "critic_init.json"


def save_fitted_critic(
    critic: PreTrainedModel, out_dir: str, *, base_sha256: str, critic_context: str, **record
) -> None:
    """Save a critic fitted offline (bench/value_fit.py --save) as a folder --critic-init reads: the critic
    (save_pretrained) and CRITIC_INIT, naming the base model by content (checkpoint.sha256_path of its folder) and the
    --critic-context it was fitted with, plus `record` (how it was fitted, its held-out EV)."""
    critic.save_pretrained(out_dir)
    with open(os.path.join(out_dir, CRITIC_INIT), "w") as f:
        json.dump({"base_sha256": base_sha256, "critic_context": critic_context, **record}, f, indent=1)


def read_critic_init(path: str) -> dict:
    """The CRITIC_INIT record of a --critic-init folder; a folder without one is refused, naming the flag."""
    record = os.path.join(path, CRITIC_INIT)
    if not os.path.isfile(record):
        raise ValueError(
            f"--critic-init {path}: no {CRITIC_INIT} there; save a fitted critic with bench/value_fit.py --save DIR"
        )
    with open(record) as f:
        return json.load(f)


def critic_values(critic: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor | None = None, **kwargs) -> Tensor:
    """Per-token values [B, L] float32: values[:, i] = V(input_ids[:, : i + 1]), the value of the state
    whose last token is i. Align with logits: the value of the state before response token t sits at the
    same position as the logits that predict it."""
    return critic(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits[..., 0].float()


# ----------------------------------------------------------------------------- --critic-context: the critic's own input


# --critic-context answer: the text before the prompt in the critic's input (bench/value_fit.py uses it too)
ANSWER_CONTEXT = "Reference answer: {}\n"


def context_ids(kind: str, tok, task_rows, out, n: int) -> list[list[int]]:
    """The critic-only prefix of each training row, token ids (add_special_tokens=False). kind "answer":
    ANSWER_CONTEXT with the reference answer of the row's task row (rows are task row b // n; with episodes, the row's
    episode // n); "env": the string its episode's environment returned from critic_context() (agent.Episodes), the
    same on every row of a compacted episode."""
    episode = out.episode if isinstance(out, Episodes) else range(len(out.tokens))
    if kind == "answer":
        texts = [ANSWER_CONTEXT.format(task_rows[e // n]["answer"]) for e in episode]
    elif kind == "env":
        if not isinstance(out, Episodes) or any(out.critic_context[e] is None for e in episode):
            raise ValueError(
                "--critic-context env: the environment gave no critic_context() string (it needs the method)"
            )
        texts = [out.critic_context[e] for e in episode]
    else:
        raise ValueError(f"context_ids: unknown kind {kind!r} (answer or env)")
    return [tok(t, add_special_tokens=False).input_ids for t in texts]


def critic_batch(ro: Rollout, prefixes: list[list[int]], pad_id: int, n: int = 1) -> TrainBatch:
    """The critic's TrainBatch under --critic-context: row b's prompt is prefixes[b] + its prompt, the response block
    as in ro.to_batch (the same T columns, so response_values reads V before each response token exactly as on the
    policy's batch; only P grows). n > 1: each group of n rows shares one sequence (TrainBatch.shared) when the group's
    prefixes agree (answer: one prompt, one answer); otherwise (env: each episode its own string) per-row sequences,
    which give the same values. MoE routing is dropped (the critic never replays it)."""
    if len(prefixes) != len(ro.prompt_ids):
        raise ValueError(f"critic_batch: {len(prefixes)} prefixes for {len(ro.prompt_ids)} rows")
    prompts = [list(c) + list(p) for c, p in zip(prefixes, ro.prompt_ids)]
    tb = replace(ro, prompt_ids=prompts, routing=None).to_batch(pad_id)
    same = all(prefixes[b] == prefixes[b - b % n] for b in range(len(prefixes)))
    return tb.shared(n) if n > 1 and same else tb


# ----------------------------------------------------------------------------- --algo reinforce's baseline


class PromptBaseline:
    """--algo reinforce's baseline table (the SAO paper's running-mean control): per prompt (its key: the first train row
    with that prompt, data.tasks.prompt_keys), the last `window` rewards it got in earlier steps, oldest first. Every dp
    rank holds the same table (`advantages` adds all ranks' pairs), and it goes into the checkpoint:
    PromptBaseline(window, saved.table) resumes it exactly."""

    KEYS = "prompt"  # what the table's keys are, saved beside it: a checkpoint keyed otherwise (row indices) is refused

    def __init__(self, window: int, table: dict | None = None, keys: list[int] | None = None):
        self.window = window
        self.keys = keys  # each train row's prompt key (data.tasks.prompt_keys), for the caller
        self.table = {int(p): [float(r) for r in rs][-window:] for p, rs in (table or {}).items()}

    def lookup(self, prompts: list[int]) -> tuple[Tensor, Tensor]:
        """(past [N, window] float64, right-padded with 0; count [N] long): each prompt's rewards so far."""
        past = torch.zeros(len(prompts), self.window, dtype=torch.float64)
        count = torch.zeros(len(prompts), dtype=torch.long)
        for i, p in enumerate(prompts):
            h = self.table.get(int(p), [])
            past[i, : len(h)] = torch.tensor(h, dtype=torch.float64)
            count[i] = len(h)
        return past, count

    def update(self, prompts: list[int], rewards: list[float]) -> None:
        """Append each (prompt, reward) in order; a prompt keeps its last `window`."""
        for p, r in zip(prompts, rewards):
            self.table[int(p)] = (self.table.get(int(p), []) + [float(r)])[-self.window :]

    def advantages(
        self,
        prompts: Tensor,
        sample: Tensor,
        rewards: Tensor,
        valid: Tensor,
        samples: int,
        rank: int = 0,
        ranks: int = 1,
        group=None,
    ) -> tuple[Tensor, Tensor]:
        """One step of this dp rank's B rows: (advantages [B] float32, 0 on rows without a reward; had history [B] bool).
        Row b is sample sample[b] in [0, samples) of this rank (the rows of a compacted episode share it), of prompt
        prompts[b], with reward rewards[b] (multi-turn: its episode's return) if valid[b]. The baseline is read before
        this step's rewards join the table, so a reward is never in its own baseline; a prompt without history gets the
        mean reward of the global batch's samples. Then the (prompt, reward) pairs of every rank, one per sample in the
        global batch's order (rank by rank), are all-reduced over `group` and appended (losses.running_mean_advantages)."""
        pairs = torch.zeros(ranks, samples, 3, dtype=torch.float64, device=rewards.device)
        # an episode's rows agree
        pairs[rank, sample] = torch.stack([prompts.to(pairs), rewards.to(pairs), valid.to(pairs)], -1)
        pairs = all_reduce(pairs, group).view(-1, 3)
        ok = pairs[:, 2] > 0
        mean = pairs[ok, 1].mean() if ok.any() else pairs.new_zeros(())
        past, count = self.lookup(prompts.tolist())
        adv = losses.running_mean_advantages(rewards, past.to(rewards.device), count.to(rewards.device), mean) * valid
        self.update(pairs[ok, 0].long().tolist(), pairs[ok, 1].tolist())
        return adv, count.to(rewards.device) > 0
