"""Qwen3-MoE: the embedded engine against the Hugging Face forward, the recorded routing, routing replay, router-flip
metrics, quantised experts, and a training run of the tiny MoE default. (TP=2 = TP=1 for an MoE policy and critic:
tests/test_parallel.py, family qwen3_moe.)"""

import copy
import os

import pytest
import torch
import transformers

import moe
from config import Config, resolve
from conftest import read_metrics, train_cli
from conftest import trainer_logp as _trainer_logp
from data.tiny import build_tokenizer, tiny_moe_config
from decoder import fake_quant_int4
from embedded_engine import EmbeddedEngine
from rollout import Sampling

NUDGE = 2e-2  # the trainer's router nudge, relative to its weights' RMS: flips ~2% of token-layer choices here


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return moe.install(
        transformers.Qwen3MoeForCausalLM(tiny_moe_config(len(build_tokenizer()), num_hidden_layers=2)).eval()
    )


def rollout_and_batch(engine, n=2):
    prompts = [[5, 7, 9, 11, 13], [5, 8], [40, 41, 42]]  # unequal lengths: left padding in the batch
    ro = engine.generate(prompts, Sampling(temperature=1.0, max_new_tokens=8, n=n, seed=3))
    return ro, ro.to_batch(pad_id=0)


def trainer_logp(model, ro, b, replay=None):
    """The trainer's recompute (temperature 1), its routers replaying `replay` ([tokens, layers, k]; None: their own)."""
    with moe.routing(model, replay):
        return _trainer_logp(model, ro)


def test_fp32_engine_equals_the_hf_forward_and_records_its_routing(model):
    engine = EmbeddedEngine(model, dtype="fp32")
    ids = torch.randint(0, 300, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (engine.logits(ids) - model(input_ids=ids).logits).abs().max() < 1e-5
    ro, b = rollout_and_batch(engine)
    lp = trainer_logp(model, ro, b)
    assert ((lp - ro.infer_logp).abs() * ro.mask).max() < 1e-5
    # The engine's record is what the HF routers pick at every routed column (prompt, and response tokens but the last).
    L, k = 2, 2
    assert ro.routing.shape == (*b.input_ids.shape, L, k)
    own = moe.chosen(model).view(*b.input_ids.shape, L, k)
    routed = (ro.routing >= 0).all(-1).all(-1)
    expect = b.attention_mask.bool().clone()  # every real column but each row's last response token (never fed back)
    for r, n_resp in enumerate(ro.mask.sum(-1).tolist()):
        expect[r, b.response_start + n_resp - 1 :] = False
    assert torch.equal(routed, expect)
    assert torch.equal(ro.routing[routed], own[routed])
    assert moe.flip_metrics(ro.routing[routed], own[routed])["moe/flip_frac"] == 0
    # shared prefixes carry the record along: one sequence per prompt, its columns permuted like the tokens
    s = b.shared(2)
    assert torch.equal(s.routing[:, : b.response_start], b.routing[::2, : b.response_start])
    S = b.input_ids.size(1)  # sequence 0 = the prompt, row 0's response columns, then row 1's
    assert torch.equal(s.routing[0, S:], b.routing[1, b.response_start :])


def test_moe_flip_knob_swaps_the_kth_expert_at_its_rate(model):
    """--moe-flip q: at the prompt columns of layer 0 (whose input no flip can reach) the engine's expert sets differ
    from the unflipped engine's on a share q of the tokens (binomial, 4 sd), by one expert each: the k-th choice swapped
    for the (k+1)-th. q = 0 is today's engine, bit for bit; refusals."""
    prompts = torch.randint(0, 300, (24, 20), generator=torch.Generator().manual_seed(1)).tolist()
    s = Sampling(temperature=1.0, max_new_tokens=4, seed=5)
    plain, zero, flip = (
        EmbeddedEngine(model, dtype="fp32", **kw).generate(prompts, s)
        for kw in ({}, {"moe_flip": 0.0}, {"moe_flip": 0.3})
    )
    assert (
        torch.equal(plain.tokens, zero.tokens)
        and torch.equal(plain.infer_logp, zero.infer_logp)
        and torch.equal(plain.routing, zero.routing)
    )
    a, b = plain.routing[:, :20, 0], flip.routing[:, :20, 0]  # [rows, prompt columns, k]
    differs = (a.sort(-1).values != b.sort(-1).values).any(-1)
    rate, sd = differs.float().mean().item(), (0.3 * 0.7 / differs.numel()) ** 0.5
    assert abs(rate - 0.3) < 4 * sd, rate
    assert (
        torch.equal(a[differs][:, 0], b[differs][:, 0]) and (a[differs][:, 1] != b[differs][:, 1]).all()
    )  # top-1 kept, k-th swapped
    assert (
        flip.routing[:, :, 1:] != plain.routing[:, :, 1:]
    ).any()  # later layers see flipped inputs (and their own flips)
    for q in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"moe_flip \(--moe-flip\) must be in \[0, 1\]"):
            EmbeddedEngine(model, moe_flip=q)
    dense = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=300,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    with pytest.raises(ValueError, match="needs an MoE model"):
        EmbeddedEngine(dense, moe_flip=0.1)
    with pytest.raises(NotImplementedError, match="prefix_cache is not implemented for MoE models"):
        EmbeddedEngine(model, prefix_cache=True)
    for kw, msg in (
        (dict(moe_flip=1.5), r"--moe-flip must be a probability in \[0, 1\]"),
        (dict(engine="sglang", moe_flip=0.1), "--moe-flip is a knob of the embedded"),
    ):
        with pytest.raises(ValueError, match=msg):
            resolve(Config(**kw), 1)


def test_router_replay_hand_case():
    router = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(
        transformers.Qwen3MoeConfig(hidden_size=2, num_experts=3, num_experts_per_tok=2, norm_topk_prob=True)
    )
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
    block = torch.nn.Module()
    block.gate, block.experts = router, torch.nn.Module()
    moe.install(block)
    h = torch.tensor([[2.0, 1.0], [0.0, 3.0]])  # logits [2, 1, 0] and [0, 3, 0]
    _, w, idx = router(h)
    assert idx.tolist() == [[0, 1], [1, 0]]  # own choice (ties at 0 go to the lower index)
    p0 = torch.softmax(torch.tensor([2.0, 1.0, 0.0]), 0)
    assert torch.allclose(w[0], torch.stack([p0[0], p0[1]]) / (p0[0] + p0[1]))
    with moe.routing(block, torch.tensor([[[2, 0]], [[-1, -1]]])):  # [tokens, layers, k]: token 0 replayed, token 1 own
        _, w, idx = router(h)
    assert idx.tolist() == [[2, 0], [1, 0]] and moe.chosen(block)[:, 0].tolist() == [[0, 1], [1, 0]]
    assert torch.allclose(
        w[0], torch.stack([p0[2], p0[0]]) / (p0[2] + p0[0])
    )  # the trainer's probabilities, renormalised
    with pytest.raises(ValueError, match="choices for 2 layers"):
        with moe.routing(block, torch.zeros(2, 2, 2, dtype=torch.long)):
            pass


def test_flip_metrics_hand_case():
    engine = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 1], [0, 1]]])  # [tokens 3, layers 2, k 2]
    trainer = torch.tensor([[[1, 0], [2, 4]], [[4, 5], [6, 7]], [[0, 2], [0, 3]]])  # same set, 1 flip | none | 2 flips
    m = moe.flip_metrics(engine, trainer)
    assert m["moe/flip_frac"] == pytest.approx(3 / 6) and m["moe/flip_any_layer_frac"] == pytest.approx(2 / 3)
    assert m["moe/flip_frac_layer0"] == pytest.approx(1 / 3) and m["moe/flip_frac_layer1"] == pytest.approx(2 / 3)


def test_routing_replay_reproduces_the_engine_when_the_trainer_routes_differently(model):
    """An fp32 engine on the model; the trainer's routers nudged (NUDGE: 2% of their RMS) so near-tied tokens pick other
    experts. Its own routing then misses the engine's log-probs on those tokens; replaying the engine's experts brings
    them back to within the nudge's effect on the gate weights."""
    engine = EmbeddedEngine(model, dtype="fp32")
    ro, b = rollout_and_batch(engine, n=4)
    trainer = copy.deepcopy(model)
    moe.install(trainer)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for blk in moe.blocks(trainer):
            blk.gate.weight.add_(
                NUDGE
                * blk.gate.weight.norm()
                / blk.gate.weight.numel() ** 0.5
                * torch.randn(blk.gate.weight.shape, generator=g)
            )
    own = trainer_logp(trainer, ro, b)
    routed = (ro.routing >= 0).all(-1).all(-1)
    flips = moe.flip_metrics(ro.routing[routed], moe.chosen(trainer).view(*ro.routing.shape)[routed])["moe/flip_frac"]
    replayed = trainer_logp(trainer, ro, b, replay=ro.routing.flatten(0, 1))
    err_own = ((own - ro.infer_logp).abs() * ro.mask).max()
    err_replay = ((replayed - ro.infer_logp).abs() * ro.mask).max()
    assert flips > 0, "the nudge flipped no router choice: the test would not test replay"
    print(f"flips {flips:.4f}, max |logp - engine| own routing {err_own:.3g}, replayed {err_replay:.3g}")
    assert err_replay < 1e-3 and err_own > 20 * err_replay, (flips, err_own, err_replay)
    # the same model on both sides: replay changes nothing
    exact = trainer_logp(model, ro, b, replay=ro.routing.flatten(0, 1))
    assert ((exact - ro.infer_logp).abs() * ro.mask).max() < 1e-5


def test_int4_engine_quantises_each_expert_and_keeps_the_router(model):
    engine = EmbeddedEngine(model, dtype="int4")
    w = model.model.layers[0].mlp.experts.gate_up_proj.detach()
    have = engine._view("model.layers.0.mlp.experts.gate_up_proj", "test").float()
    assert torch.allclose(have, torch.stack([fake_quant_int4(e) for e in w]).bfloat16().float())
    assert not torch.allclose(have, w.bfloat16().float())
    router = engine._view("model.layers.0.mlp.gate.weight", "test").float()
    assert torch.equal(router, model.model.layers[0].mlp.gate.weight.detach().bfloat16().float())


@pytest.mark.e2e
def test_tiny_moe_trains_with_routing_replay_and_logs_router_flips(tmp_path):
    """--tiny moe end to end (the default MoE model is built and warmed up on first use, a few minutes): bf16 engine,
    with and without --routing-replay, 2 steps; both log router flips per layer. (Whether replay lowers the mismatch at
    this flip rate is the lab's question, bench/lab.py moe.)"""
    rows = {}
    for replay in (False, True):
        out = tmp_path / f"replay{int(replay)}"
        proc = train_cli(
            "--tiny",
            "moe",
            "--steps",
            "2",
            "--rollout-batch",
            "16",
            "--critic-pretrain",
            "0",
            "--eval-every",
            "100",
            "--eval-size",
            "4",
            "--out-dir",
            out,
            *(["--routing-replay"] if replay else []),
            timeout=1800,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        rows[replay] = read_metrics(out)[1]  # step 1: same weights, same rollouts
    for r in rows.values():
        assert 0 <= r["moe/flip_frac"] <= r["moe/flip_any_layer_frac"] <= 1 and "moe/flip_frac_layer3" in r
    # the same rollouts (replay acts in the trainer only), and the same router flips: they compare the trainer's own choice
    for key in ("rollout/response_len_mean", "moe/flip_frac"):
        assert rows[True][key] == rows[False][key], key


def test_checkpoint_has_per_expert_names_and_loads_back(model, tmp_path):
    from safetensors import safe_open

    from checkpoint import _save_hf

    _save_hf(model, str(tmp_path / "ckpt"), rank=0)
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in names and not any(
        n.endswith("experts.gate_up_proj") for n in names
    )
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"), dtype=torch.float32)
    want = model.state_dict()
    assert back.state_dict().keys() == want.keys() and all(
        torch.equal(t, want[k]) for k, t in back.state_dict().items()
    )


def test_untie_head_keeps_the_function_and_writes_a_head(tmp_path):
    from safetensors import safe_open

    from data.tiny import build_tiny_model, untie_head

    path = build_tiny_model(str(tmp_path / "m"), arch="moe")
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = transformers.AutoModelForCausalLM.from_pretrained(path).eval()(input_ids=ids).logits
        untie_head(path)
        m = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        assert not m.config.tie_word_embeddings and m.lm_head.weight is not m.model.embed_tokens.weight
        assert torch.equal(m(input_ids=ids).logits, before)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert "lm_head.weight" in f.keys()
