"""The engine returns the final hidden state (after the final norm) of sampled positions, for the
router's length probe: at each branch's first token, then every ``hidden_state_interval`` tokens.
Checked against Hugging Face's last hidden state of the same tokens."""
from __future__ import annotations

import pytest
import torch

from thinkserve.workers.engine import LLMEngine
from thinkserve.workers.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [list(range(10, 30)), [7, 99, 3, 250, 41, 41, 8]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)


def _hf_last_hidden(model, token_ids):
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_hidden_states=True)
    return out.hidden_states[-1][0]          # [T, hidden], after the final norm


def _collect(eng, prompts, params):
    """request -> [(output tokens after the step, hidden state)] and the final outputs."""
    seen, final = {}, {}
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    while eng.has_unfinished_requests():
        for o in eng.step():
            for c in o.outputs:
                if c.hidden_state is not None:
                    seen.setdefault((o.request_id, c.index), []).append((len(c.token_ids), c.hidden_state))
            if o.finished:
                final[o.request_id] = o
    return seen, final


def test_hidden_states_at_prefill_and_every_k_tokens_match_hf(tiny_llama):
    eng = LLMEngine.from_pretrained(str(tiny_llama.path), block_size=4, num_device_blocks=64,
                                    hidden_state_interval=4, max_num_batched_tokens=8)
    seen, final = _collect(eng, PROMPTS, GREEDY)
    for i, prompt in enumerate(PROMPTS):
        out = final[f"r{i}"].outputs[0].token_ids
        states = seen[(f"r{i}", 0)]
        assert [n for n, _ in states] == [1, 4, 8, 12]
        ref = _hf_last_hidden(tiny_llama.hf_model, prompt + out)
        for n, h in states:
            # token n was sampled from the position of the token before it
            expect = ref[len(prompt) + n - 2]
            assert len(h) == ref.shape[1]
            torch.testing.assert_close(torch.tensor(h), expect, atol=1e-4, rtol=1e-4)
            # and it is the state the logits came from: greedy token = argmax of lm_head · h
            lm_head = tiny_llama.hf_model.lm_head.weight
            assert int(torch.argmax(lm_head @ torch.tensor(h))) == out[n - 1]


def test_prefill_only_and_off(tiny_llama):
    eng = LLMEngine.from_pretrained(str(tiny_llama.path), block_size=4, num_device_blocks=64, hidden_state_interval=0)
    seen, _ = _collect(eng, PROMPTS[:1], GREEDY.replace(n=2, temperature=1.0, seed=3))
    assert sorted(seen) == [("r0", 0), ("r0", 1)] and all([n for n, _ in v] == [1] for v in seen.values())
    eng = LLMEngine.from_pretrained(str(tiny_llama.path), block_size=4, num_device_blocks=64)
    seen, final = _collect(eng, PROMPTS[:1], GREEDY)
    assert seen == {} and final["r0"].finished


def test_prefill_role_returns_the_hidden_state_with_the_prefilled_output(tiny_llama):
    eng = LLMEngine.from_pretrained(str(tiny_llama.path), block_size=4, num_device_blocks=64, role="prefill",
                                    hidden_state_interval=0)
    (out,) = eng.generate([PROMPTS[0]], GREEDY)
    assert out.prefilled and out.outputs[0].hidden_state is not None
    ref = _hf_last_hidden(tiny_llama.hf_model, PROMPTS[0])[-1]
    torch.testing.assert_close(torch.tensor(out.outputs[0].hidden_state), ref, atol=1e-4, rtol=1e-4)


def test_negative_interval_is_refused():
    from thinkserve.workers.config import EngineConfig
    with pytest.raises(ValueError, match="hidden_state_interval"):
        EngineConfig(hidden_state_interval=-1)
