"""The OpenAI-format helpers without a cluster: reasoning split (whole or streamed in any pieces),
the chat template, and the mapping onto GenerateRequest."""
from __future__ import annotations

import json
import random

import pytest

from thinkserve.cluster.openai_format import (ChatCompletionRequest, ChatMessage, ChatTemplate, CompletionRequest,
                                              ReasoningSplitter, split_reasoning, to_generate_request)
from thinkserve.protos.thinkserve.v1 import inference_pb2 as pb

TEXTS = ["<think>7+8=15,3+4+1=8</think>answer: 85", "<think>unfinished chain", "plain answer", "",
         "<thi", "<think></think>", "  <think>a</think>b</think>c", "x<think>y</think>z"]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_split_equals_whole_split(text):
    whole = split_reasoning(text)
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        sp = ReasoningSplitter()
        r = c = ""
        for i, p in enumerate(pieces):
            dr, dc = sp.feed(p, final=i == len(pieces) - 1)
            r, c = r + dr, c + dc
        assert (r, c) == ((whole[0] or ""), whole[1]), pieces


def test_split_values():
    assert split_reasoning("<think>7+8=15</think>answer: 15") == ("7+8=15", "answer: 15")
    assert split_reasoning("no think") == (None, "no think")
    assert split_reasoning("<think>cut off") == ("cut off", "")
    assert split_reasoning("x<think>y</think>z") == (None, "x<think>y</think>z")    # only a leading block
    # the prompt opened the block (DeepSeek-R1 style): the output starts inside it
    assert split_reasoning("chain</think>42", starts_thinking=True) == ("chain", "42")


def test_chat_template_without_one(tmp_path):
    t = ChatTemplate(tmp_path)
    assert t.render([ChatMessage(role="user", content="37+48=")]) == "37+48="
    assert t.render([ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="hi")]) == \
        "system: be brief\nuser: hi\nassistant: "
    with pytest.raises(ValueError, match="messages"):
        t.render([ChatMessage(role="user", content=[{"type": "image_url", "image_url": {}}])])


def test_chat_template_from_tokenizer_config(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}"
                                             "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"}))
    t = ChatTemplate(tmp_path)
    assert t.render([ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])]) \
        == "<s>[user]ab[assistant]"


def test_mapping_onto_generate_request():
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                 max_completion_tokens=7, n=3, seed=4, temperature=0.5, stop="\n",
                                 reasoning_effort="low", early_stop="unbeatable", priority="batch",
                                 thinking_budget=10)
    req = to_generate_request(body, "x")
    assert req.sampling.max_tokens == 7                   # max_completion_tokens wins, as in OpenAI's API
    assert (req.n, req.sampling.seed, list(req.sampling.stop)) == (3, 4, ["\n"])
    assert req.reasoning_effort == pb.REASONING_EFFORT_LOW and req.early_stop == pb.EARLY_STOP_UNBEATABLE
    assert req.priority == pb.PRIORITY_CLASS_BATCH and req.thinking_budget == 10
    ids = to_generate_request(CompletionRequest(model="m", prompt=[1, 2, 3]), [1, 2, 3])
    assert list(ids.token_ids.ids) == [1, 2, 3] and ids.sampling.max_tokens == 16 and not ids.sampling.HasField("temperature")
