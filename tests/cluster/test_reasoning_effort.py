"""reasoning_effort maps to the configured thinking budget (an explicit budget wins), the
priority class to the router's SLO class; the submit CLI sends the effort."""
import pytest

from thinkserve.cluster.config import LimitsConfig, parse_config
from thinkserve.cluster.submit_cli import build_request
from thinkserve.cluster.validation import InvalidField, ModelLimits, validate_generate
from thinkserve.protos.thinkserve.v1 import common_pb2, inference_pb2 as pb

LIMITS = LimitsConfig()
MODEL = ModelLimits(vocab_size=300, max_model_len=2048)
EFFORTS = parse_config({}).efforts()      # the config's budgets, as the frontend passes them


def spec(**kw):
    return validate_generate(pb.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[1, 2, 3]), **kw), LIMITS, MODEL,
                             lambda t: [1], EFFORTS)


def test_effort_sets_the_thinking_budget_and_an_explicit_budget_wins():
    assert spec(reasoning_effort=pb.REASONING_EFFORT_LOW).params.thinking_budget == 256
    assert spec(reasoning_effort=pb.REASONING_EFFORT_MEDIUM).params.thinking_budget == 1024
    assert spec(reasoning_effort=pb.REASONING_EFFORT_HIGH).params.thinking_budget is None
    assert spec().params.thinking_budget is None
    assert spec(reasoning_effort=pb.REASONING_EFFORT_LOW, thinking_budget=7).params.thinking_budget == 7
    with pytest.raises(InvalidField, match="reasoning_effort"):
        validate_generate(pb.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[1]), reasoning_effort=pb.REASONING_EFFORT_LOW),
                          LIMITS, ModelLimits(300, 2048, has_thinking=False), lambda t: [1], EFFORTS)


def test_priority_class_is_the_slo_class():
    assert [spec(priority=p).slo_class for p in (0, 1, 2, 3)] == ["standard", "interactive", "standard", "batch"]
    assert [spec(priority=p).priority for p in (1, 2, 3)] == [0, 1, 2]


def test_submit_sends_the_effort():
    import argparse

    from thinkserve.cluster.submit_cli import add_arguments
    p = argparse.ArgumentParser()
    add_arguments(p)        # the CLI's own parser, so every flag it reads is there
    req = build_request(p.parse_args(["1+2=", "--max-tokens", "16", "--priority", "interactive",
                                      "--reasoning-effort", "medium"]))
    assert req.reasoning_effort == pb.REASONING_EFFORT_MEDIUM and req.priority == pb.PRIORITY_CLASS_INTERACTIVE
