"""parallel.py: TP=2 == TP=1 and dp=2 == one process under torchrun (tests/tp_worker.py), plus fast
single-process checks of the errors, the full-weight iterator and gradient clipping."""

import json

import pytest
import torch
import transformers
from safetensors import safe_open

import parallel
from conftest import torchrun
from data.tiny import tiny_config

# Max |TP=2 - TP=1| (or |dp=2 - one process|) allowed per check, fp32. Observed on 2 CPU cores
# (torch 2.13, gloo): logits <= 5e-7, values <= 2e-7, losses <= 6e-8, gradients <= 4e-7, relative grad
# norm <= 4e-7, clipped gradients <= 3e-9, weights after one AdamW step (lr 1e-3) <= 5e-7, dp gradients
# <= 1.2e-7, dp explained variance 0 (against 0.33 for the mean of the ranks' EVs). A broken plan (e.g. Qwen3's
# q_norm left out) gives gradient differences of ~6e-3.
TOLERANCES = {
    "logits": 5e-6,
    "values": 5e-6,
    "loss": 1e-6,
    "grads": 3e-6,
    "grad_norm_rel": 1e-5,
    "clipped_grads": 3e-8,
    "weights_after_step": 5e-6,
    "engine_sync": 2e-5,
}
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")  # tests/tp_worker.py's CONFIGS
TP_CHECKS = [
    f"{fam}/{kind}/{check}"
    for fam in FAMILIES
    for kind in ("policy", "critic")
    for check in (
        "logits" if kind == "policy" else "values",
        "loss",
        "grads",
        "grad_norm_rel",
        "clipped_grads",
        "weights_after_step",
    )
]
TP_CHECKS += [f"{fam}/policy/engine_sync" for fam in FAMILIES]
DP_CHECKS = [
    "dp/llama/policy/grads",
    "dp/llama/critic/grads",
    "dp/llama/critic/explained_variance",
    "dp/dtensor_linear/grads",
]


@pytest.mark.torchrun
def test_tp2_and_dp2_match_one_process(tmp_path):
    out = tmp_path / "diffs.json"
    proc = torchrun(2, "tests/tp_worker.py", out, timeout=300)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    diffs = json.loads(out.read_text())
    print("\n".join(f"{k:40s} {v:.2e}" for k, v in diffs.items()))
    assert sorted(diffs) == sorted(TP_CHECKS + DP_CHECKS)
    for key, diff in diffs.items():
        tol = 1e-6 if key.startswith("dp/") else TOLERANCES[key.rsplit("/", 1)[1]]
        assert diff <= tol, f"{key}: max abs difference {diff:.3g} > {tol:g}"


# ----------------------------------------------------------------------------- single process


def meta_model(cls=transformers.LlamaForCausalLM, **overrides):
    """A model without storage (on the meta device): enough for the size checks."""
    config = tiny_config(**{"vocab_size": 300, "num_hidden_layers": 1, **overrides})
    config.vocab_size = overrides.get("vocab_size", 300)  # unpadded: tiny_config rounds it up for TP
    with torch.device("meta"):
        return cls(config)


@pytest.mark.parametrize(
    "overrides, tp, named",
    [
        (dict(hidden_size=192, num_attention_heads=6), 4, "num_attention_heads=6"),
        (dict(), 4, "num_key_value_heads=2"),
        (dict(num_key_value_heads=4, intermediate_size=510), 4, "intermediate_size=510"),
        (dict(vocab_size=301), 2, "vocab_size=301"),
    ],
)
def test_check_tp_names_indivisible_size(overrides, tp, named):
    with pytest.raises(ValueError, match=f"{named} is not divisible by tp={tp}"):
        parallel.check_tp(meta_model(**overrides), tp)


def test_check_tp_accepts_supported_models():
    parallel.check_tp(meta_model(), 2)
    parallel.check_tp(meta_model(transformers.LlamaForTokenClassification), 2)


def test_check_tp_names_unsupported_architecture():
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0)
        )
    with pytest.raises(ValueError, match="does not cover GPT2LMHeadModel; supported: LlamaForCausalLM, "):
        parallel.check_tp(model, 2)


def test_single_process_runtime_and_mesh(monkeypatch, capsys):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    rt = parallel.init_runtime()
    assert (rt.rank, rt.world_size, rt.distributed) == (0, 1, False)
    assert parallel.make_mesh(rt, tp=1) is None
    model = meta_model()
    assert parallel.parallelize(model, None) is model
    with pytest.raises(ValueError, match="world size 3 is not divisible by tp=2"):
        parallel.make_mesh(parallel.Runtime(0, 3, 0, torch.device("cpu"), True), tp=2)
    with pytest.raises(ValueError, match="tp must be >= 1"):
        parallel.make_mesh(rt, tp=0)
    parallel.print0("shown")
    monkeypatch.setenv("RANK", "1")
    parallel.print0("hidden")
    assert capsys.readouterr().out == "shown\n"


@pytest.mark.parametrize("tied", [True, False])
def test_full_weights_plain_model_is_what_save_pretrained_writes(tmp_path, tied):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_config(vocab_size=300, num_hidden_layers=2, tie_word_embeddings=tied))
    pairs = [pair for bucket in parallel.full_weights(model) for pair in bucket]
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        saved = set(f.keys())
    assert {name for name, _ in pairs} == saved
    assert ("lm_head.weight" in saved) == (not tied)
    state = model.state_dict()
    assert [name for name, _ in pairs] == [n for n in state if n in saved]  # state_dict order
    for name, t in pairs:
        assert torch.equal(t, state[name])
        t.zero_()  # fresh copies: the consumer may overwrite or free them
    assert all(t.abs().sum() > 0 for t in model.state_dict().values())


def test_full_weights_buckets_respect_the_size():
    model = transformers.LlamaForCausalLM(tiny_config(vocab_size=300, num_hidden_layers=2))
    bucket_bytes = 200_000  # between the embedding (153,600 bytes) and an MLP matrix (262,144 bytes)
    buckets = list(parallel.full_weights(model, bucket_bytes=bucket_bytes))
    sizes = [[t.numel() * t.element_size() for _, t in b] for b in buckets]
    for i, sz in enumerate(sizes):
        assert sum(sz) <= bucket_bytes or len(sz) == 1, f"bucket {i} holds {sum(sz)} bytes in {len(sz)} tensors"
        if i + 1 < len(sizes):  # greedy: the next tensor did not fit
            assert sum(sz) + sizes[i + 1][0] > bucket_bytes
    assert any(len(sz) == 1 and sz[0] > bucket_bytes for sz in sizes)
    assert any(len(sz) > 1 for sz in sizes)


def test_clip_grad_norm_matches_torch_on_plain_tensors():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    b[1].grad = a[1].grad = None  # a parameter without a gradient is skipped
    expected = torch.nn.utils.clip_grad_norm_(a, 1.0)
    assert expected > 1.0
    torch.testing.assert_close(parallel.clip_grad_norm_(b, 1.0), expected)
    for p, q in zip(a, b):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad)
