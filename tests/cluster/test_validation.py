import pytest

from thinkserve.cluster.config import LimitsConfig
from thinkserve.cluster.validation import InvalidField, ModelLimits, validate_generate
from thinkserve.protos.thinkserve.v1 import common_pb2
from thinkserve.protos.thinkserve.v1 import inference_pb2 as pb

LIMITS = LimitsConfig(max_prompt_tokens=100, max_tokens=1000, max_n=4)
MODEL = ModelLimits(vocab_size=300, max_model_len=512)


def encode(text):
    return list(text.encode())


def check(req):
    return validate_generate(req, LIMITS, MODEL, encode)


def field_of(req) -> str:
    with pytest.raises(InvalidField) as e:
        check(req)
    return e.value.field


def test_valid_request_fixes_a_seed_and_maps_priority():
    req = pb.GenerateRequest(text="hi", n=2, sampling=pb.SamplingParams(max_tokens=10, temperature=0.5),
                             priority=pb.PRIORITY_CLASS_INTERACTIVE, thinking_budget=5)
    spec = check(req)
    assert spec.prompt_token_ids == (104, 105)
    assert spec.params.n == 2 and spec.params.max_tokens == 10 and spec.params.thinking_budget == 5
    assert spec.params.seed is not None           # fixed at admission: resumes draw the same tokens
    assert spec.priority == 0
    assert check(pb.GenerateRequest(text="x", priority=pb.PRIORITY_CLASS_BATCH)).priority == 2
    assert check(pb.GenerateRequest(text="x", sampling=pb.SamplingParams(seed=7))).params.seed == 7


def test_each_bad_field_is_named():
    tid = pb.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[1, 300]))
    assert field_of(tid) == "prompt.token_ids"
    assert field_of(pb.GenerateRequest()) == "prompt"
    assert field_of(pb.GenerateRequest(text="")) == "prompt.text"
    assert field_of(pb.GenerateRequest(text="x" * 101)) == "prompt"
    assert field_of(pb.GenerateRequest(text="x", n=5)) == "n"
    assert field_of(pb.GenerateRequest(text="x", priority=9)) == "priority"
    assert field_of(pb.GenerateRequest(text="x", request_id="a b")) == "request_id"
    assert field_of(pb.GenerateRequest(text="x", request_id="a" * 200)) == "request_id"
    for sp, name in [(pb.SamplingParams(temperature=-1), "sampling.temperature"),
                     (pb.SamplingParams(top_p=0), "sampling.top_p"),
                     (pb.SamplingParams(top_k=0), "sampling.top_k"),
                     (pb.SamplingParams(max_tokens=0), "sampling.max_tokens"),
                     (pb.SamplingParams(max_tokens=1001), "sampling.max_tokens"),
                     (pb.SamplingParams(max_tokens=600), "sampling.max_tokens"),
                     (pb.SamplingParams(stop_token_ids=[999]), "sampling.stop_token_ids"),
                     (pb.SamplingParams(stop=[""]), "sampling.stop")]:
        assert field_of(pb.GenerateRequest(text="x", sampling=sp)) == name, name


def test_limits_that_come_from_the_model_and_engines():
    no_think = ModelLimits(vocab_size=300, max_model_len=512, has_thinking=False, max_num_seqs=2)
    with pytest.raises(InvalidField) as e:
        validate_generate(pb.GenerateRequest(text="x", thinking_budget=3), LIMITS, no_think, encode)
    assert e.value.field == "thinking_budget"
    with pytest.raises(InvalidField) as e:
        validate_generate(pb.GenerateRequest(text="x", n=3), LIMITS, no_think, encode)
    assert e.value.field == "n" and "<= 2" in str(e.value)


def test_temperature_and_top_p_outside_their_range_are_refused():
    for t in (float("inf"), float("-inf"), float("nan"), 1e30, 11.0, 0.001):
        req = pb.GenerateRequest(text="x", sampling=pb.SamplingParams(temperature=t))
        with pytest.raises(InvalidField) as e:
            check(req)
        assert e.value.field == "sampling.temperature" and "[0.01, 10.0]" in str(e.value), t
    for p in (float("nan"), float("inf"), 0.0, 1.5):
        with pytest.raises(InvalidField) as e:
            check(pb.GenerateRequest(text="x", sampling=pb.SamplingParams(top_p=p)))
        assert e.value.field == "sampling.top_p", p
    assert check(pb.GenerateRequest(text="x", sampling=pb.SamplingParams(temperature=10.0))).params.temperature == 10.0


def test_oversized_text_prompt_is_refused_before_tokenizing():
    import time

    calls = []

    def counting_encode(text):
        calls.append(len(text))
        return encode(text)

    limits = LimitsConfig(max_prompt_bytes=4096)
    big = pb.GenerateRequest(text="é" * 2**19)          # 1 MiB of UTF-8 (2 bytes a character)
    t0 = time.perf_counter()
    with pytest.raises(InvalidField) as e:
        validate_generate(big, limits, MODEL, counting_encode)
    elapsed = time.perf_counter() - t0
    assert e.value.field == "prompt.text"
    assert "1048576 bytes" in str(e.value) and "4096" in str(e.value) and "limits.max_prompt_bytes" in str(e.value)
    assert calls == [], "the prompt was tokenized before its size was checked"
    assert elapsed < 0.2, elapsed
    # At the limit it is tokenized and judged by its token count as before.
    with pytest.raises(InvalidField) as e:
        validate_generate(pb.GenerateRequest(text="x" * 4096), limits, MODEL, counting_encode)
    assert calls == [4096] and e.value.field == "prompt" and "tokens exceeds" in str(e.value)
def test_early_stop_maps_to_a_rule_and_unknown_values_are_named():
    assert check(pb.GenerateRequest(text="x", n=4)).early_stop is None        # the config decides
    assert check(pb.GenerateRequest(text="x", n=4, early_stop=pb.EARLY_STOP_UNBEATABLE)).early_stop == "unbeatable"
    assert check(pb.GenerateRequest(text="x", n=4, early_stop=pb.EARLY_STOP_ADAPTIVE)).early_stop == "adaptive"
    assert check(pb.GenerateRequest(text="x", n=4, early_stop=pb.EARLY_STOP_NONE)).early_stop == "none"
    assert field_of(pb.GenerateRequest(text="x", n=4, early_stop=9)) == "early_stop"


def test_submit_cli_sends_the_early_stop_rule():
    import argparse

    from thinkserve.cluster.submit_cli import add_arguments, build_request
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert build_request(p.parse_args(["q", "--n", "8", "--early-stop", "adaptive"])).early_stop == pb.EARLY_STOP_ADAPTIVE
    assert build_request(p.parse_args(["q"])).early_stop == pb.EARLY_STOP_UNSPECIFIED
