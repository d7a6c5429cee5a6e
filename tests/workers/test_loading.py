"""Loading: config.json validation, model path resolution, safetensors (single and sharded),
tokenizer.json, EOS ids and incremental decoding."""
from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from thinkserve.workers.loader import load_weights, resolve_model_path
from thinkserve.workers.model_config import ModelConfig, ModelConfigError
from thinkserve.workers.tokenizer import Tokenizer, find_stop

BASE = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "eos_token_id": 2,
}


def test_config_reads_old_and_new_rope_layouts():
    old = ModelConfig.from_dict({**BASE, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert old.rope_theta == 10000.0 and old.rope_scaling.rope_type == "linear" and old.rope_scaling.factor == 2.0
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    new = ModelConfig.from_dict({**BASE, "rope_parameters": rope})
    assert new.rope_theta == 5e5 and new.rope_scaling.original_max_position_embeddings == 64
    assert new.head_dim == 16 and new.num_kv_heads == 2 and new.eos_token_ids == (2,)


@pytest.mark.parametrize("change,field", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
    ({"architectures": None}, "architectures"),
    ({"hidden_size": None}, "hidden_size"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"torch_dtype": "int8"}, "torch_dtype"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}}, "rope_scaling.low_freq_factor"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
])
def test_bad_config_names_the_field(change, field):
    d = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    with pytest.raises(ModelConfigError, match=field.replace(".", r"\.")):
        ModelConfig.from_dict(d)


def test_sliding_window_caps_context_and_qwen2_ignores_disabled_window():
    mistral = ModelConfig.from_dict({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 128})
    assert mistral.max_model_len == 128
    qwen = ModelConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 128,
                                  "use_sliding_window": False})
    assert qwen.max_model_len == 256 and qwen.attention_bias


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", True), ("qwen2", False)])
def test_parameter_count_equals_the_hf_models(arch, tied):
    """``ModelConfig.num_parameters`` (the engine logs it at load) counts what HF's model holds:
    Qwen2's q/k/v biases included, a tied embedding once."""
    d = {**BASE, "tie_word_embeddings": tied}
    if arch == "qwen2":
        d["architectures"] = ["Qwen2ForCausalLM"]
        hf = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in d.items() if k != "architectures"}))
    else:
        hf = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in d.items() if k != "architectures"}))
    assert ModelConfig.from_dict(d).num_parameters() == sum(p.numel() for p in hf.parameters())


def test_missing_directories_and_files_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ModelConfig.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="neither 'tiny-reasoner' nor an existing directory"):
        resolve_model_path(tmp_path / "nope")
    assert resolve_model_path(tmp_path) == tmp_path
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_weights(ModelConfig.from_pretrained(tmp_path), tmp_path, device="cpu", dtype=torch.float32)


def test_tiny_reasoner_resolves_to_the_package_folder():
    try:
        path = resolve_model_path("tiny-reasoner")
    except FileNotFoundError as e:  # not trained yet: the error says where it is expected
        assert "tiny_reasoner" in str(e)
    else:
        assert path.name == "tiny_reasoner" and (path / "config.json").is_file()


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{k: v for k, v in BASE.items() if k != "architectures"})).eval()


def test_sharded_checkpoint_loads_like_single(hf_model, tmp_path):
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    hf_model.save_pretrained(single)
    hf_model.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    config = ModelConfig.from_pretrained(single)
    a = load_weights(config, single, device="cpu", dtype=torch.float32)
    b = load_weights(config, sharded, device="cpu", dtype=torch.bfloat16)
    for x, y in zip(a.tensors(), b.tensors()):
        assert y.dtype == torch.bfloat16 and y.is_contiguous()
        torch.testing.assert_close(x.to(torch.bfloat16), y, rtol=0, atol=0)
    hf_q = hf_model.model.layers[1].self_attn.k_proj.weight
    torch.testing.assert_close(a.layers[1].qkv[64:96], hf_q, rtol=0, atol=0)  # q rows 0..63, k rows 64..95


def test_checkpoint_missing_a_tensor_names_it(hf_model, tmp_path):
    from safetensors.torch import save_file

    sd = {k: v.contiguous() for k, v in hf_model.state_dict().items() if "layers.1.mlp.up_proj" not in k}
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_weights(ModelConfig.from_pretrained(tmp_path), tmp_path, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>", "<think>", "</think>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["what is 12 + 7? let me think: 12 + 7 = 19. naïve café ünïcödé"] * 20, trainer)
    path = tmp_path_factory.mktemp("tok")
    tok.save(str(path / "tokenizer.json"))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 5]}))
    return path


def test_tokenizer_round_trip_and_special_ids(tokenizer_dir):
    tok = Tokenizer.from_pretrained(tokenizer_dir)
    text = "<think>12 + 7 = 19</think> café"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.think_start_id == 1 and tok.think_end_id == 2 and ids[0] == 1
    assert tok.eos_token_ids == (0, 5)
    assert tok.vocab_size >= 256


def test_tokenizer_without_think_tokens(tmp_path):
    tok = HFTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.save(str(tmp_path / "tokenizer.json"))
    t = Tokenizer.from_pretrained(tmp_path)
    assert t.think_start_id is None and t.think_end_id is None and t.eos_token_ids == ()


def test_incremental_decode_equals_full_decode_with_multibyte_chars(tokenizer_dir):
    tok = Tokenizer.from_pretrained(tokenizer_dir)
    text = "naïve 🙂 café ünïcödé: 12 + 7 = 19 🙂🙂"
    ids = tok.encode(text)
    dec = tok.incremental_decoder()
    deltas = [dec.add([i]) for i in ids]
    assert "".join(deltas) == text == dec.text
    assert all("\ufffd" not in d for d in deltas)
    assert any(d == "" for d in deltas)  # the emoji's bytes span several tokens and were held back


def test_find_stop():
    assert find_stop("abc STOP def", ["STOP"], new_chars=12) == 4
    assert find_stop("abc STOP def", ["STOP"], new_chars=3) is None  # already checked earlier
    assert find_stop("abcST", ["STOP"], new_chars=2) is None
    assert find_stop("x = 19\n\nThe", ["\n\n", "="], new_chars=11) == 2
