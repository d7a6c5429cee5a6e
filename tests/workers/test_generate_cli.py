"""`thinkserve generate` through the real CLI entry point."""
import json

from thinkserve.cluster.cli import main


def test_generate_json_prints_every_branch(tiny_llama_dir, capsys):
    rc = main(["generate", "--model", str(tiny_llama_dir), "--prompt-token-ids", "5,6,7", "--max-tokens", "4",
               "--n", "2", "--temperature", "1", "--seed", "11", "--ignore-eos", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_token_ids"] == [5, 6, 7]
    assert [o["index"] for o in out["outputs"]] == [0, 1]
    for o in out["outputs"]:
        assert len(o["token_ids"]) == 4 and o["finish_reason"] == "length" and isinstance(o["text"], str)
    # the same seed gives the same tokens
    main(["generate", "--model", str(tiny_llama_dir), "--prompt-token-ids", "5,6,7", "--max-tokens", "4",
          "--n", "2", "--temperature", "1", "--seed", "11", "--ignore-eos", "--json"])
    assert json.loads(capsys.readouterr().out) == out


def test_generate_text_prompt(tiny_llama_dir, capsys):
    assert main(["generate", "--model", str(tiny_llama_dir), "--prompt", "hi", "--max-tokens", "3"]) == 0
    assert capsys.readouterr().out


def test_bad_input_exits_2_naming_the_field(tiny_llama_dir, capsys):
    model = ["--model", str(tiny_llama_dir)]
    cases = [
        (["--prompt-token-ids", "1,x"], "--prompt-token-ids item 1"),
        (["--prompt-token-ids", "1,999"], "prompt_token_ids[1] = 999 is outside the vocabulary [0, 272)"),
        (["--prompt", "hi", "--top-p", "2"], "top_p must be in (0, 1]"),
        (["--prompt", "hi", "--max-tokens", "0"], "max_tokens must be >= 1"),
        (["--prompt", "x" * 600], "max_model_len is 512"),
    ]
    for argv, message in cases:
        assert main(["generate", *model, *argv]) == 2
        assert message in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_llama_dir / "missing"), "--prompt", "hi"]) == 2
    assert "missing" in capsys.readouterr().err
