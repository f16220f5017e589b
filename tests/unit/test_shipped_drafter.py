"""The shipped drafter's card describes the weights that ship with it.

A drafter's card (its README.md: data, commands, tau) and config were once committed
without the retrained ``model.safetensors`` beside them: the card promised one drafter and
users ran its predecessor. The card records the checkpoint's sha256 (``train/card.py``);
this test holds every shipped drafter to it.
"""

import re
from pathlib import Path

import pytest

from vllm_dflash2.train.card import WEIGHTS_SHA_LINE, weights_sha256

DRAFTERS = Path(__file__).resolve().parents[2] / "vllm_dflash2" / "drafters"
SHIPPED = sorted(p for p in DRAFTERS.iterdir() if (p / "config.json").is_file())
PATTERN = re.escape(WEIGHTS_SHA_LINE).replace(re.escape("{}"), "([0-9a-f]{64})")


def test_a_drafter_is_shipped():
    assert SHIPPED, f"no drafter folder with a config.json under {DRAFTERS}"


@pytest.mark.parametrize("folder", SHIPPED, ids=lambda p: p.name)
def test_card_names_the_weights_beside_it(folder):
    card = (folder / "README.md").read_text()
    found = re.findall(PATTERN, card)
    assert len(found) == 1, f"{folder.name}/README.md: expected one line like {WEIGHTS_SHA_LINE!r}"
    assert found[0] == weights_sha256(folder), (
        f"{folder.name}: the card's sha256 is not that of model.safetensors (card and weights "
        f"committed apart?)")


def test_hash_changes_with_the_weights(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"a")
    first = weights_sha256(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"b")
    assert weights_sha256(tmp_path) != first
