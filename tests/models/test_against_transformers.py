"""The embedded default model and a random Qwen3-style HF directory, checked
against transformers on the same weights: greedy tokens and log-probs."""
from __future__ import annotations

import json

import pytest
import torch

from trellm import LLM, SamplingParams

GEN = 40
RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 5, 8, 13,",
    "Les fleurs du jardin sont",
    "Q: What is the boiling point of water in Celsius?\nA:",
]
CHATS = [
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three primary colours."}],
    [{"role": "user", "content": "What is 17 times 3?"},
     {"role": "assistant", "content": "17 times 3 is 51."},
     {"role": "user", "content": "And 51 divided by 3?"}],
]
NEAR_TIE = 1e-3
LOGPROB_TOL = 1e-3


def check_against_reference(hf, prompt_ids: list[int], out_ids: list[int], out_lps) -> int:
    """Teacher-force our continuation through transformers; returns the number of
    near-tie positions where the greedy choices differed."""
    ids = torch.tensor([prompt_ids + out_ids])
    with torch.inference_mode():
        logits = hf(ids).logits[0].float()
    lps = torch.log_softmax(logits, dim=-1)
    ties = 0
    for i, tok in enumerate(out_ids):
        row = lps[len(prompt_ids) - 1 + i]
        ref_tok = int(row.argmax())
        if ref_tok != tok:
            top2 = row.topk(2).values
            assert float(top2[0] - top2[1]) < NEAR_TIE, (
                f"position {i}: we chose {tok}, transformers {ref_tok} "
                f"(gap {float(top2[0] - top2[1]):.2e} is not a near-tie)")
            ties += 1
        assert abs(out_lps[i].logprob - float(row[tok])) < LOGPROB_TOL, (
            f"position {i}: logprob {out_lps[i].logprob} vs transformers {float(row[tok])}")
    return ties


@pytest.fixture(scope="module")
def pair(default_gguf):
    from trellm.bench.hf_peer import load_transformers_peer

    llm = LLM(default_gguf, dtype="float32", device="cpu", quantization="none")
    hf = load_transformers_peer(default_gguf, torch.float32)
    return llm, hf


def test_greedy_matches_transformers_raw_and_chat(pair):
    llm, hf = pair
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode(p)} for p in RAW_PROMPTS]
    prompts += [{"prompt_token_ids": tok.encode(tok.apply_chat_template(c), add_special_tokens=False)}
                for c in CHATS]
    params = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params)
    ties = 0
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        assert len(c.token_ids) == GEN
        ties += check_against_reference(hf, p["prompt_token_ids"], c.token_ids, c.logprobs)
    assert ties <= 2, f"{ties} near-tie divergences"
    llm.engine.check_invariants()


def test_chat_api_matches_manual_template(pair):
    llm, _ = pair
    params = SamplingParams(temperature=0.0, max_tokens=16)
    via_chat = llm.chat(CHATS[0], params)[0].outputs[0].text
    tok = llm.get_tokenizer()
    ids = tok.encode(tok.apply_chat_template(CHATS[0]), add_special_tokens=False)
    manual = llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].text
    assert via_chat == manual and via_chat.strip()


@pytest.mark.parametrize("chunked", [False, True])
def test_prompt_logprobs_match_transformers(pair, default_gguf, chunked):
    llm, hf = pair
    if chunked:  # the prompt spans several steps: each prompt position reported exactly once
        llm = LLM(default_gguf, dtype="float32", device="cpu", quantization="none",
                  max_num_batched_tokens=5, kv_cache_memory=64 << 20)
    tok = llm.get_tokenizer()
    ids = tok.encode(RAW_PROMPTS[2] + " " + RAW_PROMPTS[0])
    assert len(ids) > 10
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    for i in range(1, len(ids)):
        entry = out.prompt_logprobs[i]
        assert entry.token_id == ids[i]
        assert abs(entry.logprob - float(ref[i - 1, ids[i]])) < LOGPROB_TOL
        assert len(entry.top) == 2 and entry.top[0][0] == int(ref[i - 1].argmax())


def _write_random_qwen3(tmp_path) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trellm.model.config import ArchConfig
    from trellm.model.llama import dummy_weights

    cfg = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=1024, tie_word_embeddings=False, rope_theta=10000.0)
    model = Qwen3ForCausalLM(cfg)
    arch = ArchConfig.from_hf(json.loads(cfg.to_json_string()) | {"architectures": ["Qwen3ForCausalLM"]})
    model.load_state_dict(dict(dummy_weights(arch, seed=7)), strict=True)
    model.save_pretrained(tmp_path, max_shard_size="500KB")
    return str(tmp_path), model.eval()


def test_random_qwen3_hf_directory(tmp_path):
    path, hf = _write_random_qwen3(tmp_path)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1  # the parallel shard reader is exercised
    llm = LLM(path, dtype="float32", device="cpu", quantization="none")
    g = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(0, 512, (n,), generator=g).tolist()} for n in (5, 17, 40)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0))
    ties = sum(check_against_reference(hf, p["prompt_token_ids"], o.outputs[0].token_ids, o.outputs[0].logprobs)
               for p, o in zip(prompts, outs))
    assert ties <= 1
