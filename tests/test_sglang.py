"""The SGLang engine (real sglang, CPU mode) against the trainer: log-probs, stopping, weight sync, sleep.

    bash scripts/install_sglang_cpu.sh
    .venv-sglang/bin/python -m pytest -q tests/test_sglang.py -s      # -s prints the measured figures

One engine serves the whole module (SGLang takes 10-40 s to start here). The torchrun test starts a
second one: `torchrun --nproc_per_node 2 tests/test_sglang.py MODEL_DIR` runs this file's __main__,
a colocated job with the engine on rank 0 and a trainer copy on every rank.
"""

import sys
import time

import pytest
import torch
import torch.distributed as dist
import transformers

from conftest import torchrun, trainer_logp
from data.tiny import build_tiny_model, untie_head
from rollout import Sampling

# Without sglang these are skipped, or failed under `make test` (ICEPOP_REQUIRE_EXTRAS=1): conftest.pytest_runtest_setup.
pytestmark = pytest.mark.sglang

PROMPTS = [[257, 10, 20, 30], [257, 40], [257, 50, 60, 70, 80, 90], [257, 99, 98]]
SHARPEN = 6.0  # scales the final norm: a random init is near-uniform over the vocabulary, this makes it peaky
FP32_ATOL = 1e-4  # engine vs trainer log-prob in fp32 (two implementations of one model; measured < 1e-5)


def build_model(out_dir: str) -> str:
    """The tiny random Llama with sharpened logits and, as EOS, the token it samples most often
    (so EOS really gets sampled and the stopping tests can fail)."""
    build_tiny_model(out_dir, seed=0)
    model = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(SHARPEN)
        torch.manual_seed(0)
        samples = [
            model.generate(
                torch.tensor([p]),
                do_sample=True,
                top_k=0,
                max_new_tokens=12,
                num_return_sequences=4,
                eos_token_id=None,
                pad_token_id=0,
            )[:, len(p) :]
            for p in PROMPTS
        ]
    eos = int(torch.cat([x.flatten() for x in samples]).mode().values)
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    model.save_pretrained(out_dir)
    return out_dir


def max_diff(a, b, mask) -> float:
    return (a - b).abs()[mask].max().item()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(str(tmp_path_factory.mktemp("sglang_model")))


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(model_dir):
    from sglang_engine import SGLangEngine

    t0 = time.time()
    eng = SGLangEngine(model_dir, dtype="fp32", max_total_tokens=4096)
    print(f"\n[sglang] engine start {time.time() - t0:.1f} s")
    yield eng
    eng.shutdown()


def test_precision_knobs(model_dir, hf_model):
    """int4 is refused; the fp8 KV cache is refused on CPU (torch_native has none) and runs as SGLang's
    fp8_e4m3 on CUDA. Placed before the tests that start the module's engine, so on a GPU this one's
    engine does not share the memory with it."""
    from sglang_engine import SGLangEngine

    with pytest.raises(ValueError, match="int4wo-32"):
        SGLangEngine(model_dir, dtype="int4")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="intel_amx"):
            SGLangEngine(model_dir, kv_cache_dtype="fp8")
        return
    eng = SGLangEngine(model_dir, dtype="bf16", kv_cache_dtype="fp8", max_total_tokens=4096, mem_fraction_static=0.3)
    try:
        s = Sampling(max_new_tokens=16, n=4)
        ro = eng.generate(PROMPTS, s)
        check_rollout(ro, PROMPTS, s, set())
        d = (ro.infer_logp - trainer_logp(hf_model, ro, s)).abs()[ro.mask]
        print(f"\n[sglang] bf16 + fp8 KV vs the fp32 trainer: mean |diff| {d.mean():.2e}, max {d.max():.2e}")
        assert torch.isfinite(ro.infer_logp).all() and 0 < d.mean() < 0.5
    finally:
        eng.shutdown()


def check_rollout(ro, prompts, s: Sampling, stop: set[int]):
    B = len(prompts) * s.n
    assert ro.tokens.shape == ro.infer_logp.shape == ro.mask.shape and ro.tokens.shape[0] == B
    assert ro.tokens.dtype == torch.long and ro.infer_logp.dtype == torch.float32 and ro.mask.dtype == torch.bool
    assert ro.prompt_ids == [p for p in prompts for _ in range(s.n)]  # the n rows of a prompt are contiguous
    lengths = ro.mask.sum(1)
    assert torch.equal(ro.mask, torch.arange(ro.tokens.shape[1]) < lengths[:, None])  # right-padded
    assert torch.all(ro.tokens[~ro.mask] == 0) and torch.all(ro.infer_logp[~ro.mask] == 0)
    assert torch.all(ro.infer_logp[ro.mask] <= 0)
    for r in range(B):
        row = ro.tokens[r, : lengths[r]].tolist()
        assert not stop & set(row[:-1]), f"row {r} ran past a stop token: {row}"
        if ro.finish_reasons[r] == "stop":
            assert row[-1] in stop
        else:
            assert ro.finish_reasons[r] == "length" and len(row) == s.max_new_tokens and row[-1] not in stop


def test_moe_logprobs_and_weight_sync(tmp_path):
    """The tiny Qwen3-MoE (head untied) in SGLang's CPU mode: fp32 log-probs equal the HF forward, and after
    update_weights from the trainer's fused expert tensors (sent per expert, the checkpoint's names) they equal the
    changed model's. Own engine, started before the module's (on a GPU the two do not share memory)."""
    from sglang_engine import SGLangEngine

    model_dir = build_tiny_model(str(tmp_path / "moe"), seed=0, arch="moe")
    untie_head(model_dir)  # as default_model saves it: SGLang's Qwen3-MoE has no tied head
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    s = Sampling(temperature=1.0, max_new_tokens=8, n=2, seed=0)
    eng = SGLangEngine(model_dir, dtype="fp32", max_total_tokens=4096)
    try:
        ro = eng.generate(PROMPTS, s)
        assert max_diff(trainer_logp(model, ro, s), ro.infer_logp, ro.mask) < FP32_ATOL
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        stale = max_diff(trainer_logp(model, ro, s), ro.infer_logp, ro.mask)
        eng.update_weights(model.named_parameters())
        ro = eng.generate(PROMPTS, s)
        synced = max_diff(trainer_logp(model, ro, s), ro.infer_logp, ro.mask)
        print(f"\n[sglang moe] fp32 log-prob diff after sync {synced:.2e} (before it {stale:.2e})")
        assert synced < FP32_ATOL < stale
    finally:
        eng.shutdown()


def test_generate_shapes_stop_tokens_and_eos(engine, hf_model):
    eos = hf_model.config.eos_token_id
    # EOS in the stop set: SGLang stops natively.
    s = Sampling(max_new_tokens=12, n=3, stop_token_ids=(eos,))
    ro = engine.generate(PROMPTS, s)
    check_rollout(ro, PROMPTS, s, {eos})
    assert "stop" in ro.finish_reasons
    # No stop token: every row runs to max_new_tokens although SGLang would stop at the model's EOS.
    s = Sampling(max_new_tokens=12, n=3)
    ro = engine.generate(PROMPTS, s)
    check_rollout(ro, PROMPTS, s, set())
    assert set(ro.finish_reasons) == {"length"} and (ro.tokens == eos).any(), "EOS was never sampled: weak test"
    # A stop set without EOS: cut at the stop tokens, EOS passes through.
    stop = set(range(1, hf_model.config.vocab_size, 3)) - {eos}
    s = Sampling(max_new_tokens=12, n=2, stop_token_ids=tuple(sorted(stop)))
    ro = engine.generate(PROMPTS, s)
    check_rollout(ro, PROMPTS, s, stop)
    assert "stop" in ro.finish_reasons


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 5, 1.0), (1.0, 0, 0.8), (1.0, 1, 1.0)]
)
def test_logprobs_match_trainer(engine, hf_model, temperature, top_k, top_p):
    s = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=16, n=4)
    ro = engine.generate(PROMPTS, s)
    ref = trainer_logp(hf_model, ro, s)
    d = max_diff(ro.infer_logp, ref, ro.mask)
    print(f"\n[sglang] fp32 |infer_logp - trainer logp| max {d:.2e} at T={temperature} top_k={top_k} top_p={top_p}")
    assert d < FP32_ATOL
    if top_k > 1 or top_p < 1.0:
        # SGLang's default log-prob ignores the filter; this one must not (else the test above is vacuous).
        unfiltered = trainer_logp(hf_model, ro, Sampling(temperature=temperature))
        assert max_diff(ro.infer_logp, unfiltered, ro.mask) > 1e-2


def test_refused_configurations_and_bad_input(engine, hf_model):
    V = hf_model.config.vocab_size
    with pytest.raises(NotImplementedError, match="top_k and top_p together"):
        engine.generate(PROMPTS, Sampling(top_k=5, top_p=0.9))
    with pytest.raises(ValueError, match="greedy"):
        engine.generate(PROMPTS, Sampling(temperature=1e-8))
    with pytest.raises(ValueError, match="non-empty list"):
        engine.generate([], Sampling())
    with pytest.raises(ValueError, match="prompt 1"):
        engine.generate([[1, 2], []], Sampling())
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[1, V]], Sampling())
    with pytest.raises(ValueError, match="context"):
        engine.generate([[1] * 250], Sampling(max_new_tokens=10))
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.generate(PROMPTS, Sampling(stop_token_ids=(V,)))
    with pytest.raises(TypeError, match="Sampling"):
        engine.generate(PROMPTS, {"temperature": 1.0})
    with pytest.raises(KeyError, match="model.layers.0.nope"):
        engine.update_weights([("model.layers.0.nope", torch.zeros(3))])
    with pytest.raises(ValueError, match="model.norm.weight"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])
    engine.generate(PROMPTS[:1], Sampling(max_new_tokens=2))  # still healthy after the refusals


def test_weight_sync_round_trip(engine, hf_model, monkeypatch):
    new = transformers.AutoModelForCausalLM.from_config(hf_model.config, dtype=torch.float32).eval()
    new.load_state_dict(hf_model.state_dict())
    torch.manual_seed(1)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.02 * torch.randn_like(p))
    s = Sampling(temperature=0.7, max_new_tokens=16, n=2)
    sent = []  # the flush flag of every bucket sent
    send = engine._send
    monkeypatch.setattr(
        engine, "_send", lambda bucket, flush_cache: (sent.append(flush_cache), send(bucket, flush_cache))
    )
    monkeypatch.setattr(engine, "bucket_bytes", 1 << 17)  # 128 KiB: several buckets for this 4 MiB model
    try:
        t0 = time.time()
        engine.update_weights(new.named_parameters())
        print(f"\n[sglang] update_weights {time.time() - t0:.3f} s in {len(sent)} buckets")
        assert len(sent) > 2 and sent == [False] * (len(sent) - 1) + [True]  # the last bucket flushes the cache
        engine.check_weights(new.state_dict().items())  # exact: fp32 in, fp32 held
        with pytest.raises(ValueError, match="model.embed_tokens.weight"):  # the first parameter differs
            engine.check_weights(hf_model.state_dict().items())
        ro = engine.generate(PROMPTS, s)
        assert max_diff(ro.infer_logp, trainer_logp(new, ro, s), ro.mask) < FP32_ATOL
        assert max_diff(ro.infer_logp, trainer_logp(hf_model, ro, s), ro.mask) > 1e-2
    finally:
        engine.update_weights(hf_model.named_parameters())  # the module's engine serves other tests
    engine.check_weights(hf_model.state_dict().items())
    ro = engine.generate(PROMPTS, s)
    assert max_diff(ro.infer_logp, trainer_logp(hf_model, ro, s), ro.mask) < FP32_ATOL


def test_sleep_wake_cycles(engine, hf_model):
    s = Sampling(temperature=0.7, max_new_tokens=8, n=2)
    for cycle in range(2):
        before = engine.memory_in_use()
        released = engine.sleep()
        print(
            f"\n[sglang] sleep {cycle}: in use {before / 2**20:.0f} MiB, released {released / 2**20:.1f} MiB "
            f"({engine.device}; SGLang frees nothing on CPU)"
        )
        with pytest.raises(RuntimeError, match="asleep"):
            engine.generate(PROMPTS, s)
        with pytest.raises(RuntimeError, match="asleep"):
            engine.update_weights(hf_model.named_parameters())
        engine.wake()
        ro = engine.generate(PROMPTS, s)
        assert max_diff(ro.infer_logp, trainer_logp(hf_model, ro, s), ro.mask) < FP32_ATOL


class _Turns:
    """Any text is a turn; reward 1 on the third, which ends the episode."""

    def reset(self, row):
        self.t = 0
        return row["prompt"]

    def step(self, text):
        self.t += 1
        return (None, 1.0, True) if self.t == 3 else ("more", 0.0, False)


def test_multi_turn_episodes(engine, hf_model):
    """agent.run_episodes on SGLang (token-in/token-out, one call per turn): the trainer's recompute over to_batch,
    observations attended, equals SGLang's log-probs on every model token. (That a batch split over calls gives the
    same episodes is checked on the embedded engine: SGLang on CPU ignores per-row seeds.) The test model's EOS is not the template's <|im_end|>,
    so the rows are not well-formed ChatML; the token bookkeeping is what is checked."""
    import agent
    import chat
    from data.tiny import build_tokenizer

    tok = build_tokenizer()
    rows = [{"prompt": p} for p in ("abc", "hello there", "x")]
    # The random model rarely samples its EOS after a chat header: its 4 most frequent tokens there end a turn.
    probe = engine.generate(
        [chat.first_prompt_ids(tok, "abc")], Sampling(max_new_tokens=16, n=8, seed=1)
    ).tokens.flatten()
    s = Sampling(max_new_tokens=8, n=2, seed=9, stop_token_ids=tuple(probe.bincount().topk(4).indices.tolist()))
    ep = agent.run_episodes(engine, tok, _Turns, rows, s, max_turns=4, context_len=256)
    ro = ep.rollout
    assert max(ep.turns) >= 2 and (ro.attend & ~ro.mask).any()
    assert max_diff(ro.infer_logp, trainer_logp(hf_model, ro, s), ro.mask) < FP32_ATOL
    assert ep.rollout.prompt_ids[0] == chat.first_prompt_ids(tok, "abc")


def test_tool_episodes(tool_caller_dir):
    """--task calc's tool environment on SGLang (fp32) with a tiny model that calls the calculator (tool_caller_dir):
    the trainer's recompute equals SGLang's log-probs on every model token, tool tokens attended in between."""
    import agent
    import tools
    from data.tasks import calc_task
    from sglang_engine import SGLangEngine

    tok = transformers.AutoTokenizer.from_pretrained(tool_caller_dir)
    task = calc_task()
    env = tools.tool_env(task.env, max_turns=task.max_turns, task=task)
    s = Sampling(max_new_tokens=task.max_new_tokens, n=2, seed=5, stop_token_ids=tools.stop_ids(tok, env))
    eng = SGLangEngine(tool_caller_dir, dtype="fp32", max_total_tokens=8192)
    try:
        ep = agent.run_episodes(eng, tok, env, task.test.to_list()[:24], s, max_turns=task.max_turns, context_len=256)
    finally:
        eng.shutdown()
    ro = ep.rollout
    assert sum(st["calls"] > 0 for st in ep.tool_stats) >= 24 and (ro.attend & ~ro.mask).any()
    model = transformers.AutoModelForCausalLM.from_pretrained(tool_caller_dir, dtype=torch.float32)
    assert max_diff(ro.infer_logp, trainer_logp(model, ro, s, tok.pad_token_id), ro.mask) < FP32_ATOL


@pytest.mark.torchrun
def test_torchrun_colocated(model_dir):
    """2 ranks (gloo): engine on rank 0, a trainer copy on each rank; rollouts scattered, weights synced."""
    res = torchrun(2, __file__, model_dir)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    line = [x for x in res.stdout.splitlines() if x.startswith("[sglang torchrun]")]
    print("\n" + "\n".join(line))
    assert len(line) == 1 and "ok" in line[0]


def colocated_main(model_dir: str) -> None:
    """Each rank: a trainer copy of the policy. Rank 0: the SGLang engine (one engine for the job, like one
    SGLang server per node; per-rank engines would each need a scheduler process). Rank 0 generates for
    every rank's prompts and scatters the rollouts; every rank recomputes log-probs; after a (simulated,
    all-reduced) optimiser step rank 0 pushes the new weights and the check repeats."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = None
    if rank == 0:
        from sglang_engine import SGLangEngine

        engine = SGLangEngine(model_dir, dtype="fp32", max_total_tokens=2048)
    s = Sampling(temperature=0.7, max_new_tokens=8, n=2)
    my_prompts = PROMPTS[rank::world]
    diffs = []
    for step in range(2):
        everyone = [None] * world
        dist.all_gather_object(everyone, my_prompts)
        shards = [None] * world
        if rank == 0:
            ro = engine.generate([p for ps in everyone for p in ps], s)
            sizes = [len(ps) * s.n for ps in everyone]
            starts = [sum(sizes[:i]) for i in range(world)]
            shards = [_rows(ro, a, a + n) for a, n in zip(starts, sizes)]
            engine.sleep()  # what the trainer would do before its step
        mine = [None]
        dist.scatter_object_list(mine, shards, src=0)
        ro = mine[0]
        diffs.append(max_diff(ro.infer_logp, trainer_logp(model, ro, s), ro.mask))
        # The "optimiser step": the same seeded change on every rank, averaged like DDP gradients.
        torch.manual_seed(100 + step)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
                dist.all_reduce(p, op=dist.ReduceOp.AVG)
        if rank == 0:
            engine.wake()
            engine.update_weights(model.named_parameters())
            engine.check_weights(model.state_dict().items())
    worst = torch.tensor(max(diffs))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        engine.shutdown()
        verdict = "ok" if worst.item() < FP32_ATOL else "FAILED"
        print(
            f"[sglang torchrun] {verdict}: {world} ranks, 2 rollout + sync steps, max |infer - trainer| {worst.item():.2e}"
        )
    dist.barrier()
    dist.destroy_process_group()


def _rows(ro, a: int, b: int):
    """Rows a:b of a Rollout (a plain object, so it pickles through gloo)."""
    return type(ro)(
        tokens=ro.tokens[a:b],
        infer_logp=ro.infer_logp[a:b],
        mask=ro.mask[a:b],
        prompt_ids=ro.prompt_ids[a:b],
        finish_reasons=ro.finish_reasons[a:b],
    )


if __name__ == "__main__":  # the torchrun worker of test_torchrun_colocated
    colocated_main(sys.argv[1])
