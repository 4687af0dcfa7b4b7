"""TP=2 against TP=1 and dp=2 against one process, on 2 CPU ranks (gloo). Run by tests/test_parallel.py:

    PYTHONPATH=. OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 tests/tp_worker.py out.json

Every rank builds the same fp32 reference model from a seed and runs it unsharded (TP=1), then a
copy sharded over both ranks (TP=2) or fed half the batch (dp=2), with the project's losses (and the
metrics reduction, for the critic's explained variance). It writes {check: max |difference|} (max
over ranks) to out.json; the test holds the tolerances.
"""

import copy
import json
import math
import sys

import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import logprobs
import losses
import parallel
from embedded_engine import EmbeddedEngine
from runlog import Metrics
from data.tiny import tiny_config, tiny_moe_config

B, L, P = 4, 12, 4  # batch, sequence length, prompt length: T = L - P response tokens
LENGTHS = [12, 9, 12, 6]  # right padding; row 3 has only 2 response tokens
TEMPERATURE = 0.7
MAX_NORM = 0.05  # below the gradient norms seen here, so clipping really scales the gradients

CONFIGS = {
    "llama": tiny_config(vocab_size=300),  # the project's tiny model: tied embeddings
    "qwen2": transformers.Qwen2Config(  # q/k/v biases, untied head
        vocab_size=300,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        max_position_embeddings=256,
    ),
    "qwen3": transformers.Qwen3Config(  # q_norm / k_norm over head_dim
        vocab_size=300,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        max_position_embeddings=256,
    ),
    "qwen3_moe": tiny_moe_config(vocab_size=300, num_hidden_layers=2),  # 8 experts, top-2: 4 per rank
}
PREFIX = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe"}


def build(family: str, kind: str) -> torch.nn.Module:
    """The fp32 reference policy (*ForCausalLM) or critic (*ForTokenClassification, num_labels=1)."""
    config = copy.deepcopy(CONFIGS[family])
    suffix = "ForCausalLM" if kind == "policy" else "ForTokenClassification"
    if kind == "critic":
        config.num_labels = 1
    torch.manual_seed(0)
    # eval(): the critic's classifier dropout would otherwise make the two runs differ.
    return getattr(transformers, PREFIX[family] + suffix)(config).float().eval()


def make_batch(vocab_size: int) -> dict[str, torch.Tensor]:
    """Right-padded ids [B, L] and the rollout-time tensors of the losses, [B, T], identical on every rank."""
    g = torch.Generator().manual_seed(1)
    attention_mask = (torch.arange(L)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    T = L - P
    return {
        "input_ids": torch.randint(0, vocab_size, (B, L), generator=g) * attention_mask,
        "attention_mask": attention_mask,
        "mask": attention_mask[:, P:].bool(),
        "advantages": torch.randn(B, T, generator=g),
        "noise": 0.3 * torch.randn(B, T, generator=g),  # old_logp / old_values = reference + noise
        "returns": torch.randn(B, T, generator=g),
    }


def forward_loss(model, kind: str, batch: dict, old: torch.Tensor | None, num_tokens=None):
    """(output, loss) with the project's losses. output: logits [B, L, V] or values [B, T] (fp32)."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    if kind == "policy":
        # Logits at position t predict token t + 1: response tokens P.. are scored by logits P-1..L-2.
        pred = logprobs.token_logprobs(out[:, P - 1 : -1], batch["input_ids"][:, P:], TEMPERATURE)
    else:
        pred = out.squeeze(-1)[:, P:]
    if old is None:  # the reference run defines the "rollout-time" tensors for both runs
        old = pred.detach() + batch["noise"]
    if kind == "policy":
        loss, _ = losses.ppo_policy_loss(
            pred, old, batch["advantages"], batch["mask"], clip_low=0.2, clip_high=0.28, num_tokens=num_tokens
        )
        return out, loss, old
    loss, _ = losses.value_loss(pred, old, batch["returns"], batch["mask"], clip=0.2, num_tokens=num_tokens)
    return pred, loss, old


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b), f"names differ: {sorted(set(a) ^ set(b))}"
    return max((full(a[k]) - full(b[k])).abs().max().item() for k in a)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: full(p.grad) for n, p in model.named_parameters()}


def weights(model) -> dict[str, torch.Tensor]:
    return {n: t for bucket in parallel.full_weights(model) for n, t in bucket}


def check_tp(family: str, kind: str, tp_mesh, out: dict) -> None:
    """One forward, backward, clip and AdamW step, unsharded and sharded; record the max differences."""
    ref = build(family, kind)
    tp = parallel.parallelize(copy.deepcopy(ref), tp_mesh)
    assert any(isinstance(p, DTensor) for p in tp.parameters()), "parallelize sharded nothing"
    if family == "qwen3_moe":  # experts placed per rank, the router replicated
        ex, gate = tp.model.layers[0].mlp.experts, tp.model.layers[0].mlp.gate
        assert ex.gate_up_proj.placements == (Shard(0),) and ex.down_proj.to_local().size(0) == ex.num_experts // 2, (
            "experts not split"
        )
        assert not isinstance(gate.weight, DTensor), "the router should stay replicated"
    if getattr(ref, "lm_head", None) is not None and ref.lm_head.weight is ref.model.embed_tokens.weight:
        shared = tp.model.embed_tokens.weight
        assert tp.lm_head.weight is shared and shared.placements == (Shard(0),), "tie lost after sharding"
    batch = make_batch(ref.config.vocab_size)
    key = f"{family}/{kind}"

    ref_out, ref_loss, old = forward_loss(ref, kind, batch, None)
    tp_out, tp_loss, _ = forward_loss(tp, kind, batch, old)
    assert not isinstance(tp_out, DTensor), "the sharded model must return plain tensors"
    out[f"{key}/{'logits' if kind == 'policy' else 'values'}"] = (tp_out - ref_out).abs().max().item()
    out[f"{key}/loss"] = (tp_loss - ref_loss).abs().item()

    ref_loss.backward()
    tp_loss.backward()
    out[f"{key}/grads"] = max_diff(grads(tp), grads(ref))
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    tp_norm = parallel.clip_grad_norm_(tp.parameters(), MAX_NORM)
    assert ref_norm > MAX_NORM, f"{key}: grad norm {ref_norm:.3g} does not exceed MAX_NORM, clipping untested"
    out[f"{key}/grad_norm_rel"] = ((tp_norm - ref_norm).abs() / ref_norm).item()
    out[f"{key}/clipped_grads"] = max_diff(grads(tp), grads(ref))

    # Adam divides by sqrt(v) + eps ~ |g| + eps on its first step: with the default eps=1e-8, entries
    # with |g| ~ 1e-9 turn fp32 rounding (~1e-10) into ~1% of lr in the update. eps=1e-6 keeps the
    # comparison tight (measured: ~8e-6 with the default eps, for lr 1e-3).
    engine = EmbeddedEngine(ref) if kind == "policy" else None  # holds the weights before the step
    for model in (ref, tp):
        torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6).step()
    out[f"{key}/weights_after_step"] = max_diff(weights(tp), weights(ref))
    if engine is not None:
        # Weight sync from the TP=2 trainer: the gathered full weights make the engine's log-probs the
        # stepped model's (and no longer the old ones).
        ids = batch["input_ids"][:, :P]
        with torch.no_grad():
            new_logp = torch.log_softmax(ref(input_ids=ids).logits, -1)
        stale = (torch.log_softmax(engine.logits(ids), -1) - new_logp).abs().max().item()
        engine.update_weights(pair for bucket in parallel.full_weights(tp, bucket_bytes=1 << 16) for pair in bucket)
        out[f"{key}/engine_sync"] = (torch.log_softmax(engine.logits(ids), -1) - new_logp).abs().max().item()
        assert stale > 100 * max(out[f"{key}/engine_sync"], 1e-6), (
            f"{key}: the step did not change the engine's log-probs"
        )
    if getattr(tp, "lm_head", None) is not None and ref.config.tie_word_embeddings:
        assert tp.lm_head.weight is tp.model.embed_tokens.weight, "tie lost after the optimiser step"


def check_dp(kind: str, dp_group, rank: int, out: dict) -> None:
    """Two ranks on half batches with the global denominator and all_reduce_grads = one full batch."""
    ref = build("llama", kind)
    model = copy.deepcopy(ref)
    batch = make_batch(ref.config.vocab_size)
    _, ref_loss, old = forward_loss(ref, kind, batch, None)
    ref_loss.backward()

    half = slice(rank * B // 2, (rank + 1) * B // 2)
    mb = {k: v[half] for k, v in batch.items()}
    num_tokens = mb["mask"].sum().float()
    dist.all_reduce(num_tokens, group=dp_group)  # global denominator, as the trainer computes it
    _, loss, _ = forward_loss(model, kind, mb, old[half], num_tokens=num_tokens)
    loss.backward()
    parallel.all_reduce_grads(model, dp_group)
    out[f"dp/llama/{kind}/grads"] = max_diff(grads(model), grads(ref))


def check_dp_ev(rank: int, out: dict) -> None:
    """The critic's explained variance of two ranks' half batches reduced by runlog.Metrics (add_ev, as update_critic
    logs it) = the one-process EV of the full batch, overall and per position bucket; and the batch makes the mean of
    the ranks' own EVs (what Metrics.add would log) far from it."""
    critic = build("llama", "critic")
    batch = make_batch(critic.config.vocab_size)
    half = slice(rank * B // 2, (rank + 1) * B // 2)
    mask = batch["mask"]
    # The halves' returns sit 3 apart and the values follow them: the batch's Var(R) holds the gap, a half's does not.
    offset = 3.0 * (torch.arange(B) >= B // 2)[:, None]
    returns = batch["returns"] + offset
    with torch.no_grad():
        ref_values = forward_loss(critic, "critic", batch, None)[0] + offset
        values = forward_loss(critic, "critic", {k: v[half] for k, v in batch.items()}, None)[0] + offset[half]
    want = {
        "critic/explained_variance": losses.explained_variance(ref_values, returns, mask),
        **losses.explained_variance_by_position(ref_values, returns, mask),
    }
    m = Metrics()
    m.add_ev(
        {
            "critic/explained_variance": losses.ev_stats(values, returns[half], mask[half]),
            **losses.ev_stats_by_position(values, returns[half], mask[half], mask.size(1)),
        }
    )
    got = m.reduce()
    assert sorted(got) == sorted(want), f"EV keys differ: {sorted(got)} vs {sorted(want)}"

    def diff(k: str) -> float:  # NaN (no variance) must match NaN
        if want[k].isnan() or math.isnan(got[k]):
            return 0.0 if want[k].isnan() and math.isnan(got[k]) else math.inf
        return abs(got[k] - want[k].item())

    out["dp/llama/critic/explained_variance"] = max(diff(k) for k in want)
    rank_sum = losses.explained_variance(values, returns[half], mask[half])
    dist.all_reduce(rank_sum)
    gap = abs(rank_sum.item() / 2 - want["critic/explained_variance"].item())
    assert gap > 0.1, f"the mean of the ranks' EVs is within {gap:.3g} of the batch EV: the check would pass unfixed"


def check_dp_dtensor(dp_tp_mesh, rank: int, out: dict) -> None:
    """all_reduce_grads on DTensor gradients: a Linear sharded over the 1-rank "tp" axis of a (2, 1) mesh."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 6)
    model = parallelize_module(copy.deepcopy(ref), dp_tp_mesh["tp"], ColwiseParallel())
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    ref(x).square().sum().backward()
    model(x[rank * 2 : (rank + 1) * 2]).square().sum().backward()
    assert isinstance(model.weight.grad, DTensor)
    parallel.all_reduce_grads(model, dp_tp_mesh["dp"].get_group())
    out["dp/dtensor_linear/grads"] = max_diff(grads(model), grads(ref))


def main(out_path: str) -> None:
    torch.set_num_threads(1)
    rt = parallel.init_runtime()
    assert rt.world_size == 2, f"run with --nproc_per_node 2, got world size {rt.world_size}"
    out: dict[str, float] = {}

    tp_mesh = parallel.make_mesh(rt, tp=2)["tp"]
    for family in CONFIGS:
        for kind in ("policy", "critic"):
            check_tp(family, kind, tp_mesh, out)
    # parallelize itself refuses a model it cannot split (the single-process tests cover check_tp).
    bad = transformers.LlamaForCausalLM(tiny_config(vocab_size=300, num_hidden_layers=1, num_key_value_heads=1))
    try:
        parallel.parallelize(bad, tp_mesh)
        raise AssertionError("parallelize accepted num_key_value_heads=1 with tp=2")
    except ValueError as e:
        assert "num_key_value_heads=1" in str(e), e

    # Frozen weights stay frozen (a critic with frozen attention; Qwen3 has q_norm / k_norm there too).
    critic = build("qwen3", "critic")
    for name, p in critic.named_parameters():
        p.requires_grad_(".self_attn." not in name)
    flags = {n: p.requires_grad for n, p in critic.named_parameters()}
    after = {n: p.requires_grad for n, p in parallel.parallelize(critic, tp_mesh).named_parameters()}
    assert after == flags, f"requires_grad changed: {[n for n in flags if flags[n] != after[n]]}"

    dp_mesh = parallel.make_mesh(rt, tp=1)
    for kind in ("policy", "critic"):
        check_dp(kind, dp_mesh["dp"].get_group(), rt.rank, out)
    check_dp_ev(rt.rank, out)
    check_dp_dtensor(dp_mesh, rt.rank, out)

    # Each rank measured its own copies; report the worst of the two.
    diffs = torch.tensor(list(out.values()), dtype=torch.float64)
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    if rt.rank == 0:
        with open(out_path, "w") as f:
            json.dump(dict(zip(out, diffs.tolist())), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
