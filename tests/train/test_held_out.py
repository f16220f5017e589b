"""The held-out prompts ship inside the package and their loader refuses a missing file."""

import pytest

from vllm_dflash2.train.prompts import HELD_OUT_DIR, held_out_prompts


def test_held_out_prompts_are_package_data_of_both_kinds():
    assert HELD_OUT_DIR.parent.name == "train" and HELD_OUT_DIR.parent.parent.name == "vllm_dflash2"
    held = held_out_prompts()
    assert {p["kind"] for p in held} == {"code", "chat"}
    assert all(p["prompt"].strip() for p in held)


def test_a_missing_held_out_file_is_an_error_not_an_empty_set(tmp_path):
    (tmp_path / "code.jsonl").write_text('{"prompt": "x", "kind": "code"}\n')
    with pytest.raises(FileNotFoundError, match="chat.jsonl"):
        held_out_prompts(tmp_path)
