"""The critic: built from a policy, per-token values, HF save/load round trip, frozen attention."""

import pytest
import torch
from transformers import AutoModelForCausalLM, CodeGenConfig, LlamaConfig, LlamaForCausalLM

from value_model import build_critic, critic_values, freeze_attention, load_critic

CFG = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("policy")
    LlamaForCausalLM(LlamaConfig(**CFG)).save_pretrained(path)
    return str(path)


def test_build_from_path_and_model_copy_backbone(policy_dir):
    policy = AutoModelForCausalLM.from_pretrained(policy_dir)
    for critic in (build_critic(policy_dir), build_critic(policy)):
        for name, p in policy.model.state_dict().items():
            torch.testing.assert_close(critic.model.state_dict()[name], p, atol=0, rtol=0)
        assert critic.score.weight.shape == (1, CFG["hidden_size"])
        assert 0.005 < critic.score.weight.std().item() < 0.05 and torch.all(critic.score.bias == 0)


def test_values_shape_match_manual_head_and_roundtrip(policy_dir, tmp_path):
    torch.manual_seed(1)
    critic = build_critic(policy_dir).train()  # train mode: no dropout may change the values
    ids = torch.randint(0, 300, (3, 10))
    attn = torch.ones_like(ids)
    values = critic_values(critic, ids, attn)
    assert values.shape == (3, 10) and values.dtype == torch.float32
    hidden = critic.model(input_ids=ids, attention_mask=attn).last_hidden_state
    torch.testing.assert_close(values, critic.score(hidden)[..., 0])
    torch.testing.assert_close(critic_values(critic, ids, attn), values, atol=0, rtol=0)
    critic.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    torch.testing.assert_close(critic_values(load_critic(str(tmp_path)).train(), ids, attn), values, atol=1e-6, rtol=0)


def test_freeze_attention(policy_dir):
    critic = build_critic(policy_dir)
    freeze_attention(critic)
    frozen = {n for n, p in critic.named_parameters() if not p.requires_grad}
    assert frozen and all(".self_attn." in n for n in frozen)
    assert {n for n in dict(critic.named_parameters()) if ".self_attn." in n} == frozen
    assert critic.score.weight.requires_grad and critic.model.layers[0].mlp.up_proj.weight.requires_grad


def test_unsupported_architecture_is_refused():
    with pytest.raises(ValueError, match="codegen.*token-classification"):
        build_critic(AutoModelForCausalLM.from_config(CodeGenConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=50)))
