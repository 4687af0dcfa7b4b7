"""bench/bench_train.py: its FLOP count (the MFU column) on a hand-computed case, the per-algorithm variants and
the matmul microbenchmark at a model's shapes."""

import importlib.util
import os

from transformers import LlamaConfig

from conftest import REPO

spec = importlib.util.spec_from_file_location("bench_train", os.path.join(REPO, "bench", "bench_train.py"))
bench_train = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_train)


def test_train_flops_hand_case(tmp_path):
    LlamaConfig(
        vocab_size=320,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ).save_pretrained(tmp_path)
    # a layer: q, o 128 x 128; k, v 128 x 64; gate, up, down 128 x 512; two RMSNorms of 128; plus the final norm
    n = 4 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 512 + 2 * 128) + 128
    cfg = {"model_path": str(tmp_path), "algo": "ppo", "ppo_epochs": 1, "critic_updates": 2, "kl": "none"}
    # policy: recompute forward + forward/backward (1 + 3); critic: recompute + 2 updates (1 + 6); LM head at 100 response tokens
    assert bench_train.train_flops(cfg, 1000, 100) == 2 * n * 1000 * (4 + 7) + 2 * 128 * 320 * 100 * 4
    grpo = {**cfg, "algo": "grpo", "kl": "k3-loss"}  # no critic; the reference forward counts
    assert bench_train.train_flops(grpo, 1000, 100) == 2 * n * 1000 * 5 + 2 * 128 * 320 * 100 * 5


def test_train_flops_counts_the_routed_experts_only(tmp_path):
    from data.tiny import tiny_moe_config

    tiny_moe_config(320, num_hidden_layers=2).save_pretrained(tmp_path)
    # a layer: attention as above, q/k RMSNorms of 32, the router 8 x 128, 2 of the 8 experts of 3 x 128 x 256, two norms
    n = 2 * (2 * 128 * 128 + 2 * 128 * 64 + 2 * 32 + 8 * 128 + 2 / 8 * 8 * 3 * 128 * 256 + 2 * 128) + 128
    cfg = {"model_path": str(tmp_path), "algo": "grpo", "ppo_epochs": 1, "critic_updates": 2, "kl": "none"}
    assert bench_train.train_flops(cfg, 1000, 100) == 2 * n * 1000 * 4 + 2 * 128 * 320 * 100 * 4


def test_variants_of_keeps_the_unprefixed_and_this_algorithms_own():
    variants = ["", "--engine-dtype fp32", "ppo:--critic-updates 1", "grpo: --no-shared-prefix", "--reward x:y"]
    assert bench_train.variants_of("ppo", variants) == ["", "--engine-dtype fp32", "--critic-updates 1", "--reward x:y"]
    assert bench_train.variants_of("grpo", variants) == [
        "",
        "--engine-dtype fp32",
        "--no-shared-prefix",
        "--reward x:y",
    ]


def test_machine_gflops_runs_the_model_shapes(tmp_path):
    LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2).save_pretrained(
        tmp_path
    )
    for dtype in ("fp32", "bf16"):
        assert bench_train.machine_gflops(str(tmp_path), 32, dtype, seconds=0.01) > 0
