"""EmbeddedEngine against independent references: the HF forward pass and the trainer's recompute
(logprobs.token_logprobs over hf_model(full sequence).logits). Tiny random models, CPU, seconds."""

import copy

import pytest
import torch
import transformers

import logprobs
from conftest import trainer_logp
from decoder import fake_quant_int4
from embedded_engine import EmbeddedEngine
from rollout import Rollout, Sampling

V = 300
LLAMA = dict(
    vocab_size=V,
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    max_position_embeddings=256,
)


def randomize(model: torch.nn.Module, seed: int = 0, std: float = 0.2) -> torch.nn.Module:
    """Weights far from HF's init, so a mis-mapped norm weight or bias changes the logits: matrices
    N(0, std) (std 0.2 gives peaked distributions, so top-k / top-p truncate a lot), norms 1 + N(0, 0.1),
    biases N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise if name.endswith("bias") else std * noise)
    return model.eval()


def tiny(kind: str = "llama", seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    if kind == "llama":
        config = transformers.LlamaConfig(**LLAMA, rope_theta=5000.0)
        return randomize(transformers.LlamaForCausalLM(config), seed)
    if kind == "qwen2":  # q/k/v bias, untied lm_head
        config = transformers.Qwen2Config(
            **{**LLAMA, "tie_word_embeddings": False, "num_hidden_layers": 2}, rope_theta=1e6
        )
        return randomize(transformers.Qwen2ForCausalLM(config), seed)
    if kind == "qwen3":  # q/k norm, head_dim != hidden / heads
        config = transformers.Qwen3Config(**{**LLAMA, "num_hidden_layers": 2}, head_dim=40, rope_theta=1e6)
        return randomize(transformers.Qwen3ForCausalLM(config), seed)
    raise ValueError(kind)


@pytest.fixture(scope="module")
def model():
    return tiny("llama")


@pytest.fixture(scope="module")
def engine(model):
    return EmbeddedEngine(model)


# fp32 engine vs trainer: the same math through different matmul shapes (one decode row vs the whole
# sequence), so rounding differs; with this model's O(10) logits that is up to ~2e-5 in a log-prob.
# Any real disagreement (temperature, top-k/top-p, alignment, a weight) is above 1e-2.
FP32_LOGP_ATOL = 5e-5
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3], [200, 201, 202, 203]]  # ragged: left padding is exercised


def masked_max_abs(a, b, mask):
    return ((a - b).abs() * mask).max().item()


# ---- forward pass ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_forward_matches_hf(kind):
    m = tiny(kind)
    ids = torch.randint(0, V, (3, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = m(ids).logits
    got = EmbeddedEngine(m).logits(ids)
    assert ref.abs().max() > 1  # the randomised model is far from uniform, so agreement means something
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)


def test_loads_from_a_folder(model, engine, tmp_path):
    model.save_pretrained(tmp_path)  # tied lm_head is not written
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(EmbeddedEngine(str(tmp_path)).logits(ids), engine.logits(ids))


def test_refuses_what_it_does_not_implement(model):
    scaled = transformers.LlamaConfig(**LLAMA, rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(NotImplementedError, match="rope"):
        EmbeddedEngine(transformers.LlamaForCausalLM(scaled))
    with pytest.raises(NotImplementedError, match="model_type"):
        EmbeddedEngine(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2)))
    with pytest.raises(ValueError, match="dtype"):
        EmbeddedEngine(model, dtype="fp16")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EmbeddedEngine(model, kv_cache_dtype="fp8_e4m3")


# ---- log-probs vs the trainer ------------------------------------------------------------------


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 20, 1.0), (0.7, 0, 0.9), (0.7, 20, 0.9)]
)
def test_infer_logp_equals_trainer_recompute(model, engine, temperature, top_k, top_p):
    s = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=12, n=2, seed=3)
    ro = engine.generate(PROMPTS, s)
    old_logp = trainer_logp(model, ro, s)
    assert masked_max_abs(ro.infer_logp, old_logp, ro.mask) < FP32_LOGP_ATOL
    # The processing matters: the plain temperature-1 log-prob of the same tokens is far from it.
    plain = trainer_logp(model, ro, Sampling(max_new_tokens=12))
    if (temperature, top_k, top_p) != (1.0, 0, 1.0):
        assert masked_max_abs(ro.infer_logp, plain, ro.mask) > 1e-2


def test_chunked_batches_match_trainer(model):
    # max_batch_tokens fits two prompts (n=3 rows each, 7 + 8 slots per row) at a time: several chunks.
    eng = EmbeddedEngine(model, max_batch_tokens=2 * 3 * 15)
    s = Sampling(max_new_tokens=8, n=3, seed=1)
    ro = eng.generate(PROMPTS, s)
    assert ro.tokens.shape == (12, 8) and len(ro.finish_reasons) == 12
    assert masked_max_abs(ro.infer_logp, trainer_logp(model, ro, s), ro.mask) < FP32_LOGP_ATOL


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "int4"])
def test_low_precision_shows_a_mismatch(model, engine, dtype):
    s = Sampling(max_new_tokens=12, n=2, seed=0)
    diffs = {}
    for name, eng in (("fp32", engine), (dtype, EmbeddedEngine(model, dtype=dtype))):
        ro = eng.generate(PROMPTS, s)
        d = (ro.infer_logp - trainer_logp(model, ro, s)).abs()[ro.mask]
        assert torch.isfinite(ro.infer_logp).all() and ro.infer_logp.dtype == torch.float32
        diffs[name] = d.mean().item()
    assert diffs["fp32"] < FP32_LOGP_ATOL and diffs[dtype] > 1e-3, diffs


def test_fp8_and_int4_are_coarser_than_bf16(model):
    ids = torch.randint(0, V, (2, 30), generator=torch.Generator().manual_seed(0))
    ref = EmbeddedEngine(model).logits(ids)
    err = {d: (EmbeddedEngine(model, dtype=d).logits(ids) - ref).abs().mean() for d in ("bf16", "fp8", "int4")}
    assert err["int4"] > 2 * err["fp8"] > 4 * err["bf16"] > 0, err


def mean_mismatch(model, eng, s: Sampling) -> float:
    """Mean |infer_logp - trainer's fp32 logp| over the engine's own samples."""
    ro = eng.generate(PROMPTS, s)
    return (ro.infer_logp - trainer_logp(model, ro, s)).abs()[ro.mask].mean().item()


def test_int4_mismatch_exceeds_bf16(model):
    s = Sampling(max_new_tokens=12, n=2, seed=0)
    d = {dtype: mean_mismatch(model, EmbeddedEngine(model, dtype=dtype), s) for dtype in ("bf16", "int4")}
    assert d["int4"] > 5 * d["bf16"] > 0, d  # measured 1.4 vs 0.06


def own_logits_logp(eng, ro: Rollout) -> torch.Tensor:
    """The engine's own logits() over each row's unpadded prompt + response, as log-probs aligned with ro."""
    out = torch.zeros_like(ro.infer_logp)
    for r, p in enumerate(ro.prompt_ids):
        T = int(ro.mask[r].sum())
        logits = eng.logits(torch.tensor([p + ro.tokens[r, :T].tolist()]))[:, len(p) - 1 : -1]
        out[r, :T] = logprobs.token_logprobs(logits, ro.tokens[r : r + 1, :T])[0]
    return out


def test_fp8_kv_cache_logprobs_equal_its_logits(model, engine):
    """fp32 compute, so rounding noise stays far below the fp8 KV cache's effect: generate (prefill + cached
    decode) and logits() (no cache) round k and v identically, and both differ from the fp32-KV engine."""
    eng = EmbeddedEngine(model, kv_cache_dtype="fp8")
    s = Sampling(max_new_tokens=12, n=2, seed=0)
    ro = eng.generate(PROMPTS, s)
    assert masked_max_abs(ro.infer_logp, own_logits_logp(eng, ro), ro.mask) < FP32_LOGP_ATOL  # measured 7e-6
    # The same tokens under the fp32-KV engine: a small but real difference (measured mean 0.2 on this peaky model).
    d = (ro.infer_logp - own_logits_logp(engine, ro)).abs()[ro.mask].mean().item()
    assert 1e-2 < d < 0.5, d


def test_fp8_kv_cache_is_stored_in_fp8(model):
    s = Sampling(max_new_tokens=8, n=2, seed=0)
    bf16, fp8 = EmbeddedEngine(model, dtype="bf16"), EmbeddedEngine(model, dtype="bf16", kv_cache_dtype="fp8")
    bf16.generate(PROMPTS, s)
    fp8.generate(PROMPTS, s)
    assert bf16._kv.dtype == torch.bfloat16 and fp8._kv.dtype == torch.float8_e4m3fn
    assert fp8._kv.numel() == bf16._kv.numel() and 2 * fp8._kv.nbytes == bf16._kv.nbytes
    assert 2 * fp8.sleep() == bf16.sleep() > 0


# ---- sampling behaviour ------------------------------------------------------------------------


def test_deterministic_per_seed_and_groups_contiguous(engine):
    s = Sampling(max_new_tokens=10, n=3, seed=7)
    a, b = engine.generate(PROMPTS, s), engine.generate(PROMPTS, s)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.infer_logp, b.infer_logp)
    c = engine.generate(PROMPTS, Sampling(max_new_tokens=10, n=3, seed=8))
    assert not torch.equal(a.tokens, c.tokens)
    assert a.prompt_ids == [p for p in PROMPTS for _ in range(3)]
    # The n samples of a prompt share its prefill but draw their own tokens.
    assert not torch.equal(a.tokens[0], a.tokens[1]) and not torch.equal(a.tokens[1], a.tokens[2])


def test_row_seeds_make_sampling_independent_of_the_batch_split(model, engine):
    """Row r draws from seed + r: two calls over halves of a batch (seed offset by the first row) give the
    rows of one call over all of it, also through a different chunking - what data-parallel ranks rely on."""
    s = Sampling(max_new_tokens=10, n=2, seed=11)
    whole = engine.generate(PROMPTS, s)
    first = engine.generate(PROMPTS[:2], s)
    second = EmbeddedEngine(model, max_batch_tokens=2 * 17).generate(
        PROMPTS[2:], Sampling(max_new_tokens=10, n=2, seed=11 + 4)
    )
    for part, rows in ((first, slice(0, 4)), (second, slice(4, 8))):
        T = part.tokens.size(1)
        assert torch.equal(part.tokens, whole.tokens[rows, :T]) and torch.equal(part.mask, whole.mask[rows, :T])
        torch.testing.assert_close(part.infer_logp, whole.infer_logp[rows, :T], atol=FP32_LOGP_ATOL, rtol=0)


def test_stop_tokens_and_padding(engine):
    stop = tuple(range(0, V, 7))  # about one token in seven stops a row: a mix of "stop" and "length"
    s = Sampling(max_new_tokens=10, stop_token_ids=stop, n=4, seed=0)
    ro = engine.generate(PROMPTS, s)
    assert set(ro.finish_reasons) == {"stop", "length"}
    is_stop = torch.isin(ro.tokens, torch.tensor(stop)) & ro.mask
    for r, reason in enumerate(ro.finish_reasons):
        n_tok = int(ro.mask[r].sum())
        assert ro.mask[r, :n_tok].all() and not ro.mask[r, n_tok:].any()  # a prefix
        if reason == "stop":  # the stop token is the last response token, and the only one
            assert is_stop[r, n_tok - 1] and is_stop[r].sum() == 1
        else:
            assert n_tok == s.max_new_tokens and not is_stop[r].any()
    assert (ro.tokens[~ro.mask] == 0).all() and (ro.infer_logp[~ro.mask] == 0).all()
    assert (ro.infer_logp[ro.mask] < 0).all()


def test_to_batch_layout():
    ro = Rollout(
        tokens=torch.tensor([[7, 8, 0], [9, 0, 0]]),
        infer_logp=torch.zeros(2, 3),
        mask=torch.tensor([[True, True, False], [True, False, False]]),
        prompt_ids=[[1, 2], [3, 4, 5]],
        finish_reasons=["stop", "stop"],
    )
    input_ids, attention_mask, position_ids, P, keep, group, routing = ro.to_batch(pad_id=99)
    assert (
        P == 3 and keep.tolist() == [2, 3, 4] and group == 1
    )  # the columns whose outputs predict response tokens 0, 1, 2
    assert routing is None  # a dense engine records no experts
    assert input_ids.tolist() == [[99, 1, 2, 7, 8, 99], [3, 4, 5, 9, 99, 99]]
    assert attention_mask.tolist() == [[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]]
    assert position_ids[0, 1:5].tolist() == [0, 1, 2, 3] and position_ids[1, :4].tolist() == [0, 1, 2, 3]


# ---- weights -----------------------------------------------------------------------------------


def test_weight_sync_round_trip(model):
    policy = copy.deepcopy(model)  # the trainer's model, updated in place by "training" below
    eng = EmbeddedEngine(policy)
    with torch.no_grad():
        policy.model.layers[0].self_attn.k_proj.weight.add_(0.05)
        policy.model.layers[1].mlp.up_proj.weight.mul_(1.1)
        policy.model.embed_tokens.weight.add_(0.01)
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(2))

    def logp(logits):
        return logprobs.token_logprobs(logits[:, :-1], ids[:, 1:])

    with torch.no_grad():
        old_ref, new_ref = logp(model(ids).logits), logp(policy(ids).logits)
    # The engine holds its own copy: the in-place update did not leak into it.
    assert (logp(eng.logits(ids)) - old_ref).abs().max() < FP32_LOGP_ATOL
    eng.update_weights(policy.state_dict().items())  # state_dict lists the tied lm_head too: accepted
    got = logp(eng.logits(ids))
    assert (got - new_ref).abs().max() < FP32_LOGP_ATOL and (got - old_ref).abs().max() > 1e-2
    assert eng.check_weights(policy.named_parameters()) == len(list(policy.named_parameters()))
    with pytest.raises(ValueError, match=r"'model\.embed_tokens\.weight' differs"):  # the first differing one
        eng.check_weights(model.named_parameters())
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' differs"):
        eng.check_weights((n, p) for n, p in model.named_parameters() if "layers.1" in n)


def test_update_weights_errors(engine):
    with pytest.raises(ValueError, match=r"unknown parameter 'model\.layers\.0\.mlp\.nope\.weight'"):
        engine.update_weights([("model.layers.0.mlp.nope.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match=r"model\.layers\.2\.self_attn\.q_proj\.weight.*shape"):
        engine.update_weights([("model.layers.2.self_attn.q_proj.weight", torch.zeros(128, 64))])


def test_fp8_weights_are_on_the_fp8_grid(model):
    eng = EmbeddedEngine(model, dtype="fp8")
    w = model.model.layers[0].mlp.down_proj.weight.detach()
    scale = w.abs().amax(1, keepdim=True) / torch.finfo(torch.float8_e4m3fn).max
    q = (w / scale).to(torch.float8_e4m3fn).float() * scale
    assert torch.equal(eng._view("model.layers.0.mlp.down_proj.weight", "test").float(), q.bfloat16().float())
    eng.check_weights(model.named_parameters())  # compares after the same transform
    eng.update_weights(model.named_parameters())  # re-applies it: still on the grid
    eng.check_weights(model.named_parameters())


def int4_groups(w: torch.Tensor, group_size: int = 32):
    """w [out, in] as groups [out, in / 32, 32] of consecutive input elements, and their scales absmax / 7."""
    g = w.reshape(w.size(0), -1, group_size)
    return g, g.abs().amax(-1, keepdim=True) / 7


def test_int4_error_bound_and_grid():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    w_hat = fake_quant_int4(w)
    assert w_hat.shape == w.shape and w_hat.dtype == torch.float32
    g, scale = int4_groups(w)
    g_hat = w_hat.reshape(g.shape)
    assert ((g - g_hat).abs() <= scale / 2 * (1 + 1e-6) + 1e-7).all()  # |w - w_hat| <= s / 2
    q = g_hat / scale
    assert (q - q.round()).abs().max() < 1e-4  # integer multiples of the group's scale ...
    assert q.round().min() >= -8 and q.round().max() <= 7  # ... on the int4 range
    assert max(len(row.unique()) for row in q.round().flatten(0, 1)) <= 16
    # The group's absmax element is kept, up to bf16 rounding in the engine's copy.
    at = g.abs().argmax(-1, keepdim=True)
    bf16 = fake_quant_int4(w.bfloat16()).float().reshape(g.shape)
    torch.testing.assert_close(bf16.gather(-1, at), g.gather(-1, at), rtol=2**-8, atol=0)


def test_int4_groups_are_32_consecutive_input_elements():
    # Column blocks of 32 whose magnitudes differ by 1e4: only a per-group scale along dim 1, aligned on
    # 32, keeps the small blocks accurate (a per-row scale, or groups of 64, rounds them to 0).
    magnitude = torch.tensor([1e-3, 10.0, 1e-2, 1.0]).repeat_interleave(32)
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(1)) * magnitude

    def rel(w_hat):
        return ((w - w_hat).abs() / magnitude).reshape(16, 4, 32).mean((0, 2))  # per block

    assert rel(fake_quant_int4(w)).max() < 0.15
    assert rel(fake_quant_int4(w, group_size=128))[0] > 0.5 and rel(fake_quant_int4(w, group_size=64))[0] > 0.5
    with pytest.raises(ValueError, match="not a multiple of group_size=32"):
        fake_quant_int4(torch.zeros(4, 48))


def test_int4_engine_weights_and_shape_check(model):
    eng = EmbeddedEngine(model, dtype="int4")
    w = model.model.layers[1].self_attn.o_proj.weight.detach()
    assert torch.equal(eng._view("model.layers.1.self_attn.o_proj.weight", "test"), fake_quant_int4(w).bfloat16())
    assert torch.equal(
        eng._view("model.norm.weight", "test"), model.model.norm.weight.detach().bfloat16()
    )  # not quantised
    assert torch.equal(
        eng._view("model.embed_tokens.weight", "test"), model.model.embed_tokens.weight.detach().bfloat16()
    )
    eng.update_weights(model.named_parameters())  # re-applies the transform
    eng.check_weights(model.named_parameters())
    odd = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, "intermediate_size": 100}))
    with pytest.raises(NotImplementedError, match=r"'model\.layers\.0\.mlp\.down_proj\.weight' has shape \(128, 100\)"):
        EmbeddedEngine(odd, dtype="int4")
    EmbeddedEngine(odd, dtype="fp8")  # only int4 needs the groups


def test_sglang_engine_maps_or_refuses_the_knobs():
    """SGLangEngine's side of the knobs, checked before SGLang is imported (runs without it)."""
    from sglang_engine import SGLangEngine, sglang_kv_cache_dtype

    assert sglang_kv_cache_dtype("fp8", "cuda", None) == "fp8_e4m3"
    assert sglang_kv_cache_dtype("auto", "cpu", "torch_native") == "auto"
    with pytest.raises(ValueError, match="needs Intel AMX and attention_backend='intel_amx'"):
        sglang_kv_cache_dtype("fp8", "cpu", "torch_native")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        sglang_kv_cache_dtype("fp8_e4m3", "cuda", None)
    with pytest.raises(ValueError, match="no torchao_config option"):
        SGLangEngine("no/such/folder", dtype="int4")


# ---- memory ------------------------------------------------------------------------------------


def test_sleep_wake_cycles(model):
    eng = EmbeddedEngine(model)
    s = Sampling(max_new_tokens=8, n=2, seed=5)
    first = eng.generate(PROMPTS, s)
    released = eng.sleep()
    assert released > 0 and eng.sleep() == 0  # the KV cache; a second sleep frees nothing
    with pytest.raises(RuntimeError, match="asleep"):
        eng.generate(PROMPTS, s)
    eng.wake()
    again = eng.generate(PROMPTS, s)
    assert torch.equal(first.tokens, again.tokens) and torch.equal(first.infer_logp, again.infer_logp)
    eng.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate(PROMPTS, s)


# ---- CUDA (bench/gpu_check.py runs these on a lent GPU) ----------------------------------------
# fp32 on CUDA: the engine's decode against the trainer's full-sequence forward, both on the GPU (TF32 off, torch's
# default for matmuls), so only the reduction order differs, as on CPU; the same bound, twice as wide for the kernels.
CUDA_FP32_LOGP_ATOL = 2 * FP32_LOGP_ATOL


@pytest.mark.gpu
def test_cuda_fp32_logprobs_equal_trainer_recompute(model):
    gpu = copy.deepcopy(model).cuda()
    s = Sampling(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=12, n=2, seed=3)
    ro = EmbeddedEngine(gpu, device="cuda").generate(PROMPTS, s)
    assert ro.infer_logp.device.type == "cpu"  # a Rollout lives on CPU whatever the engine's device
    assert masked_max_abs(ro.infer_logp, trainer_logp(gpu, ro, s), ro.mask) < CUDA_FP32_LOGP_ATOL


@pytest.mark.gpu
def test_cuda_bf16_mismatch_is_the_cpu_bf16_engines(model):
    """bf16 on CUDA shows a mismatch against the fp32 trainer (it is bf16), of the size the CPU's bf16 engine shows on
    the same tokens (teacher-forced through its logits): within 2x, so a CUDA kernel that drifts further fails."""
    gpu = copy.deepcopy(model).cuda()
    s = Sampling(max_new_tokens=12, n=2, seed=0)
    ro = EmbeddedEngine(gpu, dtype="bf16", device="cuda").generate(PROMPTS, s)
    ref = trainer_logp(gpu, ro, s)
    cuda = (ro.infer_logp - ref).abs()[ro.mask].mean().item()
    cpu = (own_logits_logp(EmbeddedEngine(model, dtype="bf16"), ro) - ref).abs()[ro.mask].mean().item()
    assert 1e-4 < cuda < 2 * cpu, (cuda, cpu)


@pytest.mark.gpu
def test_cuda_sleep_wake_then_weight_sync(model):
    """train_ppo's cycle on a GPU: sleep (weights to CPU, cache freed), wake, push the trained weights: the engine
    then serves the new policy, and sleep released at least the bf16 weights."""
    policy = copy.deepcopy(model).cuda()
    eng = EmbeddedEngine(policy, dtype="bf16", device="cuda")
    s = Sampling(max_new_tokens=8, n=2, seed=5)
    first = eng.generate(PROMPTS, s)
    assert eng.sleep() >= 2 * sum(p.numel() for p in model.parameters())  # the bf16 weights and the cache
    eng.wake()
    assert torch.equal(first.tokens, eng.generate(PROMPTS, s).tokens)
    with torch.no_grad():
        policy.model.layers[0].mlp.up_proj.weight.mul_(1.1)
    eng.sleep()
    eng.wake()
    eng.update_weights(policy.state_dict().items())
    assert eng.check_weights(policy.named_parameters()) == len(list(policy.named_parameters()))


# ---- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=0.0), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(n=0), "n must"),
        (dict(stop_token_ids=(-1,)), "stop_token_ids"),
    ],
)
def test_bad_sampling(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Sampling(**kwargs)


@pytest.mark.parametrize(
    "prompts,sampling,match",
    [
        ([], Sampling(), "non-empty list"),
        ([[1, 2], []], Sampling(), "prompt 1 is empty"),
        ([[1] * 230], Sampling(max_new_tokens=32), "prompt 0 has 230 tokens.*at most 224"),
        ([[1, V]], Sampling(), "outside"),
        ([[1, -1]], Sampling(), "outside"),
        ([[1, 2]], Sampling(stop_token_ids=(V,)), "stop_token_ids"),
    ],
)
def test_bad_prompts(engine, prompts, sampling, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, sampling)


def test_batch_budget_too_small(model):
    with pytest.raises(ValueError, match="max_batch_tokens"):
        EmbeddedEngine(model, max_batch_tokens=20).generate([[1, 2, 3]], Sampling(max_new_tokens=8, n=2))


def test_seed_reaches_the_sglang_engine(monkeypatch):
    """--seed seeds SGLang's sampling stream (random_seed), on CPU and on a GPU rank alike. Needs no sglang: the
    engine class is replaced by a recorder."""
    import sglang_engine
    from config import Config
    from build import make_engine

    seen = []
    monkeypatch.setattr(sglang_engine, "SGLangEngine", lambda path, **kw: seen.append(kw))
    for device in (torch.device("cpu"), torch.device("cuda", 1)):
        make_engine(Config(engine="sglang", seed=7), "path", device)
    assert [kw["random_seed"] for kw in seen] == [7, 7]
    assert seen[1]["base_gpu_id"] == 1
