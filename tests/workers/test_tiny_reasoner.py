"""tiny-reasoner: the task family (pure Python) and the shipped model (loads with transformers,
solves easy problems greedily)."""
from __future__ import annotations

import random
import statistics

import pytest

from thinkserve.workers.tiny_reasoner import tasks
from thinkserve.workers.tiny_reasoner.tokenizer_build import EOS, build_tokenizer, token_id


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def output_tokens(tok, problem: tasks.Problem) -> int:
    """Reference completion length in tokens, EOS included."""
    return len(tok.encode(tasks.solution_for(problem), add_special_tokens=False).ids) + 1


# ---------------------------------------------------------------- tasks


def test_generator_is_deterministic_and_seed_dependent():
    for level in (2, 6, 9):
        a = tasks.generate_problems(level, 20, seed=3)
        assert a == tasks.generate_problems(level, 20, seed=3)
        assert a != tasks.generate_problems(level, 20, seed=4)
        assert all(p.level == level for p in a)


def test_answers_are_correct():
    p = tasks.make_problem(2, (37, 48))
    assert p.answer == 85
    assert tasks.make_problem(5, (27,)).answer == 111  # the famous one
    assert tasks.make_problem(4, (1,)).answer == 0
    for level in (4, 7):
        for p in tasks.generate_problems(level, 10, seed=0):
            (n,) = p.operands
            traj = tasks.collatz_trajectory(n)
            assert traj[-1] == 1 and len(traj) - 1 == p.answer
            lv = tasks.get_level(level)
            assert lv.lo <= p.answer <= lv.hi


def test_worked_solutions_follow_the_format():
    add = tasks.make_problem(2, (37, 48))
    assert tasks.prompt_for(add) == "37+48="
    assert tasks.solution_for(add) == "<think>7+8=15,3+4+1=8</think>answer: 85"
    col = tasks.make_problem(4, (6,))
    assert tasks.prompt_for(col) == "collatz(6)="
    lines = tasks.solution_for(col).split("</think>")[0].removeprefix("<think>").splitlines()
    # 6 -> 3 -> 10 -> 5 -> 16 -> 8 -> 4 -> 2 -> 1, values least significant digit first
    assert lines[:3] == ["000:600000", "001/300000", "002*010000"]
    assert lines[-1] == "008/100000" and len(lines) == 9
    assert tasks.solution_for(col).endswith("</think>answer: 8")


def test_train_and_test_splits_are_disjoint():
    test = {p.operands for p in tasks.generate_problems(6, 200, seed=0, split="test")}
    train = {p.operands for p in tasks.generate_problems(6, 200, seed=0, split="train")}
    assert test and train and not test & train


def test_chain_lengths_span_the_required_range(tok):
    lengths = {lv.level: [output_tokens(tok, p) for p in tasks.generate_problems(lv.level, 40, seed=1)] for lv in tasks.LEVELS}
    assert max(lengths[1]) <= 20  # easiest level: a few tokens
    assert min(lengths[9]) >= 1000  # hardest level: over a thousand
    means = [statistics.mean(lengths[lv.level]) for lv in tasks.LEVELS]
    assert means == sorted(means)  # length grows with the level
    assert max(max(v) for v in lengths.values()) <= 1536 - 16  # prompt + output fit the context


def test_realistic_mix_has_a_heavy_tail(tok):
    lengths = sorted(output_tokens(tok, p) for p in tasks.sample_mix(tasks.REALISTIC_MIX, 2000, seed=0))
    p50 = lengths[len(lengths) // 2]
    p99 = lengths[int(0.99 * len(lengths)) - 1]
    assert p99 >= 20 * p50, (p50, p99)


def test_tokenizer_round_trips_and_has_single_think_tokens(tok):
    p = tasks.make_problem(5, (27,))
    text = tasks.prompt_for(p) + tasks.solution_for(p)
    enc = tok.encode(text)
    assert enc.ids[0] == token_id("<s>")
    assert tok.decode(enc.ids) == text
    assert tok.encode("<think>", add_special_tokens=False).ids == [token_id("<think>")]
    assert tok.encode("</think>", add_special_tokens=False).ids == [token_id("</think>")]
    assert token_id(EOS) == 2


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>7+8=15</think>answer: 15", 15),
        ("answer: 42", 42),
        ("<think>answer: 3</think>answer: 7", 7),  # the line after </think> wins
        ("<think>000:100000\n</think>answer: 0", 0),
        ("<think>001/1000", None),  # cut off inside the chain
        ("<think>x</think>answer:", None),
        ("<think>x</think>answer: -12", -12),
        ("", None),
    ],
)
def test_parse_answer(text, expected):
    assert tasks.parse_answer(text) == expected


def test_unknown_level_is_refused():
    with pytest.raises(ValueError, match="level"):
        tasks.generate_problems(10, 1, seed=0)


# ---------------------------------------------------------------- shipped model


@pytest.fixture(scope="module")
def shipped():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from thinkserve.workers.loader import resolve_model_path

    path = resolve_model_path("tiny-reasoner")
    torch.set_num_threads(2)
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    return path, model, hf_tok


def test_shipped_model_files(shipped):
    import json

    path, model, _ = shipped
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == token_id(EOS)
    total = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    assert total <= 20 * 2**20, total
    assert config["max_position_embeddings"] >= 1536


def test_shipped_model_greedy_solves_easy_problems(shipped):
    import torch

    _, model, hf_tok = shipped
    problems = tasks.generate_problems(1, 6, seed=7) + tasks.generate_problems(2, 6, seed=7) + tasks.generate_problems(4, 4, seed=7)
    hf_tok.padding_side = "left"
    enc = hf_tok([tasks.prompt_for(p) for p in problems], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=120, do_sample=False, eos_token_id=hf_tok.eos_token_id,
                             pad_token_id=hf_tok.pad_token_id)
    texts = hf_tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    correct = [tasks.parse_answer(t) == p.answer for t, p in zip(texts, problems)]
    assert sum(correct) >= len(problems) - 1, list(zip(texts, problems))
    assert all(t.startswith("<think>") for t in texts)


def test_shipped_model_follows_the_worked_chain(shipped):
    """Teacher-forced on a long reference chain, the model predicts nearly every token."""
    import torch

    _, model, hf_tok = shipped
    p = tasks.make_problem(8, (random.Random(0).choice(tasks._collatz_pool(90, 95)),))
    prompt = hf_tok(tasks.prompt_for(p)).input_ids
    full = hf_tok(tasks.prompt_for(p) + tasks.solution_for(p)).input_ids + [hf_tok.eos_token_id]
    ids = torch.tensor([full])
    with torch.no_grad():
        pred = model(input_ids=ids).logits[0, :-1].argmax(-1)
    target = ids[0, 1:]
    mask = torch.arange(len(target)) >= len(prompt) - 1
    acc = (pred[mask] == target[mask]).float().mean().item()
    assert len(full) > 1000 and acc >= 0.99, acc


# ---------------------------------------------------------------- training script


def test_training_is_deterministic_and_writes_a_loadable_model(tmp_path):
    """Two tiny runs (1 step of each stage) with one seed give byte-identical weights that
    transformers loads; the digit-smoothed loss is the plain loss when epsilon is 0."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from thinkserve.workers.tiny_reasoner import train

    args = ["--steps", "1", "--calibrate-steps", "1", "--rows", "1", "--threads", "1", "--seed", "3", "--log-every", "1"]
    train.main(["--out", str(tmp_path / "a"), *args])
    train.main(["--out", str(tmp_path / "b"), *args])
    a = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "b" / "model.safetensors").read_bytes()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "training_meta.json"):
        assert (tmp_path / "a" / name).is_file(), name
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "a")
    assert model.config.vocab_size == 64

    ids = torch.tensor([[1, 11, 18, 12, 22, 4, 12, 2]])
    labels = ids.clone()
    labels[0, :5] = train.IGNORE
    logits = model(input_ids=ids).logits
    plain = model(input_ids=ids, labels=labels).loss
    assert torch.allclose(train.digit_smoothed_loss(logits, labels, 0.0), plain, atol=1e-5)
    assert train.digit_smoothed_loss(logits, labels, 0.1) != plain
